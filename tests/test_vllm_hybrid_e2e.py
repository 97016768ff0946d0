"""DDTree on a hybrid target (GatedDeltaNet + attention layers) end to end on vLLM-CPU.

vLLM-CPU's GatedDeltaNet kernels take bf16 activations only, and in bf16 vLLM's speculative
and non-speculative GDN kernels part at near-ties (vLLM's own DFlash chain leaves the
target-alone output within a few tokens on this model). So the reference is the tree path with
nothing accepted: budget 1 and the random drafter decode one token per step from the committed
state, through the same kernels. Deep trees, whose drafts replay that output (the oracle
drafter), must give exactly the same tokens: every node starts from its parent's state, and
after each walk the accepted leaf's state and the conv window of the accepted path become the
committed ones, for several requests at once.
"""

import pytest

from tests.vllm_runs import run_engines
from vllm_ddtree.testing import make_tiny_dflash, make_tiny_qwen3_next

pytest.importorskip("vllm")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25], [300] * 17]
HYBRID = {"mamba_ssm_cache_dtype": "float32", "enable_prefix_caching": False}
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTS = "vllm:spec_decode_num_drafts"


@pytest.mark.vllm_engine
def test_hybrid_trees_decode_exactly_what_single_token_steps_do(tmp_path, monkeypatch, tiny_spec):
    monkeypatch.setenv("VLLM_DDTREE_HYBRID", "1")
    target = make_tiny_qwen3_next(str(tmp_path / "tiny-qwen3-next"), tiny_spec)
    drafter = make_tiny_dflash(str(tmp_path / "tiny-dflash"), tiny_spec)

    def run(name, budget, oracle=None):
        spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4}
        entry = {
            "name": name,
            "kwargs": {**HYBRID, "speculative_config": {**spec, "tree_budget": budget}},
        }
        if oracle:
            entry["oracle"] = {"from": oracle, "p_top": 0.7}
        return entry

    runs = [run("single", 1), run("budget8", 8, "single"), run("budget32", 32, "single")]
    results, log = run_engines(target, runs, PROMPTS, max_tokens=32)
    assert "GatedDeltaNet tree path active" in log
    single = results["single"]
    assert single["metrics"][ACCEPTED] == 0  # the reference: one token per step
    for name in ("budget8", "budget32"):
        assert results[name]["tokens"] == single["tokens"], name
        metrics = results[name]["metrics"]
        assert 1 + metrics[ACCEPTED] / metrics[DRAFTS] > 2.0, (name, metrics)
