"""Write the series as ``git format-patch`` files against a vLLM source tree, and check it.

``export`` builds a scratch repository holding vLLM's versions of the files the series edits
(the rest of vLLM's tree does not change the patches), commits each ``PatchStep`` on top (the
generated modules and tests, new package markers, the hand-written edits) and writes the
series with ``git format-patch``. ``check`` applies a series with ``git am`` to a copy of a
whole vLLM tree, so a patch that does not apply cleanly to vLLM's sources fails it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from vllm_ddtree.upstream.edits import SUBSTITUTIONS, apply_edit, substitute
from vllm_ddtree.upstream.layout import (
    TESTS,
    data_target,
    in_tree_words,
    rewrite,
    source_and_target,
    unmapped_imports,
    unplaced_imports,
)
from vllm_ddtree.upstream.series import SERIES, PatchStep

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Commits of the scratch repositories: a fixed author and date, so a series regenerates
# byte for byte from the same sources.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "vllm-ddtree",
    "GIT_AUTHOR_EMAIL": "vllm-ddtree@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "vllm-ddtree",
    "GIT_COMMITTER_EMAIL": "vllm-ddtree@users.noreply.github.com",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
}


class ExportError(RuntimeError):
    """The series cannot be generated (a module without an in-tree place, a vLLM tree that
    is not 0.26.0's layout)."""


def _git(repo: str, *args: str, stdin: str | None = None) -> str:
    env = {**os.environ, **GIT_IDENTITY}
    result = subprocess.run(
        ["git", "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", *args],
        cwd=repo,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise ExportError(f"git {' '.join(args)} failed in {repo}:\n{result.stderr.strip()}")
    return result.stdout


# vLLM's files open with its license header (a pre-commit check).
SPDX_HEADER = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)


def format_like_vllm(repo: str, paths: list[str], vllm_src: str) -> None:
    """Sort imports and format ``paths`` (Python files in ``repo``) with ruff under vLLM's own
    configuration (its line length, its import sections): the rewritten module names change
    line lengths and import order."""
    config = os.path.join(vllm_src, "pyproject.toml")
    files = [os.path.join(repo, p) for p in paths if p.endswith(".py")]
    if not files:
        return
    ruff = [sys.executable, "-m", "ruff"]
    # In the scratch repository ruff cannot tell vLLM's own packages from third-party ones.
    first_party = "lint.isort.known-first-party = ['vllm', 'tests']"
    for args in (["check", "--fix-only", "--select", "I", "--quiet"], ["format", "--quiet"]):
        result = subprocess.run(
            [*ruff, *args, "--config", config, "--config", first_party, *files],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise ExportError(f"ruff {args[0]} failed:\n{result.stderr.strip()}")


def generated_files(step: PatchStep, project_root: str = PROJECT_ROOT) -> dict[str, str]:
    """In-tree path -> content of every file ``step`` generates from the project's sources."""
    sources = {}
    for module in step.modules:
        source, target = source_and_target(module, project_root)
        sources[target] = (source, module)
    sources.update({TESTS[t]: (t, t) for t in step.tests})
    files = {}
    for target, (source, module) in sources.items():
        with open(os.path.join(project_root, source)) as f:
            original = f.read()
        substituted = substitute(module, original, SUBSTITUTIONS)
        text = in_tree_words(rewrite(substituted))
        leftover = unplaced_imports(substituted, project_root) + unmapped_imports(text)
        if leftover:
            raise ExportError(
                f"{source} imports {', '.join(sorted(set(leftover)))}, which has no place in "
                "vLLM's tree: add it to vllm_ddtree/upstream/layout.py's MODULES and to a patch"
            )
        files[target] = SPDX_HEADER + text
    for path in step.data:
        with open(os.path.join(project_root, path)) as f:
            files[data_target(path)] = f.read()
    for target, docstring in step.packages.items():
        files[target] = SPDX_HEADER + (f'"""{docstring}"""\n' if docstring else "")
    return files


def edited_paths(project_root: str = PROJECT_ROOT) -> list[str]:
    """vLLM's files the series edits by hand (they must exist in the vLLM tree); not the
    series' own files a later patch edits."""
    generated = {source_and_target(m, project_root)[1] for step in SERIES for m in step.modules}
    generated |= {TESTS[test] for step in SERIES for test in step.tests}
    edited = {edit.path for step in SERIES for edit in step.edits}
    return sorted(edited - generated)


def export(vllm_src: str, out: str, project_root: str = PROJECT_ROOT) -> list[str]:
    """Write the series to ``out`` (emptied first) against the vLLM tree ``vllm_src``; returns
    the patch files in order."""
    out = os.path.abspath(out)  # git writes them from its scratch repository
    missing = [p for p in edited_paths() if not os.path.isfile(os.path.join(vllm_src, p))]
    if missing:
        raise ExportError(f"{vllm_src} is not a vLLM source tree: it lacks {', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="ddtree-series-") as repo:
        _git(repo, "init", "-q")
        for path in edited_paths():
            os.makedirs(os.path.dirname(os.path.join(repo, path)), exist_ok=True)
            shutil.copyfile(os.path.join(vllm_src, path), os.path.join(repo, path))
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "--allow-empty", "-m", "vLLM's files as released")
        base = _git(repo, "rev-parse", "HEAD").strip()
        for step in SERIES:
            files = generated_files(step, project_root)
            for path, content in files.items():
                if os.path.exists(os.path.join(vllm_src, path)):
                    raise ExportError(f"{path} already exists in {vllm_src}")
                target = os.path.join(repo, path)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "w") as f:
                    f.write(content)
            format_like_vllm(repo, list(files), vllm_src)
            for edit in step.edits:
                apply_edit(repo, edit)
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-F", "-", stdin=f"{step.subject}\n\n{step.body}\n")
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(out)
        names = _git(repo, "format-patch", "--no-signature", "-o", out, f"{base}..HEAD")
    return [line for line in names.splitlines() if line]


def check(vllm_src: str, patches: list[str]) -> None:
    """Apply ``patches`` in order with ``git am`` to a copy of the vLLM tree ``vllm_src``;
    raises ``ExportError`` naming the first that does not apply."""
    with tempfile.TemporaryDirectory(prefix="ddtree-check-") as scratch:
        tree = os.path.join(scratch, "vllm")
        shutil.copytree(vllm_src, tree, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        _git(tree, "init", "-q")
        _git(tree, "add", "-A")
        _git(tree, "commit", "-q", "-m", "vLLM as released")
        for patch in patches:
            try:
                _git(tree, "am", "-q", "--whitespace=nowarn", os.path.abspath(patch))
            except ExportError as exc:
                raise ExportError(f"{os.path.basename(patch)} does not apply: {exc}") from exc
