"""Attention over each request's committed context: vLLM's FlashAttention, and a reference.

A verify's query tokens all see their request's whole committed context (positions
``0 .. context_len - 1``); only the request's own query tokens need the tree mask. So the
context's share is plain non-causal attention over paged KV, which vLLM's FlashAttention
(version 3 on Hopper) computes at full speed, with its log-sum-exp; ``tree_attention`` given
``context_out``/``context_lse`` then reads only the in-block keys and merges.

Shapes: ``q`` ``[T, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``; ``query_start_loc``
``[R + 1]`` int32; ``context_lens`` ``[R]`` int32; ``block_table`` ``[R, max_blocks]`` int32.
Returns ``out`` ``[T, Hq, D]`` (``q``'s dtype) and ``lse`` ``[Hq, T]`` float32: natural log of
the sum of ``exp(scale * q.k)`` over the context's keys, not finite where a context is empty.
"""

from __future__ import annotations

import torch

# Bytes of FlashAttention's split-KV accumulators a FULL CUDA graph may hold for one call.
MAX_SPLIT_ACCUMULATOR_BYTES = 256 * 1024 * 1024
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attention_version(head_size: int, dtype: torch.dtype, device: torch.device) -> int | None:
    """The FlashAttention version vLLM would use here (3 on Hopper), or None where it cannot
    serve the context (not CUDA, float32, an unsupported head size, no FlashAttention build)."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    except ImportError:
        return None
    if not FlashAttentionBackend.supports_head_size(head_size):
        return None
    return get_flash_attn_version(head_size=head_size)


def committed_context_lens(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each request's committed context, ``seq_len - query_len`` (int32 ``[R]``), at least 0:
    a CUDA-graph padding request or a capture's made-up sequence can be shorter than its
    query. ``out``: an int32 ``[R]`` buffer to write into (a builder's persistent one)."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if out is None:
        out = torch.empty_like(seq_lens, dtype=torch.int32)
    torch.sub(seq_lens, query_lens, out=out)
    return out.clamp_(min=0)


def split_bound(max_splits: int, num_tokens: int, num_heads: int, head_size: int) -> int:
    """FlashAttention 3's split-KV bound for a FULL graph: vLLM's own bound for its graphs
    (``max_splits``), lowered so that the float32 accumulators ``[splits, Hq, T, D]`` stay
    within ``MAX_SPLIT_ACCUMULATOR_BYTES`` (a verify has many more query tokens than a decode)."""
    per_split = 4 * num_tokens * num_heads * head_size
    return max(1, min(max_splits, MAX_SPLIT_ACCUMULATOR_BYTES // max(per_split, 1)))


def context_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    fa_version: int,
    num_splits: int = 0,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's share through vLLM's FlashAttention: ``(out, lse)``.

    ``max_query_len``/``max_context_len`` (host ints) bound the batch, as for vLLM's own calls.
    ``num_splits``: 0 lets FlashAttention choose from the lengths (eager launches); inside a
    FULL CUDA graph an upper bound fixed at capture (``split_bound``), as vLLM's backend does.
    """
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    if out is None:
        out = torch.empty_like(q)
    _, lse = flash_attn_varlen_func(
        q=q,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=query_start_loc,
        max_seqlen_q=max_query_len,
        seqused_k=context_lens,
        max_seqlen_k=max(max_context_len, 1),
        softmax_scale=scale,
        causal=False,
        block_table=block_table,
        return_softmax_lse=True,
        fa_version=fa_version,
        num_splits=num_splits if fa_version == 3 else 0,
    )
    return out, lse


def context_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch (float32 math), same contract as ``context_attention``; ``lse`` is
    ``-inf`` and ``out`` zero for an empty context."""
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    lse = torch.full((num_heads, num_tokens), float("-inf"), dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for r, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[r], starts[r + 1]
        if q_end == q_start or context_len <= 0:
            continue
        kv_index = torch.arange(context_len, device=q.device)
        blocks = block_table[r, kv_index // block_size].long()
        keys = key_cache[blocks, kv_index % block_size].float()
        values = value_cache[blocks, kv_index % block_size].float()
        query = q[q_start:q_end].float().view(q_end - q_start, num_kv_heads, group, head_size)
        scores = torch.einsum("qhgd,khd->hgqk", query, keys) * scale
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, group, q]
        probs = torch.exp(scores - row_lse.unsqueeze(-1))
        result = torch.einsum("hgqk,khd->qhgd", probs, values)
        out[q_start:q_end] = result.reshape(q_end - q_start, num_heads, head_size).to(out.dtype)
        lse[:, q_start:q_end] = row_lse.reshape(num_heads, q_end - q_start)
    return out, lse
