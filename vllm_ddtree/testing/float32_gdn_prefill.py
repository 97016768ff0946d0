"""Test-only: vLLM's chunked GatedDeltaNet prefill in float32, as a chain through the tree op.

vLLM 0.26.0's chunked GDN prefill (flash-linear-attention's ``chunk_gated_delta_rule``) refuses
float32 activations, so a hybrid target can only be served in bf16, where the target alone and
any speculative path (vLLM's own DFlash chain included) part at bf16 near-ties within a few
tokens: a token-identity check against the target alone then says nothing about the tree path.
With ``VLLM_DDTREE_TEST_FLOAT32_GDN=1`` (never on by default) a float32 prefill call runs the
same recurrence sequentially, as a chain-shaped tree through ``ops/tree_gated_delta.py``
(Triton on CUDA, the float64 reference elsewhere), so the hybrid lossless check can run in
float32 end to end (``benchmarks/lossless_gpu.py --hybrid``). Other dtypes go to vLLM's kernel.
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops import use_triton
from vllm_ddtree.ops.packed_rows import gather_rows, row_token_index, scatter_rows
from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta, tree_gated_delta_ref


def chunk_gated_delta_rule_as_chain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``N`` packed sequences, token by token.

    Args:
        q, k: ``[1, T, Hk, K]``; v: ``[1, T, Hv, V]``; g (log decay), beta: ``[1, T, Hv]``.
        initial_state: ``[N, Hv, V, K]`` (vLLM's SSM layout; zeros for a fresh sequence).
        cu_seqlens: ``[N + 1]`` sequence starts in ``T``.

    Returns:
        ``o`` ``[1, T, Hv, V]`` (``v``'s dtype) and the final states float32 ``[N, Hv, V, K]``.
    """
    num_seqs, total = cu_seqlens.numel() - 1, q.shape[1]
    num_tokens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    # Padded to a power of two: the kernel is compiled once per width, not per prompt length.
    width = 1 << (max(int(num_tokens.max()) if num_seqs else 1, 1) - 1).bit_length()
    device = q.device
    offsets = torch.arange(width, device=device)
    index = row_token_index(cu_seqlens, num_seqs, width, total)  # [N, W]

    def rows(t: torch.Tensor) -> torch.Tensor:  # [1, T, ...] -> [N, W, ...], zeros past the end
        return gather_rows(t[0], index)

    num_v_heads, head_v, head_k = initial_state.shape[1:]
    # Three state slots per sequence: the initial state, then tokens alternate between two
    # (a chain's token reads only its predecessor's slot).
    pool = torch.zeros(
        num_seqs * 3, num_v_heads, head_k, head_v, dtype=torch.float32, device=device
    )
    initial_slots = torch.arange(num_seqs, device=device) * 3
    pool[initial_slots] = initial_state.float().transpose(-1, -2)
    state_slots = (initial_slots[:, None] + 1 + offsets[None, :] % 2).contiguous()
    parents = (offsets - 1).expand(num_seqs, width).contiguous()
    op = tree_gated_delta if use_triton(device) else tree_gated_delta_ref
    out = op(
        rows(q),
        rows(k),
        rows(v),
        rows(g.float()),
        rows(beta.float()),
        parents,
        num_tokens,
        pool,
        initial_slots,
        state_slots,
        use_qk_l2norm=bool(use_qk_l2norm_in_kernel),
    )
    o = scatter_rows(out, index, total)
    last = state_slots.gather(1, (num_tokens - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    final = torch.where(
        (num_tokens > 0)[:, None, None, None], pool[last], pool[initial_slots]
    ).transpose(-1, -2)
    return o.unsqueeze(0), final.contiguous()


def _wrap_forward(original):
    def forward(
        self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens=None, *a, **kw
    ):
        if q.dtype != torch.float32:
            return original(
                self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, *a, **kw
            )
        use_l2norm = kw.get("use_qk_l2norm_in_kernel", a[2] if len(a) > 2 else True)
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, q.shape[1]], device=q.device)
        if initial_state is None:
            num_v_heads, head_v, head_k = v.shape[2], v.shape[3], k.shape[3]
            initial_state = q.new_zeros((cu_seqlens.numel() - 1, num_v_heads, head_v, head_k))
        o, final = chunk_gated_delta_rule_as_chain(
            q, k, v, g, beta, initial_state, cu_seqlens, use_l2norm
        )
        core_attn_out = kw.get("core_attn_out")
        if core_attn_out is not None:
            flat = o.squeeze(0).reshape(-1)
            core_attn_out.reshape(-1)[: flat.numel()].copy_(flat)
        return o, (final if output_final_state else None)

    return forward


def install() -> None:
    """Route float32 calls of vLLM's ``ChunkGatedDeltaRule`` (both of its forwards) to the
    chain (the seam group ``FLOAT32_GDN``; before any layer is built, idempotent)."""
    from vllm_ddtree.compat import seams

    seams.install(seams.FLOAT32_GDN)
