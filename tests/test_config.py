"""DDTree speculative-config validation (pure Python, no engine)."""

import json
import os

import pytest

from vllm_ddtree.config import (
    DEFAULT_TREE_BUDGET,
    DDTreeConfigError,
    split_speculative_config,
)

VLLM_FIELDS = ["method", "model", "num_speculative_tokens", "attention_backend", "max_model_len"]
DFLASH = {"dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 2]}, "block_size": 16}


def split(raw, drafter=DFLASH, max_num_seqs=None):
    return split_speculative_config(
        raw, VLLM_FIELDS, drafter_config=drafter, max_num_seqs=max_num_seqs
    )


def test_ddtree_becomes_dflash_with_tree_settings_beside_it():
    vllm_part, ddtree = split(
        {"method": "ddtree", "model": "d", "num_speculative_tokens": 15, "tree_budget": 64}
    )
    # vLLM's draft width is the budget; the drafter keeps the depth.
    assert vllm_part == {"method": "dflash", "model": "d", "num_speculative_tokens": 64}
    assert (ddtree.tree_budget, ddtree.tree_top_k, ddtree.depth) == (64, 16, 15)
    assert ddtree.drafter_block_size == 16


def test_defaults_top_k_and_depth_from_the_drafter():
    vllm_part, ddtree = split({"method": "ddtree", "model": "d", "tree_budget": 64})
    assert ddtree.tree_top_k == 16
    assert ddtree.depth == 15 and vllm_part["num_speculative_tokens"] == 64


def test_the_default_budget_is_the_cost_model_s_choice(monkeypatch):
    """No tree_budget means "auto": on the V1 runner's packaged profile the chain is measured
    faster at every batch size, so the DFlash chain request comes back; on V2's (the paired
    run's fit), the largest tree at one request (budget 128), the chain at 16 requests (no tree
    predicted 10% faster) and trees at 256 (budget 16 judged at the largest measured batch, 64),
    there with a budget per batch size: 128 for a few requests down to 16 for many and no
    drafts where no tree's verify fits the largest graph, the engine's budget the largest."""
    assert DEFAULT_TREE_BUDGET == "auto"
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v1")
    vllm_part, ddtree = split({"method": "ddtree", "model": "d"})
    assert ddtree is None
    assert vllm_part == {"method": "dflash", "model": "d", "num_speculative_tokens": 15}
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    _, ddtree = split({"method": "ddtree", "model": "d"}, max_num_seqs=1)
    assert ddtree is not None and ddtree.tree_budget == 128
    vllm_part, ddtree = split({"method": "ddtree", "model": "d"}, max_num_seqs=16)
    assert ddtree is None and vllm_part["method"] == "dflash"
    vllm_part, ddtree = split({"method": "ddtree", "model": "d"}, max_num_seqs=256)
    entries = vllm_part["num_speculative_tokens_per_batch_size"]
    schedule = [entry for entry in entries if entry[0] <= 256]  # (past it: graphs only)
    assert schedule[0][:2] == [1, 4] and schedule[0][2] == 128
    # 16 nodes while 17 tokens a request fit the 2048-token graph, no drafts past it.
    assert schedule[-2][1:] == [120, 16] and schedule[-1] == [121, 256, 0]
    assert entries[len(schedule) :] == [[257, 257, 8]]  # budget 8's graphs, for moving online
    assert ddtree is not None and ddtree.tree_budget == 128
    assert vllm_part["num_speculative_tokens"] == 128


def test_small_budget_caps_top_k_at_the_budget():
    _, ddtree = split({"method": "ddtree", "model": "d", "tree_budget": 4})
    assert ddtree.tree_top_k == 4


def test_a_smaller_depth_than_the_block_is_legal():
    _, ddtree = split(
        {"method": "ddtree", "model": "d", "num_speculative_tokens": 7, "tree_budget": 8}
    )
    assert ddtree.depth == 7


def test_dashes_are_normalised():
    _, ddtree = split({"method": "ddtree", "model": "d", "tree-budget": 8})
    assert ddtree.tree_budget == 8


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("tree_budget", 0, r"'tree_budget'\] must be in 1\.\.1024, got 0"),
        ("tree_budget", 1025, r"'tree_budget'\] must be in 1\.\.1024, got 1025"),
        ("tree_budget", "64", r"'tree_budget'\] must be an int in 1\.\.1024"),
        ("tree_budget", True, r"'tree_budget'\] must be an int"),
        ("tree_budget", 8.0, r"'tree_budget'\] must be an int"),
        ("tree_top_k", 0, r"'tree_top_k'\] must be in 1\.\.64, got 0"),
        ("tree_top_k", 65, r"'tree_top_k'\] must be in 1\.\.64, got 65"),
        (
            "num_speculative_tokens",
            16,
            r"'num_speculative_tokens'\] must be in 1\.\.15 .*block_size 16",
        ),
        ("num_speculative_tokens", 0, r"'num_speculative_tokens'\] must be in 1\.\.15"),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_values(key, value, message):
    raw = {"method": "ddtree", "model": "d", "tree_budget": 64, key: value}
    with pytest.raises(DDTreeConfigError, match=message):
        split(raw)


def test_unknown_keys_are_named_with_the_allowed_ddtree_keys():
    with pytest.raises(
        DDTreeConfigError, match=r"unknown .*\['tree_depth'\].*tree_budget.*tree_top_k"
    ):
        split({"method": "ddtree", "model": "d", "tree_depth": 3})


def test_tree_keys_without_the_ddtree_method_are_refused():
    with pytest.raises(DDTreeConfigError, match=r"\['tree_budget'\] need \"method\": \"ddtree\""):
        split({"method": "dflash", "model": "d", "tree_budget": 8})


def test_other_methods_pass_through_untouched():
    raw = {"method": "ngram", "num_speculative_tokens": 3}
    assert split(raw) == (raw, None)


def test_a_drafter_without_dflash_config_is_refused():
    eagle = {"architectures": ["LlamaForCausalLMEagle3"]}
    with pytest.raises(DDTreeConfigError, match=r"not a DFlash drafter.*dflash_config"):
        split({"method": "ddtree", "model": "some/eagle3"}, drafter=eagle)


def test_missing_model_is_refused():
    with pytest.raises(DDTreeConfigError, match=r"'model'\] is required"):
        split({"method": "ddtree"})


def test_unknown_block_size_needs_an_explicit_depth():
    no_block = {"dflash_config": {"mask_token_id": 7, "target_layer_ids": [1]}}
    with pytest.raises(DDTreeConfigError, match="num_speculative_tokens.*required"):
        split({"method": "ddtree", "model": "d"}, drafter=no_block)
    spec = {"method": "ddtree", "model": "d", "num_speculative_tokens": 9, "tree_budget": 8}
    _, ddtree = split(spec, no_block)
    assert ddtree.depth == 9


def test_drafter_config_is_read_from_a_local_checkpoint(tmp_path):
    """The drafter's config.json from its directory: its block size gives the depth."""
    (tmp_path / "config.json").write_text(json.dumps({**DFLASH, "block_size": 12}))
    _, ddtree = split_speculative_config(
        {"method": "ddtree", "model": str(tmp_path), "tree_budget": 8}, VLLM_FIELDS
    )
    assert ddtree.drafter_block_size == 12 and ddtree.depth == 11


def test_the_runner_is_v2_for_dense_gpu_targets_unless_the_user_says(monkeypatch):
    """V2 for attention-only targets on one GPU or tensor-parallel GPUs (checked at TP = 2:
    ``benchmarks/results/2026-11-30_f59dea1_tp2-v2``), V1 for hybrids, pipeline parallel and
    the CPU."""
    from vllm_ddtree.config import choose_runner

    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    dense = dict(on_gpu=True, has_recurrent_layers=False, tensor_parallel_size=1)
    before = dict(os.environ)
    assert choose_runner(**dense) == "v2"
    assert dict(os.environ) == before  # the choice travels in the config, not the environment
    assert choose_runner(**{**dense, "has_recurrent_layers": True}) == "v1"
    assert choose_runner(**{**dense, "tensor_parallel_size": 2}) == "v2"
    assert choose_runner(**{**dense, "pipeline_parallel_size": 2}) == "v1"
    assert choose_runner(**{**dense, "on_gpu": False}) == "v1"
    assert choose_runner(**dense, vllm_runner_env="0") == "v1"
    assert choose_runner(**{**dense, "tensor_parallel_size": 2}, vllm_runner_env="1") == "v2"
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "V1")
    assert choose_runner(**dense) == "v1"
    with pytest.raises(DDTreeConfigError, match="VLLM_DDTREE_RUNNER=v1 and VLLM_USE_V2"):
        choose_runner(**dense, vllm_runner_env="1")
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    assert choose_runner(**{**dense, "tensor_parallel_size": 2}) == "v2"
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "fast")
    with pytest.raises(DDTreeConfigError, match="'fast': allowed values are 'v1' or 'v2'"):
        choose_runner(**dense)


