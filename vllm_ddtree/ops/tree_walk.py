"""The tree walk in one launch: Triton kernel, launcher and PyTorch reference.

``follow_tree`` in ``vllm_ddtree.tree`` (the reference) walks a batch of trees with ~12 tensor
ops per depth; at batch 1 each op costs more host time than device time. The kernel runs one
program per request that keeps the request's node tokens and parents in registers and walks
down ``L`` depths: at each, the child whose token equals the target's token at the current node
(lowest tree index first, as the reference), until no child matches.

Shapes: ``token_ids``/``parents`` long ``[R, N]``, ``num_nodes`` long ``[R]``,
``target_tokens`` long ``[R, N + 1]``; outputs ``accepted`` long ``[R, L + 1]`` (tree indices,
root first, ``-1`` padded), ``num_accepted`` long ``[R]``, ``bonus`` long ``[R]``.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree import DDTreeBatch
from vllm_ddtree.tree import follow_tree as follow_tree_ref

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

__all__ = ["follow_tree_triton", "follow_tree_ref"]


if HAS_TRITON:

    @triton.jit
    def _follow_tree_kernel(
        token_ids_ptr,
        parents_ptr,
        num_nodes_ptr,
        target_ptr,
        accepted_ptr,
        num_accepted_ptr,
        bonus_ptr,
        stride_tokens,
        stride_parents,
        stride_target,
        stride_accepted,
        width,
        DEPTH: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        req = tl.program_id(0)
        offs = tl.arange(0, BLOCK_N)
        count = tl.load(num_nodes_ptr + req)
        valid = (offs < count) & (offs < width)
        tokens = tl.load(token_ids_ptr + req * stride_tokens + offs, mask=valid, other=-1)
        parents = tl.load(parents_ptr + req * stride_parents + offs, mask=valid, other=-1)
        tree_index = (offs + 1).to(tl.int64)
        target_row = target_ptr + req * stride_target
        accepted_row = accepted_ptr + req * stride_accepted
        tl.store(accepted_row, 0)
        current = tl.zeros((), dtype=tl.int64)
        alive = tl.full((), 1, dtype=tl.int32)
        num_accepted = tl.zeros((), dtype=tl.int64)
        for depth in tl.static_range(1, DEPTH + 1):
            wanted = tl.load(target_row + current)
            is_child = valid & (parents == current) & (tokens == wanted)
            child = tl.min(tl.where(is_child, tree_index, BLOCK_N + 1), axis=0)
            found = (child <= width) & (alive != 0)
            tl.store(accepted_row + depth, tl.where(found, child, -1))
            current = tl.where(found, child, current)
            num_accepted += found.to(tl.int64)
            alive = found.to(tl.int32)
        tl.store(num_accepted_ptr + req, num_accepted)
        tl.store(bonus_ptr + req, tl.load(target_row + current))


def follow_tree_triton(
    tree: DDTreeBatch, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``follow_tree`` in one kernel launch (``R`` programs).

    Args:
        tree: the verified trees, width ``N``, depth limit ``L``.
        target_tokens: long ``[R, N + 1]``, the target's token at every tree index.

    Returns:
        ``accepted`` long ``[R, L + 1]``, ``num_accepted`` long ``[R]``, ``bonus`` long ``[R]``,
        equal to ``follow_tree_ref``'s.
    """
    num_reqs, width = tree.token_ids.shape
    if num_reqs == 0 or width == 0:
        return follow_tree_ref(tree, target_tokens)
    if target_tokens.shape != (num_reqs, width + 1):
        raise ValueError(
            f"target_tokens must have shape [R, N + 1] = {[num_reqs, width + 1]}, "
            f"got {list(target_tokens.shape)}"
        )
    device = tree.token_ids.device
    depth_limit = tree.depth_limit
    token_ids = tree.token_ids.long()
    parents = tree.parents.long()
    target_tokens = target_tokens.to(device=device, dtype=torch.long)
    accepted = torch.empty((num_reqs, depth_limit + 1), dtype=torch.long, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.long, device=device)
    bonus = torch.empty(num_reqs, dtype=torch.long, device=device)
    _follow_tree_kernel[(num_reqs,)](
        token_ids,
        parents,
        tree.num_nodes,
        target_tokens,
        accepted,
        num_accepted,
        bonus,
        token_ids.stride(0),
        parents.stride(0),
        target_tokens.stride(0),
        accepted.stride(0),
        width,
        DEPTH=depth_limit,
        BLOCK_N=max(16, triton.next_power_of_2(width)),
    )
    return accepted, num_accepted, bonus
