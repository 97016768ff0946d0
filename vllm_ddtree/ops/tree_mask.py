"""Bit-packed ancestor rows: the Triton building block and the PyTorch reference.

TREE_ATTN reads one bit-packed row per query token: bit ``j`` of the row of tree index ``i`` is
set iff ``j`` is ``i`` or one of its ancestors (``pack_tree_mask`` layout). The reference builds
the boolean ``[R, N + 1, N + 1]`` matrix by ``L - 1`` rounds of row inheritance and packs it
(~70 tensor ops at depth 16); ``ancestor_row`` (used by ``tree_inputs.py``'s kernel, one
program per tree index) climbs the parent chain (at most ``L`` hops) and sets the bits in
registers.

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
    def ancestor_row(
        parents_row_ptr, index, is_node, DEPTH: tl.constexpr, WORDS_PADDED: tl.constexpr
    ):
        """int32 ``[WORDS_PADDED]``: the packed row of tree index ``index`` (itself and, for a
        real node, its ancestors up to the root) from its request's ``parents`` row."""
        words = tl.arange(0, WORDS_PADDED)
        one = tl.full((), 1, dtype=tl.int32)
        row = tl.where(words == index // 32, one << (index % 32).to(tl.int32), 0)
        # Climb: the parent of tree index i is parents[i - 1]; -1 once past the root.
        ancestor = tl.load(parents_row_ptr + index - 1, mask=is_node, other=-1)
        ancestor = tl.where(is_node, ancestor, -1)
        for _ in tl.static_range(DEPTH):
            bit = tl.where(words == ancestor // 32, one << (ancestor % 32).to(tl.int32), 0)
            row = row | tl.where(ancestor >= 0, bit, 0)
            climbs = ancestor >= 1
            parent = tl.load(parents_row_ptr + ancestor - 1, mask=climbs, other=-1)
            ancestor = tl.where(climbs, parent, -1)
        return row
