"""Each depth's most probable tokens and their log-probabilities in one read of the logits:
Triton kernels, launcher and PyTorch reference.

A tree build needs, for every drafted depth, its ``K`` most probable tokens (``K`` = the
per-depth cap, 16 by default) and their log-probabilities. The reference
(``tree.depth_candidates``) takes PyTorch's top-k over the vocabulary (a radix select of
several passes over every row) and then a log-softmax gather (one more pass). Here, with the
vocabulary cut into segments of ``SEGMENT`` tokens:

* ``_segment_stats_kernel``, one program per (row, segment): the segment's maximum and sum of
  ``exp(logit - maximum)`` (the one read of every logit);
* ``_segment_top_kernel``, one program per (row, segment): the segment's rank among the row's
  segments by maximum (higher first, lower segment first among equal maxima); only the ``K``
  first segments go on, taking their ``K`` largest logits (``K`` rounds of max / argmax) into
  the slot of their rank. A row's top ``K`` tokens lie in those segments: a token in any other
  segment has ``K`` segment maxima before it, each a token ranked before it;
* ``_merge_top_kernel``, one program per row: the row's log-sum-exp from the segments', and
  the ``K`` largest of the ``K * K`` candidates, lowest token id first among equal logits.

The log-probabilities are float32 ``logit - logsumexp``, as the reference's; the tokens equal
the reference's wherever no two logits tie. Probability-0 tokens (``-inf``) come last, at
``-inf``.

Shapes: ``logits`` float ``[R, L, V]`` (any float dtype, last dim contiguous) -> float32
``[R, L, K]`` log-probabilities (non-increasing along ``K``) and long ``[R, L, K]`` tokens.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree import token_log_probs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

__all__ = ["MAX_FUSED_CAP", "SEGMENT", "top_candidates_ref", "top_candidates_triton"]

# The per-depth cap up to which the kernels run (one max / argmax round per candidate and
# segment); a larger cap takes the reference's top-k.
MAX_FUSED_CAP = 32
SEGMENT = 1024  # vocabulary tokens per program of the first kernel (one warp)


def top_candidates_ref(logits: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: the top-``cap`` tokens of ``logits`` ``[R, L, V]`` (``torch.topk``)
    and their float32 log-softmax values."""
    tokens = torch.topk(logits, cap, dim=-1).indices
    return token_log_probs(logits, tokens), tokens


