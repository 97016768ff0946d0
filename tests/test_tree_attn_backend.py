"""TREE_ATTN's registration in vLLM and its capability answers (no engine)."""

import pickle
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

import vllm_ddtree  # noqa: E402
from tree_attn_backend.backend import TreeAttentionBackend  # noqa: E402
from vllm_ddtree.config import DDTreeConfigError  # noqa: E402

vllm_ddtree.register()

TREE_ATTN = "tree_attn_backend.backend.TreeAttentionBackend"

SUPPORTED = dict(
    head_size=128,
    dtype=torch.bfloat16,
    kv_cache_dtype="auto",
    block_size=16,
    use_mla=False,
    has_sink=False,
    use_sparse=False,
    use_mm_prefix=False,
    use_per_head_quant_scales=False,
    device_capability=DeviceCapability(9, 0),
    attn_type="decoder",
)
SELECTOR_CONFIG = SimpleNamespace(use_mla=False, use_sparse=False)


@pytest.fixture
def empty_custom_slot():
    """vLLM's CUSTOM slot empty for the test (as the plugin leaves it when it loads), then as
    it was."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    held = _ATTN_OVERRIDES.pop(AttentionBackendEnum.CUSTOM, None)
    yield _ATTN_OVERRIDES
    _ATTN_OVERRIDES.pop(AttentionBackendEnum.CUSTOM, None)
    if held is not None:
        _ATTN_OVERRIDES[AttentionBackendEnum.CUSTOM] = held


def test_loading_the_plugin_names_tree_attn_and_leaves_the_custom_slot_empty(empty_custom_slot):
    from vllm_ddtree.compat import installer

    installer.apply()  # what the plugin's register() does in every process
    member = AttentionBackendEnum["TREE_ATTN"]
    assert member is AttentionBackendEnum.CUSTOM
    assert pickle.loads(pickle.dumps(member)) is member
    assert AttentionBackendEnum.CUSTOM not in empty_custom_slot


def test_an_engine_using_tree_attn_takes_the_slot(empty_custom_slot):
    from vllm_ddtree.compat.tree_attn_slot import take_slot

    take_slot()
    take_slot()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_path() == TREE_ATTN
    assert AttentionBackendEnum.CUSTOM.get_class() is TreeAttentionBackend


def test_cpu_platform_answers_tree_attn_when_selected(empty_custom_slot):
    from vllm.platforms.cpu import CpuPlatform

    from vllm_ddtree.compat.tree_attn_slot import take_slot

    # The slot empty: vLLM-CPU's own answer to CUSTOM, as without the plugin.
    path = CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, SELECTOR_CONFIG)
    assert path == AttentionBackendEnum.CPU_ATTN.get_path()
    take_slot()
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, None) == TREE_ATTN


def test_another_plugins_custom_backend_stops_only_engines_using_tree_attn(
    empty_custom_slot, tiny_target_path, tiny_drafter_path
):
    """Another plugin registered CUSTOM first: loading vllm-ddtree still works and leaves it
    there, a plain engine's config is made, and a DDTree engine is refused naming both."""
    from vllm_ddtree.compat import installer

    other = "other_plugin.attention.OtherBackend"
    empty_custom_slot[AttentionBackendEnum.CUSTOM] = other
    installer.apply()
    assert empty_custom_slot[AttentionBackendEnum.CUSTOM] == other
    plain = engine_config(tiny_target_path, None, attention_backend="CUSTOM")
    assert plain.attention_config.backend is AttentionBackendEnum.CUSTOM
    with pytest.raises(DDTreeConfigError, match=f"TREE_ATTN.*{other}"):
        engine_config(
            tiny_target_path, {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
        )
    assert empty_custom_slot[AttentionBackendEnum.CUSTOM] == other


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_supported_configurations_validate(head_size):
    assert (
        TreeAttentionBackend.validate_configuration(**{**SUPPORTED, "head_size": head_size}) == []
    )


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"head_size": 48}, "head_size"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"block_size": 8}, "block_size"),
        ({"use_non_causal": True}, "non-causal"),
        ({"has_sink": True}, "sink"),
        ({"attn_type": "encoder_only"}, "attention type"),
    ],
)
def test_unsupported_configurations_are_refused_with_a_reason(change, reason):
    reasons = TreeAttentionBackend.validate_configuration(**{**SUPPORTED, **change})
    assert any(reason in r for r in reasons), reasons


