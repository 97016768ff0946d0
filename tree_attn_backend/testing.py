"""Random mixed batches for tree-attention tests and benchmarks (paged KV, random trees)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tree_attn_backend.ops.context_attention import committed_context_lens
from tree_attn_backend.ops.tree_attention import pack_tree_mask
from vllm_ddtree.tree import ancestor_mask, build_trees


@dataclass
class AttentionCase:
    """Inputs of one ``tree_attention`` call (see ``tree_attention``'s docstring for shapes)."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    tree_mask: torch.Tensor
    is_tree: torch.Tensor
    positions: torch.Tensor
    max_query_len: int
    scale: float

    def kwargs(self) -> dict:
        return dict(
            q=self.q,
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            scale=self.scale,
            tree_mask=self.tree_mask,
            is_tree=self.is_tree,
            positions=self.positions,
        )

    def context_lens(self) -> torch.Tensor:
        """Each request's committed context: ``seq_len - q_len`` (int32 ``[R]``)."""
        return committed_context_lens(self.query_start_loc, self.seq_lens)

    def context_kwargs(self, context_lens: torch.Tensor | None = None) -> dict:
        """``context_attention``'s (and its reference's) inputs for this batch."""
        return dict(
            q=self.q,
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            query_start_loc=self.query_start_loc,
            context_lens=self.context_lens() if context_lens is None else context_lens,
            block_table=self.block_table,
            scale=self.scale,
        )


def flash_context_path(
    case: AttentionCase,
    context_lens: torch.Tensor,
    fa_version: int,
    max_context_len: int,
    num_splits: int,
    out: torch.Tensor | None = None,
    **launch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TREE_ATTN's FlashAttention path on ``case`` (what the backend runs with
    ``VLLM_DDTREE_TREE_ATTN_CONTEXT=flash_attn``): vLLM's FlashAttention over the contexts,
    then the tree kernel over the in-block keys (``launch``: block_m, block_n, num_warps).
    Returns ``(out, context_out, context_lse)``."""
    from tree_attn_backend.ops.context_attention import context_attention
    from tree_attn_backend.ops.tree_attention import tree_attention

    context_out, context_lse = context_attention(
        **case.context_kwargs(context_lens),
        max_query_len=case.max_query_len,
        max_context_len=max_context_len,
        fa_version=fa_version,
        num_splits=num_splits,
    )
    out = tree_attention(
        **case.kwargs(),
        max_query_len=case.max_query_len,
        out=out,
        context_out=context_out,
        context_lse=context_lse,
        **launch,
    )
    return out, context_out, context_lse


def random_case(
    requests: list[tuple[str, int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    depth: int = 15,
    vocab: int = 64,
) -> AttentionCase:
    """A batch of requests, each ``(kind, context_len, n)`` with kind ``"tree"`` (``n`` nodes
    of a random DDTree, built by ``build_trees``; ``n = 0`` is a root-only tree, i.e. plain
    decode) or ``"causal"`` (``n`` query tokens: prefill, chunked prefill or decode).

    KV blocks are handed out in a random order; positions are depth-based for tree tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    q_lens, seq_lens, masks, flags, positions = [], [], [], [], []
    for kind, context_len, n in requests:
        if kind == "tree":
            if n > 0:
                tree = build_trees(torch.randn(1, depth, vocab, generator=gen) * 3, tree_budget=n)
                num_nodes = int(tree.num_nodes[0])
                visible = ancestor_mask(tree)[0, : num_nodes + 1, : num_nodes + 1]
                depths = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths[0, :num_nodes]])
            else:
                num_nodes = 0
                visible = torch.ones(1, 1, dtype=torch.bool)
                depths = torch.zeros(1, dtype=torch.long)
            q_len = num_nodes + 1
            masks.append(visible)
            flags.append(1)
            positions.append(context_len + depths)
        elif kind == "causal":
            q_len = n
            masks.append(torch.tril(torch.ones(q_len, q_len, dtype=torch.bool)))
            flags.append(0)
            positions.append(context_len + torch.arange(q_len))
        else:
            raise ValueError(f"unknown request kind {kind!r}")
        q_lens.append(q_len)
        seq_lens.append(context_len + q_len)

    max_q = max(q_lens)
    words = (max_q + 31) // 32
    num_tokens = sum(q_lens)
    tree_mask = torch.zeros(num_tokens, words, dtype=torch.int32)
    start = 0
    for visible in masks:
        packed = pack_tree_mask(visible)
        tree_mask[start : start + visible.shape[0], : packed.shape[1]] = packed
        start += visible.shape[0]

    blocks_per_req = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    used = 0
    for r, count in enumerate(blocks_per_req):
        block_table[r, :count] = perm[used : used + count]
        used += count

    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    q = torch.randn(num_tokens, num_heads, head_size, generator=gen)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    return AttentionCase(
        q=q.to(device=device, dtype=dtype),
        key_cache=key_cache.to(device=device, dtype=dtype),
        value_cache=value_cache.to(device=device, dtype=dtype),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        tree_mask=tree_mask.to(device),
        is_tree=torch.tensor(flags, dtype=torch.int32, device=device),
        positions=torch.cat(positions).to(device=device, dtype=torch.int32),
        max_query_len=max_q,
        scale=head_size**-0.5,
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN if either has NaN)."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
