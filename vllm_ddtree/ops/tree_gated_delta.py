"""Gated delta rule (GatedDeltaNet) over a draft tree: Triton kernel, launcher, PyTorch reference.

In a recurrent layer an attention mask cannot isolate branches: tree node ``t`` must start from
the state of its parent. Per request and value head, for tree indices ``t = 0..T-1`` in order
(the root, the bonus token, is ``t = 0``; parents precede children):

    h     = state[parent(t)]            (the committed state for the root)
    h     = h * exp(g_t)                (g_t: log decay of token t)
    u     = beta_t * (v_t - h^T k_t)
    h     = h + k_t u^T
    o_t   = h^T q_t                     (q_t scaled by 1/sqrt(K); q, k L2-normalised first)
    state[t] = h

the same update as flash-linear-attention's ``fused_recurrent_gated_delta_rule``, with a
parent pointer in place of "the previous token". States live in a pool addressed like vLLM's
``ssm_state_indices``: ``state_slots[r, t]`` is where node ``t``'s state is written, and
``initial_slots[r]`` holds the committed state, in the same pool or, with ``initial_state``, in
another tensor of any float dtype and strides (e.g. vLLM's own SSM cache, whose ``[Hv, V, K]``
layout is read through ``.transpose(-1, -2)``), so that the pool can be a per-step scratch.
After the walk, the accepted leaf's slot holds exactly the state target-only decoding would
have.

State precision: the pool is float32 or bfloat16 (``STATE_DTYPES``). Each node's state is
computed in float32 from its parent's state *as stored*, and stored in the pool's dtype, so along
any root-to-node path the states are rounded exactly where target-only decoding with a cache of
that dtype rounds them (once per token: it reads the previous token's stored state and stores
the new one). A bfloat16 pool therefore keeps the tree path equal to token-by-token decoding
with bfloat16 states (both lose the same precision); it does not make bfloat16 states equal to
float32 ones.

Shapes: ``q``/``k`` ``[R, T, Hk, K]``, ``v`` ``[R, T, Hv, V]``, ``g``/``beta`` ``[R, T, Hv]``
(float32), ``parents`` long ``[R, T]`` (``-1`` for the root, padding ``t`` beyond
``num_tokens[r]``), ``state_pool`` float32 or bfloat16 ``[S, Hv, K, V]``, ``initial_slots``
long ``[R]``,
``state_slots`` long or int32 ``[R, T]`` (rows may be strided, e.g. a slice of vLLM's block
table). The pool may be strided too (vLLM's ``[slots, Hv, V, K]`` SSM cache as
``.transpose(-1, -2)``), float32 or bfloat16. Grouped heads: value head ``h`` reads key head
``h // (Hv // Hk)``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

# The node-state dtypes the kernel and the reference take (see "State precision" above).
STATE_DTYPES = (torch.float32, torch.bfloat16)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def tree_gated_delta_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    state_slots: torch.Tensor,
    use_qk_l2norm: bool = True,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: for every node, replay the recurrence along its root-to-node path in float64,
    from ``initial_state[initial_slots[r]]`` (default: ``state_pool``), each ancestor's state
    rounded to the pool's dtype as the kernel stores and reads it back.

    Writes each node's final state to ``state_pool[state_slots[r, t]]`` (as the kernel does) and
    returns the outputs ``[R, T, Hv, V]`` in ``v``'s dtype.
    """
    num_reqs, max_tokens, num_v_heads, head_v = v.shape
    num_k_heads, head_k = k.shape[2], k.shape[3]
    group = num_v_heads // num_k_heads
    scale = head_k**-0.5
    out = torch.zeros_like(v)
    start = state_pool if initial_state is None else initial_state
    # The committed states, read before any node state is written (the initial block may be
    # one the step overwrites, as in vLLM's speculative layout).
    committed = [start[int(initial_slots[r])].double().clone() for r in range(num_reqs)]
    for r in range(num_reqs):
        for t in range(int(num_tokens[r])):
            path = [t]
            while int(parents[r, path[-1]]) >= 0:
                path.append(int(parents[r, path[-1]]))
            path.reverse()
            h = committed[r].clone()  # [Hv, K, V]
            for depth, node in enumerate(path):
                if depth:  # the parent's state as stored
                    h = h.to(state_pool.dtype).double()
                qn = q[r, node].double().repeat_interleave(group, 0)  # [Hv, K]
                kn = k[r, node].double().repeat_interleave(group, 0)
                if use_qk_l2norm:
                    qn, kn = _l2norm(qn), _l2norm(kn)
                h = h * torch.exp(g[r, node].double())[:, None, None]
                residual = v[r, node].double() - torch.einsum("hkv,hk->hv", h, kn)
                update = beta[r, node].double()[:, None] * residual
                h = h + kn[:, :, None] * update[:, None, :]
            out[r, t] = torch.einsum("hkv,hk->hv", h, qn * scale).to(v.dtype)
            state_pool[int(state_slots[r, t])] = h.to(state_pool.dtype)
    return out


