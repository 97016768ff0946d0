"""KV commit after a tree walk: Triton kernel, launcher and PyTorch reference.

A verify step wrote the K/V of tree index ``i`` (root = 0) of request ``r`` to slot
``verify_slots[r, i]`` (the slot of KV position ``context_len + i``). After the walk accepts the
path ``accepted[r, 0..num_accepted[r]]`` (tree indices, root first, increasing), the next step
expects the accepted tokens at contiguous positions, so the K/V at the slot of tree index
``accepted[r, j]`` moves to the slot of tree index ``j`` for ``j = 1..num_accepted[r]``.

Moves run in increasing ``j`` inside one program per (request, KV head, layer): all layers go in
one launch (``PagedKVLayers`` holds their base addresses). A destination ``j`` is
smaller than every later source (``accepted[r, j'] >= j' > j``), so nothing is overwritten before
it is read. A request whose path is already ``0, 1, 2, ...`` (a chain-shaped acceptance) costs one
comparison and no copy. Everything stays on the device: no host round trip per request.

Shapes: ``key_cache``/``value_cache`` ``[num_blocks, block_size, Hkv, D]`` (any strides, last dim
contiguous); ``verify_slots`` int ``[R, N + 1]`` (``-1`` where unused); ``accepted`` long
``[R, L + 1]`` (``-1`` padded); ``num_accepted`` long ``[R]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.ops import triton_dtype

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def commit_accepted_kv_ref(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    verify_slots: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """PyTorch reference of ``commit_accepted_kv`` (in place, host loop over requests)."""
    block_size = key_cache.shape[1]
    for r in range(verify_slots.shape[0]):
        for j in range(1, int(num_accepted[r]) + 1):
            src = int(verify_slots[r, int(accepted[r, j])])
            dst = int(verify_slots[r, j])
            if src == dst:
                continue
            for cache in (key_cache, value_cache):
                cache[dst // block_size, dst % block_size] = cache[
                    src // block_size, src % block_size
                ]


def commit_accepted_kv_torch(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    verify_slots: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Vectorised PyTorch commit (the CPU path): gather every source, then scatter.

    Reading all sources before writing any destination makes the order of moves irrelevant.
    """
    depth = accepted.shape[1]
    j = torch.arange(depth, device=accepted.device).unsqueeze(0)
    keep = (j >= 1) & (j <= num_accepted.unsqueeze(1)) & (accepted > j)
    if not bool(keep.any()):
        return
    src = verify_slots.gather(1, accepted.clamp(min=0))[keep].long()
    dst = verify_slots.gather(1, j.expand_as(accepted).clamp(max=verify_slots.shape[1] - 1))[
        keep
    ].long()
    block_size = key_cache.shape[1]
    for cache in (key_cache, value_cache):
        moved = cache[src // block_size, src % block_size].clone()
        cache[dst // block_size, dst % block_size] = moved


@dataclass(frozen=True)
class PagedKVLayers:
    """The paged K/V caches of several attention layers, addressed by one kernel launch.

    Every layer's caches share one shape ``[num_blocks, block_size, Hkv, D]``, strides and
    dtype (true for a model's full-attention layers in vLLM); the kernel finds each layer's
    base address in ``key_ptrs``/``value_ptrs`` (int64 ``[num_layers]``, on the caches' device).
    """

    key_ptrs: torch.Tensor
    value_ptrs: torch.Tensor
    shape: tuple[int, int, int, int]
    key_strides: tuple[int, int, int]
    value_strides: tuple[int, int, int]
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return self.key_ptrs.shape[0]

    @classmethod
    def of(cls, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor]):
        """Table of ``key_caches[l]``/``value_caches[l]`` (each ``[num_blocks, block_size, Hkv,
        D]``, last dim contiguous); raises ``ValueError`` if the layers differ in layout."""
        if not key_caches or len(key_caches) != len(value_caches):
            raise ValueError("need one value cache per key cache, and at least one layer")
        first = key_caches[0]
        for cache in (*key_caches, *value_caches):
            if cache.shape != first.shape or cache.dtype != first.dtype:
                raise ValueError(
                    f"KV caches differ: {tuple(cache.shape)} {cache.dtype} vs "
                    f"{tuple(first.shape)} {first.dtype}"
                )
            if cache.stride(-1) != 1:
                raise ValueError("KV caches need a contiguous head dimension")
        for caches in (key_caches, value_caches):
            if any(c.stride()[:3] != caches[0].stride()[:3] for c in caches):
                raise ValueError("KV caches of different layers have different strides")

        def pointers(caches):
            return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(first.device)

        return cls(
            key_ptrs=pointers(key_caches),
            value_ptrs=pointers(value_caches),
            shape=tuple(first.shape),
            key_strides=tuple(key_caches[0].stride()[:3]),
            value_strides=tuple(value_caches[0].stride()[:3]),
            dtype=first.dtype,
        )


if HAS_TRITON:

    @triton.jit
    def _move_row(
        cache_ptr,
        src,
        dst,
        head,
        stride_blk,
        stride_pos,
        stride_h,
        offs_d,
        d_valid,
        KV_BLOCK_SIZE: tl.constexpr,
    ):
        """cache[dst slot, head, :] = cache[src slot, head, :] (paged slot -> block, offset)."""
        src_ptr = (
            cache_ptr
            + (src // KV_BLOCK_SIZE) * stride_blk
            + (src % KV_BLOCK_SIZE) * stride_pos
            + head * stride_h
        )
        dst_ptr = (
            cache_ptr
            + (dst // KV_BLOCK_SIZE) * stride_blk
            + (dst % KV_BLOCK_SIZE) * stride_pos
            + head * stride_h
        )
        tl.store(dst_ptr + offs_d, tl.load(src_ptr + offs_d, mask=d_valid), mask=d_valid)

    @triton.jit
    def _commit_accepted_kv_kernel(
        key_ptrs_ptr,
        value_ptrs_ptr,
        slots_ptr,
        first_row_ptr,
        accepted_ptr,
        num_accepted_ptr,
        stride_k_blk,
        stride_k_pos,
        stride_k_h,
        stride_v_blk,
        stride_v_pos,
        stride_v_h,
        stride_accepted,
        DTYPE: tl.constexpr,
        MAX_DEPTH: tl.constexpr,
        KV_BLOCK_SIZE: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        HEAD_SIZE_PADDED: tl.constexpr,
    ):
        req = tl.program_id(0)
        head = tl.program_id(1)
        layer = tl.program_id(2)
        key_cache_ptr = tl.load(key_ptrs_ptr + layer).to(tl.pointer_type(DTYPE))
        value_cache_ptr = tl.load(value_ptrs_ptr + layer).to(tl.pointer_type(DTYPE))
        count = tl.load(num_accepted_ptr + req)
        # Tree index i of request req has its KV slot at slots[first_row[req] + i].
        request_slots = slots_ptr + tl.load(first_row_ptr + req)
        offs_d = tl.arange(0, HEAD_SIZE_PADDED)
        d_valid = offs_d < HEAD_SIZE
        for j in range(1, MAX_DEPTH + 1):
            node = tl.load(accepted_ptr + req * stride_accepted + j, mask=j <= count, other=j)
            if (j <= count) & (node != j):
                src = tl.load(request_slots + node).to(tl.int64)
                dst = tl.load(request_slots + j).to(tl.int64)
                _move_row(
                    key_cache_ptr,
                    src,
                    dst,
                    head,
                    stride_k_blk,
                    stride_k_pos,
                    stride_k_h,
                    offs_d,
                    d_valid,
                    KV_BLOCK_SIZE,
                )
                _move_row(
                    value_cache_ptr,
                    src,
                    dst,
                    head,
                    stride_v_blk,
                    stride_v_pos,
                    stride_v_h,
                    offs_d,
                    d_valid,
                    KV_BLOCK_SIZE,
                )
            # Later moves may read a slot this one wrote: keep them in order.
            tl.debug_barrier()


def commit_accepted_kv_at(
    layers: PagedKVLayers,
    slot_mapping: torch.Tensor,
    first_row: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Move accepted nodes' K/V to contiguous slots, in place, in every layer of ``layers``,
    reading each node's slot straight from the step's slot mapping (no index tensors).

    ``slot_mapping`` int ``[T]`` (contiguous): the KV slot of every query row of the step;
    ``first_row`` long ``[R]``: the row of each request's root (tree index ``i`` is row
    ``first_row[r] + i``); ``accepted`` long ``[R, L + 1]``; ``num_accepted`` long ``[R]``. One
    launch of ``R x Hkv x num_layers`` programs; chain-shaped paths copy nothing.
    """
    _, kv_block_size, num_kv_heads, head_size = layers.shape
    num_reqs, path_len = accepted.shape
    assert first_row.shape == num_accepted.shape == (num_reqs,)
    assert slot_mapping.dim() == 1 and slot_mapping.stride(0) == 1
    if num_reqs == 0 or path_len <= 1 or layers.num_layers == 0:
        return
    _commit_accepted_kv_kernel[(num_reqs, num_kv_heads, layers.num_layers)](
        layers.key_ptrs,
        layers.value_ptrs,
        slot_mapping,
        first_row,
        accepted,
        num_accepted,
        *layers.key_strides,
        *layers.value_strides,
        accepted.stride(0),
        DTYPE=triton_dtype(layers.dtype),
        MAX_DEPTH=path_len - 1,
        KV_BLOCK_SIZE=kv_block_size,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=max(16, triton.next_power_of_2(head_size)),
    )


def commit_accepted_kv_layers(
    layers: PagedKVLayers,
    verify_slots: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """``commit_accepted_kv_at`` with the slots as a table: ``verify_slots`` int ``[R, N + 1]``
    (row ``r``: the slots of request ``r``'s tree indices); ``accepted`` long ``[R, L + 1]``;
    ``num_accepted`` long ``[R]``."""
    num_reqs, row_width = verify_slots.shape
    assert num_reqs == accepted.shape[0]
    first_row = torch.arange(num_reqs, device=verify_slots.device) * row_width
    commit_accepted_kv_at(
        layers, verify_slots.contiguous().view(-1), first_row, accepted, num_accepted
    )


def commit_accepted_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    verify_slots: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """``commit_accepted_kv_layers`` for one attention layer: ``key_cache``/``value_cache``
    ``[num_blocks, block_size, Hkv, D]``, the rest as there."""
    layers = PagedKVLayers.of([key_cache], [value_cache])
    commit_accepted_kv_layers(layers, verify_slots, accepted, num_accepted)
