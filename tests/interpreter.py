"""Run a test module's Triton-kernel tests again under TRITON_INTERPRET=1 (CPU machines).

The interpreter flag must be set before Triton compiles anything, so the kernel tests run in a
fresh pytest process; the calling test fails unless that process passed exactly ``expected``
tests and skipped none of them.

With ``strict_scalars``, NumPy's deprecated conversion of a one-element array to a Python
scalar is an error there (``NUMPY_SCALAR_ERROR``): the interpreter hands a kernel's scalar loads
over as such arrays, and the GPU host's NumPy refuses the conversion (the GDN commit kernel
looping ``range(loaded + 1)`` failed there and passed here). Older kernels still convert such
arrays under the interpreter (TREE_ATTN's, the tree ops'), so it is opt-in per module.
"""

import os
import subprocess
import sys

NUMPY_SCALAR_ERROR = "error:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"


def run_under_interpreter(
    test_file: str, selection: str, expected: int, strict_scalars: bool = False
) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    warnings = ["-W", NUMPY_SCALAR_ERROR] if strict_scalars else []
    proc = subprocess.run(
        [
            sys.executable,
            *warnings,
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
