"""Tree attention over vLLM's paged KV cache: Triton kernel, launcher and PyTorch reference.

One launch serves a whole mixed batch. Every request ``r`` owns query tokens
``query_start_loc[r] .. query_start_loc[r + 1]`` (``q_len`` of them), written to KV positions
``context_len .. seq_len - 1`` with ``context_len = seq_len - q_len``:

* an ordinary request (prefill, chunked prefill, decode) attends causally: query ``i`` sees key
  positions ``< context_len + i + 1``;
* a tree-verify request (``is_tree[r] = 1``) sees the whole committed context, and inside its
  own ``q_len`` tokens (root = token 0, node ``k`` = token ``k``) only itself and its ancestors.
  The structure arrives bit-packed: ``tree_mask[t, w]`` bit ``b`` says whether query token ``t``
  sees in-tree token ``32 w + b`` (``O(N^2 / 32)`` int32 per request, never a dense bias).

Sliding windows are measured in positions (``positions[t]`` is the RoPE position of query token
``t``; for a tree node that is ``context_len + depth``): a key is visible only if
``q_pos - k_pos < sliding_window``.

Shapes: ``q``/``out`` ``[T, Hq, D]``; ``key_cache``/``value_cache``
``[num_blocks, block_size, Hkv, D]`` (any strides; last dim contiguous); ``block_table``
``[R, max_blocks]`` int32; ``query_start_loc`` ``[R + 1]`` int32; ``seq_lens`` ``[R]`` int32;
``positions`` ``[T]`` int; ``tree_mask`` ``[T, W]`` int32; ``is_tree`` ``[R]`` int32.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency of torch on Linux
    HAS_TRITON = False


def pack_tree_mask(visible: torch.Tensor) -> torch.Tensor:
    """Bit-pack a boolean visibility matrix.

    Args:
        visible: bool ``[..., Q, Q]``; ``visible[..., i, j]``: query ``i`` sees in-tree token ``j``.

    Returns:
        int32 ``[..., Q, ceil(Q / 32)]``; bit ``j % 32`` of word ``j // 32`` is ``visible[i, j]``.
    """
    size = visible.shape[-1]
    words = (size + 31) // 32
    padded = torch.zeros(*visible.shape[:-1], words * 32, dtype=torch.int64, device=visible.device)
    padded[..., :size] = visible.to(torch.int64)
    weights = torch.bitwise_left_shift(
        torch.ones(32, dtype=torch.int64, device=visible.device),
        torch.arange(32, dtype=torch.int64, device=visible.device),
    )
    packed = (padded.view(*visible.shape[:-1], words, 32) * weights).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_tree_mask(packed: torch.Tensor, size: int) -> torch.Tensor:
    """Inverse of ``pack_tree_mask``: int32 ``[..., Q, W]`` -> bool ``[..., Q, size]``."""
    bits = torch.arange(size, device=packed.device)
    words = packed.to(torch.int64)[..., bits // 32]
    return ((words >> (bits % 32)) & 1).bool()


def tree_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    is_tree: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch tree attention (float32 math), same contract as ``tree_attention``.

    Also the CPU implementation of the TREE_ATTN backend. Loops over requests on the host.
    """
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r in range(len(lens)):
        q_start, q_end = starts[r], starts[r + 1]
        q_len, seq_len = q_end - q_start, lens[r]
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        kv_index = torch.arange(seq_len, device=q.device)
        blocks = block_table[r, kv_index // block_size].long()
        keys = key_cache[blocks, kv_index % block_size].float()  # [S, Hkv, D]
        values = value_cache[blocks, kv_index % block_size].float()
        local = torch.arange(q_len, device=q.device)
        visible = kv_index.unsqueeze(0) < (context_len + local.unsqueeze(1) + 1)  # causal
        if is_tree is not None and int(is_tree[r]):
            in_tree = unpack_tree_mask(tree_mask[q_start:q_end], q_len)
            visible = visible.clone()
            visible[:, context_len:] = in_tree
        if sliding_window is not None and sliding_window > 0:
            if positions is None:
                q_pos = context_len + local
            else:
                q_pos = positions[q_start:q_end].long()
            k_pos = kv_index.clone()
            k_pos[context_len:] = q_pos
            visible = visible & ((q_pos.unsqueeze(1) - k_pos.unsqueeze(0)) < sliding_window)
        query = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_size)
        scores = torch.einsum("qhgd,khd->hgqk", query, keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        result = torch.einsum("hgqk,khd->qhgd", probs, values)
        out[q_start:q_end] = result.reshape(q_len, num_heads, head_size).to(out.dtype)
    return out


if HAS_TRITON:

    @triton.jit
    def _find_seq_idx(query_start_loc_ptr, target_block, num_seqs, BLOCK_Q: tl.constexpr):
        """Request whose q-blocks contain ``target_block`` (blocks: start // BLOCK_Q + r)."""
        left = 0
        right = num_seqs
        while left < right:
            mid = (left + right) // 2
            val = tl.load(query_start_loc_ptr + mid)
            mid_val = val // BLOCK_Q + mid
            if mid_val <= target_block:
                left = mid + 1
            else:
                right = mid
        return left - 1

    # Integers that follow the step's requests or tokens are not specialized (Triton compiles
    # a kernel for each integer equal to 1 or a multiple of 16): the context's log-sum-exp
    # stride is the token count. A prefill then runs the kernel its CUDA-graph captures
    # compiled, not a new one during inference.
    @triton.jit(
        do_not_specialize=[
            "num_seqs",
            "num_tokens",
            "sliding_window",
            "stride_lse_h",
            "num_mask_words",
        ]
    )
    def _tree_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        context_out_ptr,
        context_lse_ptr,
        partial_out_ptr,
        partial_max_ptr,
        partial_sum_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        block_table_ptr,
        positions_ptr,
        tree_mask_ptr,
        is_tree_ptr,
        scale,
        num_seqs,
        num_tokens,
        num_heads,
        sliding_window,
        stride_q_t,
        stride_q_h,
        stride_o_t,
        stride_o_h,
        stride_co_t,
        stride_co_h,
        stride_lse_h,
        stride_k_blk,
        stride_k_pos,
        stride_k_h,
        stride_v_blk,
        stride_v_pos,
        stride_v_h,
        stride_bt,
        stride_mask_t,
        num_mask_words,
        NUM_QUERIES_PER_KV: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        HEAD_SIZE_PADDED: tl.constexpr,
        KV_BLOCK_SIZE: tl.constexpr,
        USE_SLIDING_WINDOW: tl.constexpr,
        HAS_POSITIONS: tl.constexpr,
        NUM_SEGMENTS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        HAS_CONTEXT: tl.constexpr,
        MASK_WORDS: tl.constexpr,
    ):
        q_block_global = tl.program_id(0)
        kv_head = tl.program_id(1)
        segment = tl.program_id(2)
        seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq_idx)
        q_block_local = q_block_global - (q_start // BLOCK_Q + seq_idx)
        q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
        if q_block_local * BLOCK_Q >= q_len:
            return

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_SIZE_PADDED)
        q_local = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # query index in request
        head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
        # With a non-power-of-2 head group, rows past BLOCK_Q * group belong to no query.
        q_valid = (q_local < q_len) & (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV)
        d_valid = offs_d < HEAD_SIZE
        q_token = q_start + q_local
        q_tile = tl.load(
            q_ptr + q_token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
            mask=q_valid[:, None] & d_valid[None, :],
            other=0.0,
        )

        seq_len = tl.load(seq_lens_ptr + seq_idx)
        context_len = seq_len - q_len
        tree = tl.load(is_tree_ptr + seq_idx) != 0
        causal_only = tl.load(is_tree_ptr + seq_idx) == 0
        # Keys past the block's last query are never visible (ancestors precede descendants).
        last_local = tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
        key_end = context_len + last_local
        key_begin = 0
        if HAS_CONTEXT:  # the context's share arrives in context_out/context_lse
            # (a CUDA-graph capture's made-up lengths can be shorter than the query)
            key_begin = tl.maximum(context_len, 0)
        if USE_SLIDING_WINDOW:
            if HAS_POSITIONS:
                q_pos = tl.load(positions_ptr + q_token, mask=q_valid, other=0).to(tl.int32)
            else:  # positions are KV indices (no tree in this launch)
                q_pos = context_len + q_local
            # Tree positions are not monotonic in node order: bound by the block's lowest one.
            lowest_pos = tl.min(tl.where(q_valid, q_pos, 2147483647), axis=0)
            # Context keys sit at their own position; none below lowest_pos - window + 1 is seen.
            key_begin = tl.maximum(lowest_pos - sliding_window + 1, 0)
            key_begin = tl.minimum(key_begin, context_len)
            key_begin = (key_begin // BLOCK_N) * BLOCK_N

        # Split-KV: this program covers one of NUM_SEGMENTS tile-aligned slices of the keys.
        if NUM_SEGMENTS > 1:
            num_tiles = tl.cdiv(key_end - key_begin, BLOCK_N)
            tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
            segment_begin = key_begin + segment * tiles_per_segment * BLOCK_N
            segment_end = tl.minimum(segment_begin + tiles_per_segment * BLOCK_N, key_end)
        else:
            segment_begin = key_begin
            segment_end = key_end

        if HAS_CONTEXT:
            # The online softmax starts from the context's normalised output and log-sum-exp:
            # max = lse, sum = 1. No finite lse (an empty context) starts from nothing.
            lse = tl.load(
                context_lse_ptr + head * stride_lse_h + q_token, mask=q_valid, other=float("-inf")
            )
            seen = (lse == lse) & (lse != float("inf")) & (lse != float("-inf"))
            m_i = tl.where(seen, lse, float("-inf"))
            l_i = tl.where(seen, 1.0, 0.0)
            acc = tl.load(
                context_out_ptr
                + q_token[:, None] * stride_co_t
                + head[:, None] * stride_co_h
                + offs_d[None, :],
                mask=(q_valid & seen)[:, None] & d_valid[None, :],
                other=0.0,
            ).to(tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
        for start_n in range(segment_begin, segment_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_valid = offs_n < segment_end
            physical = tl.load(
                block_table_ptr + seq_idx * stride_bt + offs_n // KV_BLOCK_SIZE,
                mask=n_valid,
                other=0,
            ).to(tl.int64)
            slot = offs_n % KV_BLOCK_SIZE
            k_tile = tl.load(
                k_cache_ptr
                + physical[None, :] * stride_k_blk
                + slot[None, :] * stride_k_pos
                + kv_head * stride_k_h
                + offs_d[:, None],
                mask=n_valid[None, :] & d_valid[:, None],
                other=0.0,
            )
            scores = tl.dot(q_tile, k_tile, input_precision=DOT_PRECISION) * scale  # fp32

            in_tree_idx = offs_n - context_len  # index inside the request's query tokens
            in_context = in_tree_idx < 0
            causal_ok = in_tree_idx[None, :] <= q_local[:, None]
            if MASK_WORDS == 1:
                # With the context merged, tiles start at the context's end: a tile of at most
                # 32 keys (dividing 32) lies in one mask word of each query row.
                first = tl.maximum(start_n - context_len, 0)
                row_word = tl.load(
                    tree_mask_ptr + q_token * stride_mask_t + first // 32,
                    mask=tree & q_valid,
                    other=0,
                )
                shift = tl.maximum(in_tree_idx, 0) % 32
                bit = ((row_word[:, None] >> shift[None, :]) & 1) != 0
            elif MASK_WORDS > 1:
                # A context-aligned tile of MASK_WORDS * 32 keys: each row's words of the tile,
                # key j of the tile in word j // 32, bit j % 32.
                first = tl.maximum(start_n - context_len, 0)
                word_idx = first // 32 + tl.arange(0, MASK_WORDS)
                row_words = tl.load(
                    tree_mask_ptr + q_token[:, None] * stride_mask_t + word_idx[None, :],
                    mask=(tree & q_valid)[:, None] & (word_idx < num_mask_words)[None, :],
                    other=0,
                )
                tile_words = tl.reshape(
                    tl.broadcast_to(row_words[:, :, None], (BLOCK_M, MASK_WORDS, 32)),
                    (BLOCK_M, BLOCK_N),
                )
                shift = tl.arange(0, BLOCK_N) % 32
                bit = ((tile_words >> shift[None, :]) & 1) != 0
            else:
                word = tl.load(
                    tree_mask_ptr
                    + q_token[:, None] * stride_mask_t
                    + tl.maximum(in_tree_idx, 0)[None, :] // 32,
                    mask=tree & q_valid[:, None] & (in_tree_idx >= 0)[None, :] & n_valid[None, :],
                    other=0,
                )
                bit = ((word >> (tl.maximum(in_tree_idx, 0)[None, :] % 32)) & 1) != 0
            in_block_ok = causal_ok & (bit | causal_only)
            visible = (in_context[None, :] | in_block_ok) & n_valid[None, :] & q_valid[:, None]
            if USE_SLIDING_WINDOW:
                if HAS_POSITIONS:
                    tree_pos = tl.load(
                        positions_ptr + q_start + tl.maximum(in_tree_idx, 0),
                        mask=(in_tree_idx >= 0) & n_valid,
                        other=0,
                    ).to(tl.int32)
                    k_pos = tl.where(in_context, offs_n, tree_pos)
                else:
                    k_pos = offs_n
                visible = visible & ((q_pos[:, None] - k_pos[None, :]) < sliding_window)
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_tile = tl.load(
                v_cache_ptr
                + physical[:, None] * stride_v_blk
                + slot[:, None] * stride_v_pos
                + kv_head * stride_v_h
                + offs_d[None, :],
                mask=n_valid[:, None] & d_valid[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(
                p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION
            )
            m_i = m_new

        if NUM_SEGMENTS > 1:
            # Unnormalised partials [segment, token, head, :], combined by _combine_kernel.
            row = (segment * num_tokens + q_token) * num_heads + head
            tl.store(partial_max_ptr + row, m_i, mask=q_valid)
            tl.store(partial_sum_ptr + row, l_i, mask=q_valid)
            tl.store(
                partial_out_ptr + row[:, None] * HEAD_SIZE_PADDED + offs_d[None, :],
                acc,
                mask=q_valid[:, None],
            )
        else:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            result = acc / l_safe[:, None]
            tl.store(
                out_ptr
                + q_token[:, None] * stride_o_t
                + head[:, None] * stride_o_h
                + offs_d[None, :],
                result.to(out_ptr.dtype.element_ty),
                mask=q_valid[:, None] & d_valid[None, :],
            )

    @triton.jit(do_not_specialize=["num_tokens"])
    def _combine_kernel(
        out_ptr,
        partial_out_ptr,
        partial_max_ptr,
        partial_sum_ptr,
        num_tokens,
        num_heads,
        stride_o_t,
        stride_o_h,
        HEAD_SIZE: tl.constexpr,
        HEAD_SIZE_PADDED: tl.constexpr,
        NUM_SEGMENTS: tl.constexpr,
    ):
        """out[t, h] = sum_s exp(m_s - m) acc_s / sum_s exp(m_s - m) l_s over the segments."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        segments = tl.arange(0, NUM_SEGMENTS)
        offs_d = tl.arange(0, HEAD_SIZE_PADDED)
        rows = (segments * num_tokens + token) * num_heads + head
        seg_max = tl.load(partial_max_ptr + rows)
        seg_sum = tl.load(partial_sum_ptr + rows)
        total_max = tl.max(seg_max, axis=0)
        safe_max = tl.where(total_max == float("-inf"), 0.0, total_max)
        weight = tl.exp(seg_max - safe_max)
        total = tl.sum(seg_sum * weight, axis=0)
        acc = tl.load(partial_out_ptr + rows[:, None] * HEAD_SIZE_PADDED + offs_d[None, :])
        result = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(
            out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
            result.to(out_ptr.dtype.element_ty),
            mask=offs_d < HEAD_SIZE,
        )


# A verify's query rows (query tokens x grouped heads) per program where they are many: at
# Qwen3-8B's attention shape (GQA 4, head size 128) on an H200, every verify shape whose call
# was bound by the device ran fastest with 128-row blocks, and 32-key tiles with 8 warps took
# 0.78x the 16-row blocks' time (geometric mean; at most 0.98x on any of them), 16-128-node
# trees at 1-16 requests over 384 and 2048 cached tokens (benchmarks/results/
# 2026-12-03_996c932_kernels-verify-shapes/): 16-row blocks re-read each request's keys once
# per 4 query tokens. Other head sizes keep the small blocks, chosen from earlier H200
# timings, until measured (``python -m benchmarks kernels --tune-verify``); at head size 256 a
# 128-row accumulator would not fit the registers.
WIDE_BLOCK_M, WIDE_BLOCK_N, WIDE_NUM_WARPS = 128, 32, 8
WIDE_HEAD_SIZES = frozenset({128})
# The in-block pass after a context merged from elsewhere reads only the request's own query
# tokens' keys: 32-row query blocks of 32-key tiles with 4 warps. At Qwen3-8B's attention
# shape on an H100 this launch was within 6% of the fastest of 12 launch variants at each of
# the 24 verify shapes (16-128-node trees at 1-16 requests over 384 and 2048 cached tokens) and
# faster than the 32-row blocks of 128-key tiles with 8 warps it replaces at every one, by up to
# 1.7x at 16 requests (benchmarks/results/2026-12-07_8f08a00_scale-8b-split-h100/kern/): a
# small tile keeps more programs busy than one covering a whole tree's keys. Not sized from
# the query length: a prefill merging its context runs the kernel its engine's verify graphs
# compiled.
IN_BLOCK_M, IN_BLOCK_N, IN_BLOCK_NUM_WARPS = 32, 32, 4


def choose_launch(
    num_queries_per_kv: int, max_query_len: int, head_size: int, merges_context: bool = False
):
    """``(block_m, block_n, num_warps)`` for a launch: query rows (tokens x grouped heads) per
    program, keys per tile, warps (None: Triton's default).

    Wide blocks (``WIDE_*``) where a request has more query rows than a small block holds, at
    the head sizes they were measured faster for; with ``merges_context`` (the keys are the
    request's own query tokens only) the ``IN_BLOCK_*`` launch there instead. Otherwise 16
    rows (or one row per grouped head) and 64-key tiles (32 above head size 128, for
    registers); decode batches keep these, as one query token per request fills no wider
    block. Depends only on launch-shape quantities, so a CUDA graph captured for a batch
    shape stays valid.
    """
    small_block_m = max(16, triton.next_power_of_2(num_queries_per_kv))
    rows = max_query_len * num_queries_per_kv
    if head_size in WIDE_HEAD_SIZES and rows > small_block_m:
        if merges_context:
            return max(IN_BLOCK_M, small_block_m), IN_BLOCK_N, IN_BLOCK_NUM_WARPS
        return max(WIDE_BLOCK_M, small_block_m), WIDE_BLOCK_N, WIDE_NUM_WARPS
    return small_block_m, (64 if head_size <= 128 else 32), None


def mask_words_per_tile(block_n: int) -> int:
    """Mask words per query row that a tile of ``block_n`` keys starting at its request's
    context end reads: 1 for a tile that divides a word, ``block_n // 32`` for a multiple of a
    word, 0 (a word gathered per key) otherwise."""
    if 32 % block_n == 0:
        return 1
    return block_n // 32 if block_n % 32 == 0 else 0


_SM_COUNT: dict[int, int] = {}
MAX_SEGMENTS = 16


def choose_num_segments(num_programs: int, device: torch.device) -> int:
    """KV splits so that about two programs run per multiprocessor (1 when the batch fills it).

    Depends only on launch-shape quantities, so a CUDA graph captured for a batch shape stays
    valid for any sequence lengths (each program sizes its slice from its request's length).
    """
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    wanted = -(-2 * _SM_COUNT[index] // max(num_programs, 1))
    segments = 1
    while segments < min(wanted, MAX_SEGMENTS):
        segments *= 2
    return segments


def tree_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    tree_mask: torch.Tensor | None = None,
    is_tree: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_segments: int | None = None,
    num_warps: int | None = None,
    block_m: int | None = None,
    context_out: torch.Tensor | None = None,
    context_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention with the Triton kernel (launch shape independent of tree contents).

    ``q`` ``[T, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``; see the module docstring
    for the rest. ``max_query_len`` (a host int) only sizes the launch: it must bound every
    request's query length. ``tree_mask``/``is_tree`` None means every request is causal.
    ``num_segments`` splits each request's keys over that many programs (a power of 2; None:
    enough to fill the GPU when the batch alone does not), combined by a second kernel.

    ``context_out`` ``[T, Hq, D]`` and ``context_lse`` ``[Hq, T]`` (float32, natural log of
    the scaled scores' exponential sum; non-finite for an empty context): every query token's
    attention over its request's committed context alone, computed elsewhere
    (``context_attention``). Given them, the kernel reads only the keys of the request's own
    query tokens and merges (no sliding window; one segment).

    Returns ``out`` ``[T, Hq, D]`` (allocated when not given).
    """
    num_tokens, num_heads, head_size = q.shape
    _, kv_block_size, num_kv_heads, _ = key_cache.shape
    assert key_cache.shape == value_cache.shape, "key and value caches differ in shape"
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if tree_mask is None or is_tree is None:
        tree_mask = torch.zeros((1, 1), dtype=torch.int32, device=q.device)
        is_tree = torch.zeros(num_seqs, dtype=torch.int32, device=q.device)
    use_window = sliding_window is not None and sliding_window > 0
    has_context = context_out is not None
    if has_context:
        assert context_lse is not None and not use_window, "context merge: lse, no window"
        assert context_out.stride(-1) == 1 and context_lse.stride(-1) == 1
        num_segments = 1
    else:
        context_out = context_lse = out  # unused
    has_positions = positions is not None
    # Without positions, windows are measured in KV indices: exact for causal requests; tree
    # requests with sliding windows must pass positions (depth-based).
    if positions is None:
        positions = torch.zeros(1, dtype=torch.int32, device=q.device)
    group = num_heads // num_kv_heads
    chosen_m, chosen_n, chosen_warps = choose_launch(
        group, max_query_len, head_size, merges_context=has_context
    )
    if block_m is None:
        block_m = chosen_m
    if block_n is None:
        block_n = chosen_n
    if num_warps is None and block_m == chosen_m and block_n == chosen_n:
        num_warps = chosen_warps
    block_q = block_m // group
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_segments is None:
        num_segments = choose_num_segments(num_q_blocks * num_kv_heads, q.device)
    head_size_padded = max(16, triton.next_power_of_2(head_size))
    if num_segments > 1:
        partial_out = torch.empty(
            (num_segments, num_tokens, num_heads, head_size_padded),
            dtype=torch.float32,
            device=q.device,
        )
        partial_max = torch.empty(
            (num_segments, num_tokens, num_heads), dtype=torch.float32, device=q.device
        )
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused
    grid = (num_q_blocks, num_kv_heads, num_segments)
    _tree_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        context_out,
        context_lse,
        partial_out,
        partial_max,
        partial_sum,
        query_start_loc,
        seq_lens,
        block_table,
        positions,
        tree_mask,
        is_tree,
        scale,
        num_seqs,
        num_tokens,
        num_heads,
        sliding_window if use_window else 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        context_out.stride(0),
        context_out.stride(1),
        context_lse.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        tree_mask.stride(0),
        tree_mask.shape[1],
        NUM_QUERIES_PER_KV=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        KV_BLOCK_SIZE=kv_block_size,
        USE_SLIDING_WINDOW=use_window,
        HAS_POSITIONS=has_positions,
        NUM_SEGMENTS=num_segments,
        # float32 inputs get full-precision dots (tf32 would flip near-tied greedy tokens).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_CONTEXT=has_context,
        MASK_WORDS=mask_words_per_tile(block_n) if has_context else 0,
        **({"num_warps": num_warps} if num_warps else {}),
    )
    if num_segments > 1:
        _combine_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_tokens,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_size_padded,
            NUM_SEGMENTS=num_segments,
        )
    return out


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)
