"""Bit-packed ancestor masks in one launch: Triton kernel, launcher and PyTorch reference.

TREE_ATTN reads one bit-packed row per query token: bit ``j`` of the row of tree index ``i`` is
set iff ``j`` is ``i`` or one of its ancestors (``pack_tree_mask`` layout). The reference builds
the boolean ``[R, N + 1, N + 1]`` matrix by ``L - 1`` rounds of row inheritance and packs it
(~70 tensor ops at depth 16); the kernel runs one program per (request, tree index) that climbs
the parent chain (at most ``L`` hops) and sets the bits in registers.

Shapes: ``parents`` long ``[R, N]`` (tree indices, 0 = root), ``num_nodes`` long ``[R]``;
output int32 ``[R, N + 1, ceil((N + 1) / 32)]``. Padding rows (tree indices past
``num_nodes``) see only themselves, as in ``ancestor_mask``.
"""

from __future__ import annotations

import torch

from tree_attn_backend.ops.tree_attention import pack_tree_mask
from vllm_ddtree.tree import DDTreeBatch, ancestor_mask

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def packed_ancestor_mask_ref(tree: DDTreeBatch) -> torch.Tensor:
    """PyTorch reference: ``pack_tree_mask(ancestor_mask(tree))``, int32 ``[R, N + 1, W]``."""
    return pack_tree_mask(ancestor_mask(tree))


if HAS_TRITON:

    @triton.jit
    def _packed_ancestor_mask_kernel(
        parents_ptr,
        num_nodes_ptr,
        out_ptr,
        stride_parents,
        stride_out_req,
        stride_out_row,
        DEPTH: tl.constexpr,
        WORDS: tl.constexpr,
        WORDS_PADDED: tl.constexpr,
    ):
        req = tl.program_id(0)
        index = tl.program_id(1).to(tl.int64)  # tree index: 0 = root, i = node i - 1
        words = tl.arange(0, WORDS_PADDED)
        one = tl.full((), 1, dtype=tl.int32)
        row = tl.where(words == index // 32, one << (index % 32).to(tl.int32), 0)
        is_node = (index >= 1) & (index <= tl.load(num_nodes_ptr + req))
        # Climb: the parent of tree index i is parents[i - 1]; -1 once past the root.
        ancestor = tl.where(
            is_node,
            tl.load(parents_ptr + req * stride_parents + index - 1, mask=is_node, other=-1),
            -1,
        )
        for _ in tl.static_range(DEPTH):
            bit = tl.where(words == ancestor // 32, one << (ancestor % 32).to(tl.int32), 0)
            row = row | tl.where(ancestor >= 0, bit, 0)
            climbs = ancestor >= 1
            parent = tl.load(
                parents_ptr + req * stride_parents + ancestor - 1, mask=climbs, other=-1
            )
            ancestor = tl.where(climbs, parent, -1)
        tl.store(
            out_ptr + req * stride_out_req + index * stride_out_row + words,
            row,
            mask=words < WORDS,
        )


def packed_ancestor_mask_triton(tree: DDTreeBatch) -> torch.Tensor:
    """int32 ``[R, N + 1, ceil((N + 1) / 32)]`` ancestor rows in one launch of ``R x (N + 1)``
    programs; equal to ``packed_ancestor_mask_ref(tree)``."""
    num_reqs, width = tree.parents.shape
    size = width + 1
    words = (size + 31) // 32
    device = tree.parents.device
    out = torch.empty((num_reqs, size, words), dtype=torch.int32, device=device)
    if num_reqs == 0:
        return out
    parents = tree.parents.long()
    _packed_ancestor_mask_kernel[(num_reqs, size)](
        parents,
        tree.num_nodes,
        out,
        parents.stride(0),
        out.stride(0),
        out.stride(1),
        DEPTH=max(tree.depth_limit, 1),
        WORDS=words,
        WORDS_PADDED=max(2, triton.next_power_of_2(words)),
    )
    return out
