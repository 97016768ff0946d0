"""Every Triton kernel of the serving path compiles for the H100/H200 (sm_90) at served shapes,
without spilling, on a machine without a GPU.

The CPU tests run the kernels under Triton's interpreter, which never compiles them: a kernel
can pass there and still fail to compile for the GPU, or spill registers to local memory
(slow). ``tests/helpers/compile_kernels.py`` compiles each launch for sm_90 with Triton's own
ptxas, at Qwen3-8B's and Qwen3.6-27B's shapes and serving's dtypes, and reports each cubin's
resources; this test runs it in a fresh process and checks them.
"""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.common import ROOT

# Each case and the kernels its launches compile (the cases run what they say they run).
EXPECTED_KERNELS = {
    **{
        f"gdn_tree_verify_b{b}": {"_tree_causal_conv1d_kernel", "_tree_gated_delta_kernel"}
        for b in (16, 32, 64, 128)
    },
    "gdn_commit_b32": {"_commit_gdn_states_kernel"},
    "gdn_commit_b128": {"_commit_gdn_states_kernel"},
    "tree_attention_8b_b64": {"_tree_attention_kernel", "_combine_kernel"},
    "tree_attention_27b_b32": {"_tree_attention_kernel", "_combine_kernel"},
    "kv_commit_8b": {"_commit_accepted_kv_kernel"},
    "kv_commit_27b": {"_commit_accepted_kv_kernel"},
    **{
        f"tree_step_b{b}": {
            "_tree_step_inputs_kernel",
            "_walk_and_emit_kernel",
            "_move_path_rows_kernel",
        }
        for b in (64, 512)
    },
    **{
        case: {
            "_segment_stats_kernel",
            "_segment_top_kernel",
            "_merge_top_kernel",
            "_build_tree_kernel",
        }
        for case in ("tree_build_8b_b64", "tree_build_27b_b512")
    },
}
MAX_REGISTERS = 255  # per thread on sm_90
MAX_SHARED_BYTES = 227 * 1024  # dynamic shared memory per block (opt-in) on the H100/H200


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.compile_kernels", "--arch", "90"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_case_compiles_its_kernels(compiled):
    by_case: dict[str, set[str]] = {}
    for row in compiled:
        by_case.setdefault(row["case"], set()).add(row["kernel"])
    assert by_case == EXPECTED_KERNELS


@pytest.mark.parametrize("case", sorted(EXPECTED_KERNELS))
def test_no_kernel_spills_or_overflows(compiled, case):
    """Registers within sm_90's limit, no local memory or stack (spills), shared memory
    within the H100/H200's per-block limit."""
    rows = [row for row in compiled if row["case"] == case]
    assert rows, f"{case} compiled nothing"
    for row in rows:
        where = f"{case}: {row['kernel']} {row}"
        assert row["REG"] <= MAX_REGISTERS, where
        assert row["LOCAL"] == 0 and row["STACK"] == 0, f"spills: {where}"
        assert row["shared"] <= MAX_SHARED_BYTES, where
