"""The suite's grouping under pytest-xdist (``tests/xdist_groups.py``), run on a small suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from vllm_ddtree.upstream.export import PROJECT_ROOT

SUITE = """
import pytest


@pytest.fixture(scope="module")
def built():
    return object()


@pytest.mark.parametrize("i", range(4))
def test_shared(built, i):
    pass


@pytest.mark.parametrize("i", range(4))
def test_alone(i):
    pass
"""


def test_tests_of_a_module_scoped_fixture_stay_on_one_worker(tmp_path):
    """The fixture is built once: its tests run on one worker, the others are dealt to both."""
    (tmp_path / "conftest.py").write_text(
        "from tests.xdist_groups import pytest_collection_modifyitems  # noqa: F401\n"
    )
    (tmp_path / "test_suite.py").write_text(SUITE)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            "test_suite.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PROJECT_ROOT, "PYTEST_ADDOPTS": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    workers: dict[str, set[str]] = {}
    for worker, test in re.findall(r"\[(gw\d)\].* PASSED test_suite.py::(test_\w+)", run.stdout):
        workers.setdefault(test, set()).add(worker)
    assert set(workers) == {"test_shared", "test_alone"}, run.stdout
    assert len(workers["test_shared"]) == 1, run.stdout
