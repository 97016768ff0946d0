"""DDTree on a hybrid target with prefix caching, end to end on vLLM-CPU.

With prefix caching vLLM keeps a GatedDeltaNet target's states in its ``align`` layout: the
state at the end of every block of tokens is kept for later requests whose prompts start with
those tokens, and each step's speculative state blocks move along with the request. The tree
path leaves each step's accepted path where vLLM's chain would (``gdn_layer``), so vLLM's own
copies serve it.

The reference is the tree path with nothing accepted (budget 1, the random drafter), with the
same engine settings: on vLLM-CPU the GDN kernels take bf16 activations, and a state computed by
the chunked prefill kernel parts from one computed token by token at bf16 near-ties, so
the reference must meet the same cache hits as the trees (``tests/test_vllm_hybrid_e2e.py``
says more). The requests here run one phase after another, so both see the same cached blocks:
prompts whose states were computed by a prefill (its chunks end on block boundaries in the
``align`` layout). Deep trees (the oracle drafter replaying the reference) must give exactly
the reference's tokens, and every engine must hit the cache as often.

A tiny Qwen3.5 with small GDN states (``SMALL_STATE_GDN_HEADS``) keeps vLLM's blocks at 32
tokens, so prompts of a hundred tokens cover several.
"""

import pytest

from tests.vllm_runs import run_engines
from vllm_ddtree.testing import (
    SMALL_STATE_GDN_HEADS,
    TinyQwen3Spec,
    make_tiny_dflash,
    make_tiny_qwen3_5,
)

pytest.importorskip("vllm")

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTS = "vllm:spec_decode_num_drafts"
HITS = "vllm:prefix_cache_hits"
BLOCK = 32  # tokens per KV block and per cached state (align layout)
ENGINE = {
    "language_model_only": True,
    "mamba_ssm_cache_dtype": "float32",
    "enable_prefix_caching": True,
    "block_size": BLOCK,
    "max_model_len": 256,
}


@pytest.fixture(scope="module")
def small_state_pair(tmp_path_factory) -> tuple[str, str]:
    spec = TinyQwen3Spec()
    folder = tmp_path_factory.mktemp("hybrid-prefix")
    target = make_tiny_qwen3_5(str(folder / "qwen3_5"), spec, gdn_heads=SMALL_STATE_GDN_HEADS)
    return target, make_tiny_dflash(str(folder / "dflash"), spec)


def run(drafter: str, name: str, budget: int, oracle: str | None = None, **engine) -> dict:
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4}
    entry = {"name": name, "kwargs": {**ENGINE, **engine, "speculative_config": spec}}
    spec["tree_budget"] = budget
    if oracle:
        entry["oracle"] = {"from": oracle, "p_top": 0.7}
    return entry


def check_trees_equal_reference(results: dict, reference: str, trees: list[str]) -> None:
    """Every tree engine: the reference's tokens, its cache hits (and some), deep acceptance;
    the reference accepted nothing (one token a step) and was in vLLM's align layout."""
    ref = results[reference]
    assert ref["cache"]["mamba_cache_mode"] == "align", ref["cache"]
    assert ref["cache"]["mamba_block_size"] == BLOCK, ref["cache"]
    assert ref["metrics"][ACCEPTED] == 0
    assert ref["metrics"][HITS] > 0, ref["metrics"]
    for name in trees:
        got = results[name]
        assert got["tokens"] == ref["tokens"], name
        metrics = got["metrics"]
        assert metrics[HITS] == ref["metrics"][HITS], (name, metrics)
        assert 1 + metrics[ACCEPTED] / metrics[DRAFTS] > 2.0, (name, metrics)


@pytest.mark.vllm_engine
def test_a_conversations_next_turn_resumes_from_its_cached_prefix(small_state_pair):
    """Two conversations, a turn each, then each one's next turn: its prompt is the first
    turn's prompt, the answer and new tokens, and resumes from the states cached at the block
    boundaries of the first prompt. Trees of 8 and 16 nodes answer both turns as the
    reference does, with the same cache hits."""
    target, drafter = small_state_pair
    first_turns = [list(range(5, 105)), list(range(200, 290))]
    answers = 24  # within the first prompts' last block: its state is a prefill's
    reference = run(drafter, "single", 1)
    results, _ = run_engines(target, [reference], first_turns, max_tokens=answers)
    said = results["single"]["tokens"]
    second_turns = [first_turns[0] + said[0] + [7, 8, 9], first_turns[1] + said[1][:10] + [50]]
    phases = {"phases": [2, 2]}
    runs = [
        {**reference, **phases},
        {**run(drafter, "budget8", 8, "single"), **phases},
        {**run(drafter, "budget16", 16, "single"), **phases},
    ]
    results, log = run_engines(target, runs, first_turns + second_turns, max_tokens=answers)
    assert "GatedDeltaNet tree path active" in log
    check_trees_equal_reference(results, "single", ["budget8", "budget16"])
    assert results["single"]["tokens"][:2] == said


@pytest.mark.vllm_engine
def test_chunked_prefill_of_a_long_prompt_then_its_reuse(small_state_pair):
    """A prompt of 150 tokens prefilled in chunks of at most 64 tokens (vLLM ends each chunk on
    a block boundary in the align layout, caching its state), decoded with trees; then a prompt
    that shares its first 140 tokens resumes from those cached states."""
    target, drafter = small_state_pair
    long_prompt = [(7 * i + 3) % 1000 for i in range(150)]
    prompts = [long_prompt, long_prompt[:140] + [11, 12, 13, 14]]
    chunked = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}
    phases = {"phases": [1, 1]}
    runs = [
        {**run(drafter, "single", 1, **chunked), **phases},
        {**run(drafter, "budget8", 8, "single", **chunked), **phases},
    ]
    results, _ = run_engines(target, runs, prompts, max_tokens=24)
    check_trees_equal_reference(results, "single", ["budget8"])


@pytest.mark.vllm_engine
def test_a_tree_wider_than_a_state_block_is_refused_as_the_engine_starts(small_state_pair):
    """vLLM fixes a hybrid's block size as the engine starts (``--block-size`` 16 here, raised
    to hold a layer's state: 48 tokens at budget 48). A verify of ``1 + tree_budget`` tokens
    could then cross two block boundaries, whose states the align layout cannot both keep: the
    engine stops at start naming the budget that fits and the flags that fix it."""
    target, drafter = small_state_pair
    too_wide = run(drafter, "budget48", 48, block_size=16)
    with pytest.raises(AssertionError, match=r"tree_budget=48 .*tree_budget <= 47"):
        run_engines(target, [too_wide], [[5, 6, 7]], max_tokens=4)