def test_a_schedule_of_speculative_tokens_is_seen_in_either_spelling():
    from vllm_ddtree.config import gives_batch_size_schedule

    schedule = [[1, 1, 32], [2, 64, 8]]
    assert gives_batch_size_schedule({"num_speculative_tokens_per_batch_size": schedule})
    assert gives_batch_size_schedule({"num-speculative-tokens-per-batch-size": schedule})
    assert not gives_batch_size_schedule({"num_speculative_tokens_per_batch_size": None})
    assert not gives_batch_size_schedule({"method": "ddtree", "tree_budget": 32})


def test_options_are_refused_where_the_tree_step_cannot_apply_them():
    """Both runners serve penalties, allowed ids, bad words, structured outputs and logprobs
    in every mode, the whole vocabulary's included; the V2 runner refuses
    thinking_token_budget (as vLLM's does), naming where it is served."""
    from types import SimpleNamespace

    from vllm_ddtree.config import unsupported_sampling_params

    asks = SimpleNamespace(logprobs=3)
    for runner in ("v1", "v2"):  # whatever the engine's logprobs_mode: it is not asked
        assert unsupported_sampling_params(asks, runner) == []
    everything = SimpleNamespace(logprobs=-1)
    for runner in ("v1", "v2"):
        assert unsupported_sampling_params(everything, runner) == []
    assert unsupported_sampling_params(SimpleNamespace(logprobs=None), "v2") == []
    options = SimpleNamespace(
        logprobs=None,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        allowed_token_ids=[1, 2],
        bad_words=["w1"],
        structured_outputs=object(),
    )
    for runner in ("v1", "v2"):
        assert unsupported_sampling_params(options, runner) == []
    thinking = SimpleNamespace(logprobs=None, thinking_token_budget=16)
    assert unsupported_sampling_params(thinking, "v1") == []
    assert "VLLM_DDTREE_RUNNER=v1" in unsupported_sampling_params(thinking, "v2")[0]
