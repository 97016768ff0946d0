"""A verify step's tree inputs in one launch: Triton kernel, launcher and PyTorch reference.

Before the target's verify forward, every query token of a tree request needs two things:
its RoPE position (the root's position plus the node's depth, instead of vLLM's sequential
position) and its bit-packed ancestor row for TREE_ATTN (``pack_tree_mask`` layout). The
reference does it with per-token gathers over the whole step (~20 tensor ops); the kernel runs
one program per (request, tree index) that climbs the node's parent chain, writes the row, and
moves the position.

Layout of the step (vLLM's flattened query tokens): request ``r``'s tree is tokens
``query_start[r] .. query_start[r] + num_draft[r]`` (root first; node ``i - 1`` at
``query_start[r] + i``). Tokens of tree index past ``num_nodes[r]`` (scheduled padding) and
tokens of requests without drafts keep their positions and get an all-zero row.

Shapes: ``query_start``, ``num_draft``, ``num_scheduled`` long ``[R]``; ``positions`` long
``[>= T]`` (updated in place); output int32 ``[T, ceil((N + 1) / 32)]``.
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops.tree_mask import HAS_TRITON, packed_ancestor_mask_ref
from vllm_ddtree.tree import DDTreeBatch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from vllm_ddtree.ops.tree_mask import ancestor_row


def tree_step_inputs_ref(
    trees: DDTreeBatch,
    query_start: torch.Tensor,
    num_draft: torch.Tensor,
    num_scheduled: torch.Tensor,
    positions: torch.Tensor,
    total_tokens: int,
) -> torch.Tensor:
    """PyTorch reference: node positions (in place) and int32 ``[T, W]`` ancestor rows."""
    num_reqs, width = trees.token_ids.shape
    device = query_start.device
    request_of_token = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), num_scheduled, output_size=total_tokens
    )
    root_of_token = query_start[request_of_token]
    tree_index = torch.arange(total_tokens, device=device) - root_of_token
    in_tree = (tree_index >= 0) & (tree_index <= trees.num_nodes[request_of_token])
    in_tree &= (num_draft > 0)[request_of_token]
    node = (tree_index - 1).clamp(min=0, max=max(width - 1, 0))
    is_node = in_tree & (tree_index >= 1)
    step_positions = positions[:total_tokens]
    if width:
        depth = trees.depths[request_of_token, node]
        node_position = step_positions[root_of_token] + depth.to(positions.dtype)
        step_positions.copy_(torch.where(is_node, node_position, step_positions))
    packed = packed_ancestor_mask_ref(trees)  # [R, N + 1, W]
    rows = packed[request_of_token, tree_index.clamp(min=0, max=width)]
    return torch.where(in_tree.unsqueeze(1), rows, torch.zeros_like(rows))


if HAS_TRITON:

    @triton.jit
    def _tree_step_inputs_kernel(
        parents_ptr,
        depths_ptr,
        num_nodes_ptr,
        query_start_ptr,
        num_draft_ptr,
        positions_ptr,
        mask_ptr,
        stride_parents,
        stride_depths,
        stride_mask,
        DEPTH: tl.constexpr,
        WORDS: tl.constexpr,
        WORDS_PADDED: tl.constexpr,
    ):
        req = tl.program_id(0)
        index = tl.program_id(1).to(tl.int64)  # tree index: 0 = root, i = node i - 1
        drafted = tl.load(num_draft_ptr + req)
        if (drafted > 0) & (index <= drafted) & (index <= tl.load(num_nodes_ptr + req)):
            root = tl.load(query_start_ptr + req)
            token = root + index
            words = tl.arange(0, WORDS_PADDED)
            is_node = index >= 1
            row = ancestor_row(
                parents_ptr + req * stride_parents, index, is_node, DEPTH, WORDS_PADDED
            )
            tl.store(mask_ptr + token * stride_mask + words, row, mask=words < WORDS)
            if is_node:
                depth = tl.load(depths_ptr + req * stride_depths + index - 1)
                root_position = tl.load(positions_ptr + root)
                tl.store(positions_ptr + token, root_position + depth)


def tree_step_inputs_triton(
    trees: DDTreeBatch,
    query_start: torch.Tensor,
    num_draft: torch.Tensor,
    num_scheduled: torch.Tensor,
    positions: torch.Tensor,
    total_tokens: int,
) -> torch.Tensor:
    """``tree_step_inputs_ref`` in two launches (zero fill, ``R x (N + 1)`` programs);
    ``num_scheduled`` is not needed here (the trees' token ranges come from ``query_start``)."""
    num_reqs, width = trees.parents.shape
    words = (width + 1 + 31) // 32
    mask = torch.zeros((total_tokens, words), dtype=torch.int32, device=query_start.device)
    if num_reqs == 0 or total_tokens == 0:
        return mask
    parents, depths = trees.parents.long(), trees.depths.long()
    _tree_step_inputs_kernel[(num_reqs, width + 1)](
        parents,
        depths,
        trees.num_nodes,
        query_start,
        num_draft,
        positions,
        mask,
        parents.stride(0),
        depths.stride(0),
        mask.stride(0),
        DEPTH=max(trees.depth_limit, 1),
        WORDS=words,
        WORDS_PADDED=max(2, triton.next_power_of_2(words)),
    )
    return mask