if HAS_TRITON:

    @triton.jit
    def _tree_gated_delta_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        parents_ptr,
        num_tokens_ptr,
        state_ptr,
        initial_ptr,
        initial_slots_ptr,
        state_slots_ptr,
        out_ptr,
        scale,
        stride_q_r,
        stride_q_t,
        stride_q_h,
        stride_v_r,
        stride_v_t,
        stride_v_h,
        stride_o_r,
        stride_o_t,
        stride_o_h,
        stride_g_r,
        stride_g_t,
        stride_tree_r,
        stride_slots_r,
        stride_state_slot,
        stride_state_h,
        stride_state_k,
        stride_state_v,
        stride_init_slot,
        stride_init_h,
        stride_init_k,
        stride_init_v,
        MAX_TOKENS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_K: tl.constexpr,
        HEAD_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
        USE_QK_L2NORM: tl.constexpr,
    ):
        req = tl.program_id(0)
        v_head = tl.program_id(1)
        v_block = tl.program_id(2)
        k_head = v_head // GROUP
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
        k_valid = offs_k < HEAD_K
        v_valid = offs_v < HEAD_V
        hv_mask = k_valid[:, None] & v_valid[None, :]
        hv_offsets = offs_k[:, None] * stride_state_k + offs_v[None, :] * stride_state_v
        init_offsets = offs_k[:, None] * stride_init_k + offs_v[None, :] * stride_init_v
        count = tl.load(num_tokens_ptr + req)
        initial = tl.load(initial_slots_ptr + req).to(tl.int64)
        for t in range(0, MAX_TOKENS):
            if t < count:
                parent = tl.load(parents_ptr + req * stride_tree_r + t)
                if parent < 0:
                    h = tl.load(
                        initial_ptr
                        + initial * stride_init_slot
                        + v_head * stride_init_h
                        + init_offsets,
                        mask=hv_mask,
                        other=0.0,
                    ).to(tl.float32)
                else:
                    slot = tl.load(state_slots_ptr + req * stride_slots_r + parent).to(tl.int64)
                    h = tl.load(
                        state_ptr + slot * stride_state_slot + v_head * stride_state_h + hv_offsets,
                        mask=hv_mask,
                        other=0.0,
                    ).to(tl.float32)
                q_row = q_ptr + req * stride_q_r + t * stride_q_t + k_head * stride_q_h
                k_row = k_ptr + req * stride_q_r + t * stride_q_t + k_head * stride_q_h
                b_q = tl.load(q_row + offs_k, mask=k_valid, other=0.0).to(tl.float32)
                b_k = tl.load(k_row + offs_k, mask=k_valid, other=0.0).to(tl.float32)
                if USE_QK_L2NORM:
                    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
                    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
                b_q = b_q * scale
                v_row = v_ptr + req * stride_v_r + t * stride_v_t + v_head * stride_v_h
                b_v = tl.load(v_row + offs_v, mask=v_valid, other=0.0).to(tl.float32)
                gate = tl.load(g_ptr + req * stride_g_r + t * stride_g_t + v_head)
                b_beta = tl.load(beta_ptr + req * stride_g_r + t * stride_g_t + v_head)
                h = h * tl.exp(gate)
                b_v = (b_v - tl.sum(h * b_k[:, None], 0)) * b_beta
                h = h + b_k[:, None] * b_v[None, :]
                b_o = tl.sum(h * b_q[:, None], 0)
                out_row = out_ptr + req * stride_o_r + t * stride_o_t + v_head * stride_o_h
                tl.store(out_row + offs_v, b_o.to(out_ptr.dtype.element_ty), mask=v_valid)
                out_slot = tl.load(state_slots_ptr + req * stride_slots_r + t).to(tl.int64)
                tl.store(
                    state_ptr + out_slot * stride_state_slot + v_head * stride_state_h + hv_offsets,
                    h.to(state_ptr.dtype.element_ty),
                    mask=hv_mask,
                )
            # Children read this state back from memory in a later iteration.
            tl.debug_barrier()


def tree_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    state_slots: torch.Tensor,
    use_qk_l2norm: bool = True,
    block_v: int = 32,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule over per-request trees (see the module docstring for shapes).

    One program per (request, value head, block of V): it walks the nodes in index order, reads
    each parent's state from the pool and writes the node's. ``initial_state``
    ``[S', Hv, K, V]`` (any float dtype and strides; default: ``state_pool``) holds the
    committed states ``initial_slots`` points at. Returns ``[R, T, Hv, V]``.
    """
    num_reqs, max_tokens, num_v_heads, head_v = v.shape
    num_k_heads, head_k = k.shape[2], k.shape[3]
    assert q.shape == k.shape and g.shape == beta.shape == (num_reqs, max_tokens, num_v_heads)
    assert num_v_heads % num_k_heads == 0, "value heads must be a multiple of key heads"
    if state_pool.dtype not in STATE_DTYPES:
        raise ValueError(
            f"tree node states must be one of {STATE_DTYPES}, got a {state_pool.dtype} pool"
        )
    assert state_pool.shape[1:] == (num_v_heads, head_k, head_v)
    assert parents.stride(-1) == 1 and state_slots.stride(-1) == 1
    assert q.stride() == k.stride() and g.stride() == beta.stride()
    for t in (q, k, v):
        assert t.stride(-1) == 1
    if initial_state is None:
        initial_state = state_pool
    assert initial_state.shape[1:] == state_pool.shape[1:], "initial states are [S', Hv, K, V]"
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_v = min(block_v, triton.next_power_of_2(head_v))
    grid = (num_reqs, num_v_heads, triton.cdiv(head_v, block_v))
    _tree_gated_delta_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        parents,
        num_tokens,
        state_pool,
        initial_state,
        initial_slots,
        state_slots,
        out,
        head_k**-0.5,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        g.stride(0),
        g.stride(1),
        parents.stride(0),
        state_slots.stride(0),
        *state_pool.stride(),
        *initial_state.stride(),
        MAX_TOKENS=max_tokens,
        GROUP=num_v_heads // num_k_heads,
        HEAD_K=head_k,
        HEAD_V=head_v,
        BLOCK_K=triton.next_power_of_2(head_k),
        BLOCK_V=block_v,
        USE_QK_L2NORM=use_qk_l2norm,
    )
    return out
