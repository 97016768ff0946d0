"""vLLM's GatedDeltaNet metadata in a DDTree engine: a tree step's built without a device wait.

vLLM 0.26.0's ``GDNAttentionMetadataBuilder.build`` picks a step's speculative rows with a
host boolean mask over device tensors (``block_table[mask_cpu, :1 + num_spec]``,
``num_accepted_tokens[mask_cpu]``). PyTorch sends the mask's row indices to the device from
pageable memory, and such a copy first waits for every launch queued before it: each build (one
per group of GDN layers, several a forward) holds the host until the device drains, so the next
forward's inputs are not ready when the device finishes this one.

In a decode step where every request verifies a tree, the speculating rows come first and the
rest are CUDA-graph padding without tokens (vLLM's own code relies on that order for
``spec_query_start_loc``): the mask is a prefix, and slices give the same tensors with nothing
copied. ``tree_step_metadata`` builds that step, field for field what vLLM's build gives
(``tests/test_gdn_metadata.py`` compares every field); any other step (a prefill, a plain
decode, a mask that is not a prefix) returns None and vLLM builds it.

vLLM's build calls ``tree_step_build`` at its start (the tree-step build, for DDTree engines
only: a DFlash chain in the same process keeps vLLM's own) and ``finish_build`` at its end
(vLLM-CPU's state indices made contiguous; the index checks under
``VLLM_DDTREE_CHECK_INDICES=1``); the plugin wraps the build once per worker to make both calls
(``compat/gdn_dispatch.build_wrapper``).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.hybrid.gdn_layer import check_index_range, checking_indices

# The state-index fields of vLLM's GatedDeltaNet metadata (all index the mamba cache's blocks).
GDN_METADATA_BLOCK_FIELDS = (
    "spec_state_indices_tensor",
    "non_spec_state_indices_tensor",
    "prefill_state_indices",
)


def check_gdn_metadata(metadata, num_blocks: int) -> None:
    """Raise unless every state-block index of vLLM's GatedDeltaNet ``metadata`` lies in
    ``[0, num_blocks)`` and ``num_accepted_tokens`` in ``[1, columns]`` of its spec table
    (``VLLM_DDTREE_CHECK_INDICES=1``: vLLM's own prefill gathers states by these indices)."""
    for name in GDN_METADATA_BLOCK_FIELDS:
        index = getattr(metadata, name, None)
        if index is not None and index.numel():
            check_index_range(f"vLLM GDN metadata {name}", index, num_blocks)
    spec = getattr(metadata, "spec_state_indices_tensor", None)
    accepted = getattr(metadata, "num_accepted_tokens", None)
    if spec is not None and accepted is not None and accepted.numel():
        check_index_range("vLLM GDN metadata num_accepted_tokens - 1", accepted - 1, spec.shape[-1])


def contiguous_cpu_state_indices(metadata) -> None:
    """Make vLLM's GatedDeltaNet state indices contiguous where they sit on the CPU, in place.

    A step without speculative rows (every request decoding one token: near
    ``max_model_len`` vLLM's scheduler gives no drafts) takes its decode indices as column 0
    of the speculative block table, a strided view, and vLLM-CPU's decode kernel
    (``fused_sigmoid_gating_delta_rule_update_cpu``) refuses it ("tensor must be contiguous
    at last dimension"): the engine died, with vLLM's own DFlash chain as with trees. vLLM's
    CUDA kernels take strides (and its CUDA-graph path copies the indices into a buffer).
    The kernel checks the last dimension's stride, which ``is_contiguous`` ignores for a
    single request: that stride is what is checked here."""
    for name in GDN_METADATA_BLOCK_FIELDS:
        index = getattr(metadata, name, None)
        if index is None or index.device.type != "cpu" or not index.dim():
            continue
        if index.stride(-1) != 1:
            setattr(metadata, name, index.clone(memory_format=torch.contiguous_format))


def is_ddtree_builder(builder) -> bool:
    """Whether ``builder`` (vLLM's GDN metadata builder) serves a DDTree engine (whose
    speculative config vLLM sees as DFlash's, with the DDTree settings attached)."""
    return get_ddtree_config(getattr(builder.vllm_config, "speculative_config", None)) is not None


def tree_rows(num_decode_draft_tokens_cpu: torch.Tensor, query_start_loc_cpu: torch.Tensor):
    """The number of leading rows that verify drafts when this step is a tree step as defined
    above (every row with tokens speculates, and those rows come first); None otherwise.

    ``num_decode_draft_tokens_cpu`` int ``[R]`` (vLLM's: the drafts of a row scheduled as
    ``1 + drafts`` decode tokens, -1 for any other row), ``query_start_loc_cpu`` int
    ``[R + 1]``; host tensors, read on the host only."""
    drafts = num_decode_draft_tokens_cpu.numpy()
    speculative = drafts >= 0
    rows = int(speculative.sum())
    if rows == 0 or int(drafts[speculative].sum()) == 0:
        return None  # vLLM builds such a step without speculative rows
    query_lens = np.diff(query_start_loc_cpu.numpy())
    if not speculative[:rows].all() or query_lens[rows:].any():
        return None
    return rows


def tree_step_metadata(builder, m, num_accepted_tokens, num_decode_draft_tokens_cpu):
    """vLLM's ``GDNAttentionMetadata`` for a tree step (``tree_rows``) of ``builder`` and
    its ``CommonAttentionMetadata`` ``m``, built with slices in place of host masks; None
    for any other step."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, mamba_get_block_table_tensor

    if not builder.use_spec_decode or num_decode_draft_tokens_cpu is None:
        return None
    rows = tree_rows(num_decode_draft_tokens_cpu, m.query_start_loc_cpu)
    if rows is None:
        return None
    device = m.query_start_loc.device
    width = builder.num_spec + 1
    num_tokens = int(m.query_start_loc_cpu[-1])
    block_table = mamba_get_block_table_tensor(
        m.block_table_tensor,
        m.seq_lens,
        builder.kv_cache_spec,
        builder.vllm_config.cache_config.mamba_cache_mode,
    )
    batch = m.num_reqs
    # vLLM's mask (drafts >= 0) is this prefix: made on the device, no pinned copy per group.
    masks = torch.arange(batch, device=device) < rows
    state_indices = block_table[:rows, :width]
    query_start_loc = m.query_start_loc[: rows + 1]
    accepted = num_accepted_tokens[:rows]
    token_indices = torch.arange(min(rows * width, num_tokens), dtype=torch.int32, device=device)
    no_token_indices = torch.empty(0, dtype=torch.int32, device=device)
    if (
        builder.use_full_cuda_graph
        and rows <= builder.decode_cudagraph_max_bs
        and num_tokens <= builder.decode_cudagraph_max_bs
    ):  # into the builder's persistent buffers, padded as vLLM pads them
        builder.spec_state_indices_tensor[:rows].copy_(state_indices, non_blocking=True)
        state_indices = builder.spec_state_indices_tensor[:batch]
        state_indices[rows:].fill_(NULL_BLOCK_ID)
        builder.spec_sequence_masks[:rows].copy_(masks[:rows], non_blocking=True)
        masks = builder.spec_sequence_masks[:batch]
        masks[rows:].fill_(False)
        no_token_indices = builder.non_spec_token_indx[:0]
        builder.spec_token_indx[: token_indices.size(0)].copy_(token_indices, non_blocking=True)
        token_indices = builder.spec_token_indx[: token_indices.size(0)]
        builder.spec_query_start_loc[: rows + 1].copy_(query_start_loc, non_blocking=True)
        last = query_start_loc[-1]
        query_start_loc = builder.spec_query_start_loc[: batch + 1]
        query_start_loc[rows + 1 :].fill_(last)
        builder.num_accepted_tokens[:rows].copy_(accepted, non_blocking=True)
        accepted = builder.num_accepted_tokens[:batch]
        accepted[rows:].fill_(1)
    return GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=rows,
        num_spec_decode_tokens=num_tokens - int(m.query_start_loc_cpu[0]),
        num_actual_tokens=m.num_actual_tokens,
        spec_query_start_loc=query_start_loc,
        spec_state_indices_tensor=state_indices,
        spec_sequence_masks=masks,
        spec_token_indx=token_indices,
        non_spec_token_indx=no_token_indices,
        num_accepted_tokens=accepted,
    )


def tree_step_build(builder, m, num_accepted_tokens, num_decode_draft_tokens_cpu):
    """The start of ``GDNAttentionMetadataBuilder.build`` in a DDTree engine: a tree step's
    metadata (``tree_step_metadata``), finished (``finish_build``); None where vLLM builds
    (any other step, any other engine: a DFlash chain in the same process keeps vLLM's)."""
    if not is_ddtree_builder(builder):
        return None
    metadata = tree_step_metadata(builder, m, num_accepted_tokens, num_decode_draft_tokens_cpu)
    return None if metadata is None else finish_build(builder, metadata)


def finish_build(builder, metadata):
    """The end of ``GDNAttentionMetadataBuilder.build``: on vLLM-CPU the state indices made
    contiguous (``contiguous_cpu_state_indices``) and, while ``VLLM_DDTREE_CHECK_INDICES=1``,
    checked against the engine's block count (``check_gdn_metadata``). Returns
    ``metadata``."""
    contiguous_cpu_state_indices(metadata)
    num_blocks = getattr(builder.vllm_config.cache_config, "num_gpu_blocks", None)
    if num_blocks and checking_indices():
        check_gdn_metadata(metadata, num_blocks)
    return metadata