if HAS_TRITON:

    @triton.jit
    def _segment_stats_kernel(
        logits_ptr, seg_max_ptr, seg_sum_ptr, stride_row, vocab, num_segments, SEG: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        token = seg * SEG + tl.arange(0, SEG)
        x = tl.load(
            logits_ptr + row * stride_row + token, mask=token < vocab, other=float("-inf")
        ).to(tl.float32)
        seg_max = tl.max(x, axis=0)
        safe_max = tl.where(seg_max == float("-inf"), 0.0, seg_max)
        slot = row * num_segments + seg
        tl.store(seg_max_ptr + slot, seg_max)
        tl.store(seg_sum_ptr + slot, tl.sum(tl.exp(x - safe_max), axis=0))

    @triton.jit
    def _segment_top_kernel(
        logits_ptr,
        seg_max_ptr,
        cand_value_ptr,
        cand_token_ptr,
        stride_row,
        vocab,
        num_segments,
        K: tl.constexpr,
        SEG: tl.constexpr,
        SEGMENTS_PADDED: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        segs = tl.arange(0, SEGMENTS_PADDED)
        maxima = tl.load(
            seg_max_ptr + row * num_segments + segs,
            mask=segs < num_segments,
            other=float("-inf"),
        )
        own = tl.load(seg_max_ptr + row * num_segments + seg)
        before = (maxima > own) | ((maxima == own) & (segs < seg))
        rank = tl.sum((before & (segs < num_segments)).to(tl.int32), axis=0)
        if rank < K:
            local = tl.arange(0, SEG)
            token = seg * SEG + local
            x = tl.load(
                logits_ptr + row * stride_row + token, mask=token < vocab, other=float("-inf")
            ).to(tl.float32)
            slot = (row * K + rank) * K
            for k in tl.static_range(K):
                best = tl.max(x, axis=0)
                at = tl.argmax(x, axis=0)  # the lowest index among equal values
                tl.store(cand_value_ptr + slot + k, best)
                tl.store(cand_token_ptr + slot + k, (seg * SEG + at).to(tl.int64))
                x = tl.where(local == at, float("-inf"), x)

    @triton.jit
    def _merge_top_kernel(
        cand_value_ptr,
        cand_token_ptr,
        seg_max_ptr,
        seg_sum_ptr,
        out_log_probs_ptr,
        out_tokens_ptr,
        num_segments,
        num_candidates,
        no_token,
        K: tl.constexpr,
        SEGMENTS_PADDED: tl.constexpr,
        CANDIDATES_PADDED: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        segs = tl.arange(0, SEGMENTS_PADDED)
        seg_valid = segs < num_segments
        seg_max = tl.load(
            seg_max_ptr + row * num_segments + segs, mask=seg_valid, other=float("-inf")
        )
        seg_sum = tl.load(seg_sum_ptr + row * num_segments + segs, mask=seg_valid, other=0.0)
        row_max = tl.max(seg_max, axis=0)
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        log_norm = safe_max + tl.log(tl.sum(seg_sum * tl.exp(seg_max - safe_max), axis=0))
        slots = tl.arange(0, CANDIDATES_PADDED)
        valid = slots < num_candidates
        first = row * K * K
        # Slots past the candidates, and each candidate once taken, hold no token.
        values = tl.load(cand_value_ptr + first + slots, mask=valid, other=float("-inf"))
        tokens = tl.load(cand_token_ptr + first + slots, mask=valid, other=no_token)
        for k in tl.static_range(K):
            best = tl.max(values, axis=0)
            # Slots follow the segments' ranks, not token order: the lowest token among equals.
            token = tl.min(tl.where(values == best, tokens, no_token), axis=0)
            log_prob = tl.where(best == float("-inf"), float("-inf"), best - log_norm)
            tl.store(out_log_probs_ptr + row * K + k, log_prob)
            tl.store(out_tokens_ptr + row * K + k, token)
            taken = tokens == token
            values = tl.where(taken, float("-inf"), values)
            tokens = tl.where(taken, no_token, tokens)


def top_candidates_triton(logits: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_candidates_ref`` in three launches (``cap`` at most ``MAX_FUSED_CAP`` and at most
    the vocabulary): float32 ``[R, L, cap]`` log-probabilities and long ``[R, L, cap]`` tokens,
    ordered by logit, lowest token id first among equal logits."""
    num_reqs, depth, vocab = logits.shape
    assert 1 <= cap <= min(MAX_FUSED_CAP, vocab), (cap, vocab)
    assert logits.stride(-1) == 1, "the logits' last dim must be contiguous"
    rows = logits.reshape(num_reqs * depth, vocab)  # a view where the strides allow
    num_rows = rows.shape[0]
    device = logits.device
    log_probs = torch.empty((num_reqs, depth, cap), dtype=torch.float32, device=device)
    tokens = torch.empty((num_reqs, depth, cap), dtype=torch.long, device=device)
    if num_rows == 0:
        return log_probs, tokens
    num_segments = triton.cdiv(vocab, SEGMENT)
    segments_padded = triton.next_power_of_2(num_segments)
    # The K first segments by maximum hold the row's K candidates (fewer segments: all).
    num_candidates = min(cap, num_segments) * cap
    cand_values = torch.empty((num_rows, cap, cap), dtype=torch.float32, device=device)
    cand_tokens = torch.empty((num_rows, cap, cap), dtype=torch.long, device=device)
    seg_max = torch.empty((num_rows, num_segments), dtype=torch.float32, device=device)
    seg_sum = torch.empty_like(seg_max)
    _segment_stats_kernel[(num_rows, num_segments)](
        rows, seg_max, seg_sum, rows.stride(0), vocab, num_segments, SEG=SEGMENT, num_warps=1
    )
    _segment_top_kernel[(num_rows, num_segments)](
        rows,
        seg_max,
        cand_values,
        cand_tokens,
        rows.stride(0),
        vocab,
        num_segments,
        K=cap,
        SEG=SEGMENT,
        SEGMENTS_PADDED=segments_padded,
        num_warps=1,
    )
    _merge_top_kernel[(num_rows,)](
        cand_values,
        cand_tokens,
        seg_max,
        seg_sum,
        log_probs,
        tokens,
        num_segments,
        num_candidates,
        num_segments * SEGMENT,  # past every token: no candidate's
        K=cap,
        SEGMENTS_PADDED=segments_padded,
        CANDIDATES_PADDED=triton.next_power_of_2(num_candidates),
        num_warps=4,
    )
    return log_probs, tokens
