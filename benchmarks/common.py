"""What the benchmarks share: the commit a run measured, and how a benchmark starts a copy of
itself in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The commit measured: $VLLM_DDTREE_COMMIT (hosts without the git metadata), else HEAD."""
    if os.environ.get("VLLM_DDTREE_COMMIT"):
        return os.environ["VLLM_DDTREE_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def module_command(module: str) -> list[str]:
    """The command that runs ``benchmarks.<module>`` in a fresh interpreter (run it with
    ``cwd=ROOT``, where the ``benchmarks`` package and the plugin's source are)."""
    return [sys.executable, "-m", f"benchmarks.{module}"]