def test_kv_cache_shape_is_paged_and_split():
    assert TreeAttentionBackend.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    with pytest.raises(ValueError, match="multiple of 16"):
        TreeAttentionBackend.get_kv_cache_shape(10, 8, 8, 128)


def engine_config(target, spec, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=target, speculative_config=spec, skip_tokenizer_init=True, max_model_len=512, **kwargs
    ).create_engine_config()


def test_ddtree_selects_tree_attn_for_the_target_and_leaves_the_drafters_backend_as_the_chains(
    tiny_target_path, tiny_drafter_path
):
    """The drafter runs on the backend vLLM selects for the DFlash chain's drafter (the same
    kernels, so the chain and the trees draft at the same cost); a named one is kept."""
    config = engine_config(
        tiny_target_path, {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    )
    chain = engine_config(
        tiny_target_path,
        {"method": "dflash", "model": tiny_drafter_path, "num_speculative_tokens": 15},
    )
    assert config.attention_config.backend is AttentionBackendEnum.CUSTOM
    assert config.speculative_config.attention_backend == chain.speculative_config.attention_backend
    named = engine_config(
        tiny_target_path,
        {
            "method": "ddtree",
            "model": tiny_drafter_path,
            "tree_budget": 8,
            "attention_backend": "CPU_ATTN",
        },
    )
    assert named.speculative_config.attention_backend is AttentionBackendEnum.CPU_ATTN


def test_ddtree_refuses_a_target_backend_without_tree_attention(
    tiny_target_path, tiny_drafter_path
):
    with pytest.raises(DDTreeConfigError, match="CPU_ATTN cannot do tree attention"):
        engine_config(
            tiny_target_path,
            {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8},
            attention_backend="CPU_ATTN",
        )


def test_builder_treats_cuda_graph_padding_requests_as_causal():
    """A FULL CUDA-graph batch is padded past the requests the proposer published trees for:
    the padding requests must read as causal, the published ones keep their masks."""
    from types import SimpleNamespace

    from tree_attn_backend import tree_verify
    from tree_attn_backend.backend import TreeAttentionMetadataBuilder
    from vllm_ddtree.spec_decode.step_state import StepState

    builder = object.__new__(TreeAttentionMetadataBuilder)
    builder._is_tree = torch.full((8,), 7, dtype=torch.int32)  # stale values from earlier steps
    builder._tree_mask = torch.full((32, 2), -1, dtype=torch.int32)
    published = tree_verify.TreeVerifyBatch(
        is_tree=torch.tensor([1, 1, 0], dtype=torch.int32),
        tree_mask=torch.arange(9, dtype=torch.int32).view(9, 1),
    )
    padded = SimpleNamespace(  # 3 requests of 3 tokens, padded to 4 requests / 12 tokens
        num_reqs=4,
        num_actual_tokens=12,
        max_query_len=3,
        max_seq_len=10,
        query_start_loc=torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32),
        seq_lens=torch.tensor([10, 10, 10, 0], dtype=torch.int32),
        block_table_tensor=torch.zeros((4, 1), dtype=torch.int32),
        slot_mapping=torch.arange(12),
        positions=None,
    )
    assert not builder.build(0, padded).has_trees  # no source: plain causal attention
    state = StepState()
    group = SimpleNamespace(metadata_builders=[builder, SimpleNamespace()])  # + another kind
    assert tree_verify.bind_tree_source([[group]], state) == 1
    state.publish(published)
    metadata = builder.build(0, padded)
    assert metadata.is_tree.tolist() == [1, 1, 0, 0]
    assert metadata.tree_mask[:9, 0].tolist() == list(range(9))
    assert metadata.has_trees and metadata.tree_source is state
    assert state.built_slot_mapping is padded.slot_mapping  # where the KV commit reads slots
    assert metadata.context_lens is None  # no FlashAttention here: the kernel reads all keys
    state.publish(None)
    assert builder.build(0, padded).is_tree.tolist() == [0, 0, 0, 0]
    # Where FlashAttention computes the contexts' share, the padding request has none.
    builder.context_fa_version, builder.context_min_tokens = 3, 0  # "flash_attn"
    builder._context_lens = torch.full((8,), 99, dtype=torch.int32)
    builder._full_graphs, builder._max_graph_tokens, builder._graph_splits = True, 16, 32
    metadata = builder.build(0, padded)
    assert metadata.context_lens.tolist() == [7, 7, 7, 0]
    assert (metadata.context_fa_version, metadata.context_max_splits) == (3, 32)
    # A capture's made-up sequences are one token long: no context to read at all.
    metadata = builder.build_for_cudagraph_capture(padded)
    assert metadata.seq_lens.tolist() == [1, 1, 1, 1]
    assert metadata.context_lens.tolist() == [0, 0, 0, 0]


