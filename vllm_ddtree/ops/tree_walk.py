"""The sampler's tree step in one launch: Triton kernel, launcher and PyTorch reference.

After the verify forward, the sampler has the target's token at every verified position
(``chosen``, the step's flat rows). ``walk_and_emit`` gathers each request's tokens, walks its
tree (from the root, the child whose token equals the target's token at the current node,
lowest tree index first, until no child matches) and writes vLLM's sampled-token rows
(accepted tokens, bonus, ``-1``). The reference composes ``tree.follow_tree`` with ~20 tensor
ops, whose launches cost more host time than device time at small batches; the kernel runs one
program per request that keeps the node tokens and parents in registers.

Shapes: ``token_ids``/``parents`` long ``[R, N]``, ``num_nodes`` long ``[R]``, ``chosen`` long
``[rows]``; outputs ``accepted`` long ``[R, L + 1]`` (tree indices, root first, ``-1`` padded),
``num_accepted`` long ``[R]``, ``bonus`` long ``[R]``, ``sampled`` int32 ``[R, out_width]``.
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops import use_triton
from vllm_ddtree.tree import DDTreeBatch
from vllm_ddtree.tree import follow_tree as follow_tree_ref

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

__all__ = ["follow_tree_ref", "walk_and_emit", "walk_and_emit_ref", "walk_and_emit_triton"]


def walk_and_emit_ref(
    tree: DDTreeBatch,
    chosen: torch.Tensor,
    first_row: torch.Tensor,
    num_draft: torch.Tensor,
    out_width: int,
    sampled_dtype: torch.dtype = torch.int32,
):
    """The sampler's whole tree step: gather each request's target tokens, walk, and write
    vLLM's sampled-token rows.

    Args:
        tree: the verified trees, width ``N``, depth limit ``L``.
        chosen: long ``[rows]``, the target's token at every verified position of the step.
        first_row: long ``[R]``, the row of ``chosen`` holding request ``r``'s root (tree index
            ``i`` is row ``first_row[r] + i`` for ``i <= num_draft[r]``).
        num_draft: long ``[R]``, scheduled draft tokens (tree nodes) per request.
        out_width: columns of the sampled rows (the step's largest ``num_draft`` + 1).

    Returns:
        ``accepted`` long ``[R, L + 1]``, ``num_accepted`` long ``[R]``, ``bonus`` long ``[R]``
        (as ``follow_tree``) and ``sampled`` ``[R, out_width]`` of ``sampled_dtype`` (int32 for
        vLLM's V1 sampler output, int64 for V2's): the accepted nodes' tokens, then the bonus,
        then ``-1``.
    """
    num_reqs, width = tree.token_ids.shape
    device = chosen.device
    offsets = torch.arange(width + 1, device=device)
    rows = (first_row.unsqueeze(1) + offsets).clamp(max=chosen.shape[0] - 1)
    in_range = offsets.unsqueeze(0) <= num_draft.unsqueeze(1)
    target_tokens = torch.where(in_range, chosen[rows], -1)
    accepted, num_accepted, bonus = follow_tree_ref(tree, target_tokens)
    node_of_path = (accepted[:, 1:] - 1).clamp(min=0, max=max(width - 1, 0))  # [R, L]
    path_tokens = tree.token_ids.gather(1, node_of_path) if width else node_of_path
    columns = min(path_tokens.shape[1], out_width - 1)
    sampled = torch.full((num_reqs, out_width), -1, dtype=sampled_dtype, device=device)
    is_path = torch.arange(columns, device=device).unsqueeze(0) < num_accepted.unsqueeze(1)
    sampled[:, :columns] = torch.where(is_path, path_tokens[:, :columns], -1).to(sampled_dtype)
    sampled.scatter_(1, num_accepted.unsqueeze(1), bonus.unsqueeze(1).to(sampled_dtype))
    return accepted, num_accepted, bonus, sampled


if HAS_TRITON:

    @triton.jit
    def _walk_and_emit_kernel(
        token_ids_ptr,
        parents_ptr,
        num_nodes_ptr,
        chosen_ptr,
        first_row_ptr,
        accepted_ptr,
        num_accepted_ptr,
        bonus_ptr,
        sampled_ptr,
        stride_tokens,
        stride_parents,
        stride_accepted,
        stride_sampled,
        width,
        out_width,
        DEPTH: tl.constexpr,
        BLOCK_N: tl.constexpr,
        OUT_BLOCK: tl.constexpr,
    ):
        req = tl.program_id(0)
        offs = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, OUT_BLOCK)
        count = tl.load(num_nodes_ptr + req)
        valid = (offs < count) & (offs < width)
        tokens = tl.load(token_ids_ptr + req * stride_tokens + offs, mask=valid, other=-1)
        parents = tl.load(parents_ptr + req * stride_parents + offs, mask=valid, other=-1)
        tree_index = (offs + 1).to(tl.int64)
        root_row = tl.load(first_row_ptr + req)
        path = tl.full((OUT_BLOCK,), -1, dtype=tl.int64)  # accepted nodes' tokens
        accepted = tl.where(cols == 0, 0, -1).to(tl.int64)  # accepted tree indices
        current = tl.zeros((), dtype=tl.int64)
        alive = tl.full((), 1, dtype=tl.int32)
        num_accepted = tl.zeros((), dtype=tl.int64)
        for depth in tl.static_range(1, DEPTH + 1):
            wanted = tl.load(chosen_ptr + root_row + current)
            is_child = valid & (parents == current) & (tokens == wanted)
            child = tl.min(tl.where(is_child, tree_index, BLOCK_N + 1), axis=0)
            found = (child <= width) & (alive != 0)
            accepted = tl.where(found & (cols == depth), child, accepted)
            path = tl.where(found & (cols == depth - 1), wanted, path)
            current = tl.where(found, child, current)
            num_accepted += found.to(tl.int64)
            alive = found.to(tl.int32)
        bonus = tl.load(chosen_ptr + root_row + current)
        tl.store(accepted_ptr + req * stride_accepted + cols, accepted, mask=cols < DEPTH + 1)
        tl.store(num_accepted_ptr + req, num_accepted)
        tl.store(bonus_ptr + req, bonus)
        row = tl.where(cols == num_accepted, bonus, path).to(sampled_ptr.dtype.element_ty)
        tl.store(sampled_ptr + req * stride_sampled + cols, row, mask=cols < out_width)


def walk_and_emit_triton(
    tree: DDTreeBatch,
    chosen: torch.Tensor,
    first_row: torch.Tensor,
    num_draft: torch.Tensor,
    out_width: int,
    sampled_dtype: torch.dtype = torch.int32,
):
    """``walk_and_emit_ref`` in one launch (``R`` programs); same arguments and results.

    ``num_draft`` bounds no read here: after alignment a tree's nodes are all scheduled.
    """
    num_reqs, width = tree.token_ids.shape
    if num_reqs == 0 or width == 0:
        return walk_and_emit_ref(tree, chosen, first_row, num_draft, out_width, sampled_dtype)
    device = chosen.device
    depth_limit = tree.depth_limit
    token_ids, parents = tree.token_ids.long(), tree.parents.long()
    chosen = chosen.long()
    accepted = torch.empty((num_reqs, depth_limit + 1), dtype=torch.long, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.long, device=device)
    bonus = torch.empty(num_reqs, dtype=torch.long, device=device)
    sampled = torch.empty((num_reqs, out_width), dtype=sampled_dtype, device=device)
    _walk_and_emit_kernel[(num_reqs,)](
        token_ids,
        parents,
        tree.num_nodes,
        chosen,
        first_row,
        accepted,
        num_accepted,
        bonus,
        sampled,
        token_ids.stride(0),
        parents.stride(0),
        accepted.stride(0),
        sampled.stride(0),
        width,
        out_width,
        DEPTH=depth_limit,
        BLOCK_N=max(16, triton.next_power_of_2(width)),
        OUT_BLOCK=max(16, triton.next_power_of_2(max(out_width, depth_limit + 1))),
    )
    return accepted, num_accepted, bonus, sampled


def walk_and_emit(
    tree: DDTreeBatch,
    chosen: torch.Tensor,
    first_row: torch.Tensor,
    num_draft: torch.Tensor,
    out_width: int,
    sampled_dtype: torch.dtype = torch.int32,
):
    """``walk_and_emit_triton`` on CUDA, ``walk_and_emit_ref`` elsewhere (same arguments and
    returns)."""
    walk = walk_and_emit_triton if use_triton(chosen.device) else walk_and_emit_ref
    return walk(tree, chosen, first_row, num_draft, out_width, sampled_dtype)
