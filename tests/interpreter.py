"""Run a test module's Triton-kernel tests again under TRITON_INTERPRET=1 (CPU machines).

The interpreter flag must be set before Triton compiles anything, so the kernel tests run in a
fresh pytest process; the calling test fails unless that process passed exactly ``expected``
tests and skipped none of them.
"""

import os
import subprocess
import sys


def run_under_interpreter(test_file: str, selection: str, expected: int) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            test_file,
            "-k",
            selection,
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{expected} passed" in summary and "skipped" not in summary, summary