def test_the_context_switch_names_its_allowed_values(monkeypatch):
    from vllm_ddtree.envs import TREE_ATTN_CONTEXT as CONTEXT_ENV
    from vllm_ddtree.envs import tree_attn_context as context_choice

    monkeypatch.delenv(CONTEXT_ENV, raising=False)
    assert context_choice() == "auto"
    monkeypatch.setenv(CONTEXT_ENV, "Flash_Attn")
    assert context_choice() == "flash_attn"
    monkeypatch.setenv(CONTEXT_ENV, "triton")
    assert context_choice() == "triton"
    monkeypatch.setenv(CONTEXT_ENV, "fa3")
    with pytest.raises(ValueError, match="'auto', 'triton' or 'flash_attn'"):
        context_choice()


def test_by_default_flash_attention_takes_the_context_of_batches_of_many_query_tokens():
    """ "auto": FlashAttention's extra launch loses where a verify has few query tokens (one
    request, 16-32 nodes over a short context), so those batches keep the tree kernel alone.
    Every batch fills the contexts: a FULL graph captured on the FlashAttention path reads
    them when vLLM replays it for a batch it pads."""
    from types import SimpleNamespace

    from tree_attn_backend.backend import FLASH_CONTEXT_MIN_TOKENS, TreeAttentionMetadataBuilder

    builder = object.__new__(TreeAttentionMetadataBuilder)
    builder._is_tree = torch.zeros(16, dtype=torch.int32)
    builder._tree_mask = torch.zeros((512, 2), dtype=torch.int32)
    builder._context_lens = torch.full((16,), 99, dtype=torch.int32)
    builder._full_graphs, builder._max_graph_tokens, builder._graph_splits = True, 512, 32
    builder.context_fa_version, builder.context_min_tokens = 3, FLASH_CONTEXT_MIN_TOKENS

    def batch(requests, width):
        tokens = requests * width
        return SimpleNamespace(
            num_reqs=requests,
            num_actual_tokens=tokens,
            max_query_len=width,
            max_seq_len=100 + width,
            query_start_loc=torch.arange(0, tokens + 1, width, dtype=torch.int32),
            seq_lens=torch.full((requests,), 100 + width, dtype=torch.int32),
            block_table_tensor=torch.zeros((requests, 8), dtype=torch.int32),
            slot_mapping=torch.arange(tokens),
            positions=None,
        )

    one_tree = builder.build(0, batch(1, 17))  # one request, budget 16: the tree kernel
    assert one_tree.context_fa_version is None
    assert one_tree.context_lens.tolist() == [100]
    builder._context_lens.fill_(99)
    many = builder.build(0, batch(4, 17))  # 68 query tokens: FlashAttention
    assert (many.context_fa_version, many.context_max_splits) == (3, 32)
    assert many.context_lens.tolist() == [100] * 4
    assert FLASH_CONTEXT_MIN_TOKENS <= 68 and FLASH_CONTEXT_MIN_TOKENS > 33


def test_only_vllms_flash_attention_on_cuda_in_half_precision_takes_the_context():
    from tree_attn_backend.ops.context_attention import flash_attention_version, split_bound

    assert flash_attention_version(128, torch.bfloat16, torch.device("cpu")) is None
    assert flash_attention_version(128, torch.float32, torch.device("cuda")) is None
    # A verify's split-KV accumulators stay bounded; a decode keeps vLLM's bound.
    assert split_bound(32, 16, 32, 128) == 32
    assert split_bound(32, 16 * 65, 32, 128) == 15
    assert split_bound(32, 1 << 20, 32, 128) == 1
