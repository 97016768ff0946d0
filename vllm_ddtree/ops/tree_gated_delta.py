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

from vllm_ddtree.ops.packed_rows import gather_rows, row_lengths, row_token_index, scatter_rows

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

# The node-state dtypes the kernel and the reference take (see "State precision" above).
STATE_DTYPES = (torch.float32, torch.bfloat16)
# softplus(x) = x past this, as vLLM's gating kernels take it.
SOFTPLUS_THRESHOLD = 20.0
# The launch: a program per (row, value head, BLOCK_V of the V columns), of NUM_WARPS warps.
# The fastest of those timed at Qwen3.6-27B's heads on an H200, on the chain's 16 tokens and
# a budget-32 tree (benchmarks/results/2026-12-05_1085501_hybrid-ops: block 32 with 4 warps
# took 1.2-1.3x as long).
BLOCK_V = 8
NUM_WARPS = 2


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


def gdn_gates_ref(A_log, a, b, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, each
    ``[n, Hv]`` for ``a``/``b`` ``[n, Hv]``: GatedDeltaNet's gates as vLLM's
    ``fused_gdn_gating`` computes them (softplus linear past 20)."""
    x = a.float() + dt_bias.float()
    softplus = torch.where(x <= SOFTPLUS_THRESHOLD, torch.log1p(torch.exp(x)), x)
    return -A_log.float().exp() * softplus, torch.sigmoid(b.float())


def tree_gated_delta_packed_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    query_start_loc: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    num_accepted: torch.Tensor,
    use_qk_l2norm: bool = True,
    saved_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``tree_gated_delta_packed``: gates by ``gdn_gates_ref``, the rows
    gathered, ``tree_gated_delta_ref``, the outputs scattered back."""
    rows, width = parents.shape
    total = q.shape[0]
    index = row_token_index(query_start_loc, rows, width, total)
    count = torch.minimum(num_tokens.long(), row_lengths(query_start_loc, rows))
    g, beta = gdn_gates_ref(A_log, a[:total], b[:total], dt_bias)
    slots = state_slots[:rows]
    column = (num_accepted[:rows].long() - 1).clamp(min=0).unsqueeze(1)
    initial = slots.long().gather(1, column).squeeze(1)
    out = tree_gated_delta_ref(
        *(gather_rows(t, index) for t in (q, k, v, g, beta)),
        parents,
        count,
        state_pool,
        initial,
        slots,
        use_qk_l2norm=use_qk_l2norm,
    )
    if saved_slots is not None:
        saved_slots[:rows].copy_(slots)
    return scatter_rows(out, index, total)


if HAS_TRITON:

    @triton.jit
    def _tree_gated_delta_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        a_log_ptr,
        dt_bias_ptr,
        starts_ptr,
        parents_ptr,
        num_tokens_ptr,
        state_ptr,
        initial_ptr,
        initial_slots_ptr,
        state_slots_ptr,
        out_ptr,
        saved_slots_ptr,
        scale,
        stride_q_t,
        stride_q_h,
        stride_k_t,
        stride_k_h,
        stride_v_t,
        stride_v_h,
        stride_o_t,
        stride_o_h,
        stride_g_t,
        stride_g_h,
        stride_beta_t,
        stride_beta_h,
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
        BLOCK_T: tl.constexpr,
        USE_QK_L2NORM: tl.constexpr,
        GATES_FROM_AB: tl.constexpr,
        INITIAL_FROM_ACCEPTED: tl.constexpr,
        SAVE_SLOTS: tl.constexpr,
        SOFTPLUS_LINEAR_FROM: tl.constexpr,
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
        first = tl.load(starts_ptr + req).to(tl.int64)  # row req's tokens from here on
        row_len = tl.load(starts_ptr + req + 1).to(tl.int64) - first
        count = tl.minimum(tl.load(num_tokens_ptr + req).to(tl.int64), row_len)
        row_slots = state_slots_ptr + req * stride_slots_r
        if INITIAL_FROM_ACCEPTED:
            # vLLM's speculative layout: the step starts from block [r, num_accepted - 1].
            column = tl.maximum(tl.load(initial_slots_ptr + req).to(tl.int64) - 1, 0)
            initial = tl.load(row_slots + column).to(tl.int64)
        else:
            initial = tl.load(initial_slots_ptr + req).to(tl.int64)
        if SAVE_SLOTS:
            if (v_head == 0) & (v_block == 0):  # the nodes' blocks, for the commit
                offs_t = tl.arange(0, BLOCK_T)
                slots = tl.load(row_slots + offs_t, mask=offs_t < MAX_TOKENS)
                tl.store(
                    saved_slots_ptr + req * MAX_TOKENS + offs_t,
                    slots.to(saved_slots_ptr.dtype.element_ty),
                    mask=offs_t < MAX_TOKENS,
                )
        if GATES_FROM_AB:
            a_log = tl.load(a_log_ptr + v_head).to(tl.float32)
            dt_bias = tl.load(dt_bias_ptr + v_head).to(tl.float32)
        h = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        # Node t + 1's inputs, parent and (read from memory) parent state are loaded while
        # node t computes: the reads of a node are off the chain of dependent steps.
        ahead = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        tree_row = parents_ptr + req * stride_tree_r
        has_next = count > 0
        next_parent = tl.load(tree_row, mask=has_next, other=-1)
        n_q, n_k, n_v, n_g, n_beta = _token_inputs(
            q_ptr + first * stride_q_t + k_head * stride_q_h,
            k_ptr + first * stride_k_t + k_head * stride_k_h,
            v_ptr + first * stride_v_t + v_head * stride_v_h,
            g_ptr + first * stride_g_t + v_head * stride_g_h,
            beta_ptr + first * stride_beta_t + v_head * stride_beta_h,
            offs_k,
            offs_v,
            k_valid & has_next,
            v_valid & has_next,
            has_next,
        )
        for t in range(0, MAX_TOKENS):
            if t < count:
                token = first + t
                parent = next_parent
                b_q, b_k, b_v, raw_g, raw_beta = n_q, n_k, n_v, n_g, n_beta
                nxt = token + 1
                has_next = t + 1 < count
                next_parent = tl.load(tree_row + t + 1, mask=has_next, other=-1)
                n_q, n_k, n_v, n_g, n_beta = _token_inputs(
                    q_ptr + nxt * stride_q_t + k_head * stride_q_h,
                    k_ptr + nxt * stride_k_t + k_head * stride_k_h,
                    v_ptr + nxt * stride_v_t + v_head * stride_v_h,
                    g_ptr + nxt * stride_g_t + v_head * stride_g_h,
                    beta_ptr + nxt * stride_beta_t + v_head * stride_beta_h,
                    offs_k,
                    offs_v,
                    k_valid & has_next,
                    v_valid & has_next,
                    has_next,
                )
                if parent < 0:
                    h = tl.load(
                        initial_ptr
                        + initial * stride_init_slot
                        + v_head * stride_init_h
                        + init_offsets,
                        mask=hv_mask,
                        other=0.0,
                    ).to(tl.float32)
                    # A node may store into the committed block (vLLM's speculative layout):
                    # every thread reads it before any writes there.
                    tl.debug_barrier()
                elif parent == t - 1:
                    # The previous node's state, still in registers, as it was stored.
                    h = h.to(state_ptr.dtype.element_ty).to(tl.float32)
                else:
                    h = ahead  # read during node t - 1, after its parent's store
                if has_next & (next_parent >= 0) & (next_parent < t):
                    # Node t + 1's parent was stored in an earlier iteration, maybe by other
                    # threads: past a barrier, read its state now. A chain (each parent the
                    # previous node, kept in registers) passes none.
                    tl.debug_barrier()
                    slot = tl.load(row_slots + next_parent).to(tl.int64)
                    ahead = tl.load(
                        state_ptr + slot * stride_state_slot + v_head * stride_state_h + hv_offsets,
                        mask=hv_mask,
                        other=0.0,
                    ).to(tl.float32)
                if USE_QK_L2NORM:
                    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
                    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
                b_q = b_q * scale
                if GATES_FROM_AB:
                    # g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b): vLLM's gates.
                    x = raw_g + dt_bias
                    softplus = tl.where(x <= SOFTPLUS_LINEAR_FROM, tl.log(1.0 + tl.exp(x)), x)
                    gate = -tl.exp(a_log) * softplus
                    b_beta = tl.sigmoid(raw_beta)
                else:
                    gate = raw_g
                    b_beta = raw_beta
                h = h * tl.exp(gate)
                b_v = (b_v - tl.sum(h * b_k[:, None], 0)) * b_beta
                h = h + b_k[:, None] * b_v[None, :]
                b_o = tl.sum(h * b_q[:, None], 0)
                out_row = out_ptr + token * stride_o_t + v_head * stride_o_h
                tl.store(out_row + offs_v, b_o.to(out_ptr.dtype.element_ty), mask=v_valid)
                out_slot = tl.load(row_slots + t).to(tl.int64)
                tl.store(
                    state_ptr + out_slot * stride_state_slot + v_head * stride_state_h + hv_offsets,
                    h.to(state_ptr.dtype.element_ty),
                    mask=hv_mask,
                )

    @triton.jit
    def _token_inputs(q_at, k_at, v_at, g_at, beta_at, offs_k, offs_v, k_mask, v_mask, scalar_mask):
        """One token's q, k (``[BLOCK_K]``), v (``[BLOCK_V]``) and raw gates, float32."""
        b_q = tl.load(q_at + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        b_k = tl.load(k_at + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        b_v = tl.load(v_at + offs_v, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_at, mask=scalar_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_at, mask=scalar_mask, other=0.0).to(tl.float32)
        return b_q, b_k, b_v, g, beta


def _launch(
    q,
    k,
    v,
    g_or_a,
    beta_or_b,
    a_log,
    dt_bias,
    starts,
    parents,
    num_tokens,
    state_pool,
    initial_state,
    initial_index,
    state_slots,
    saved_slots,
    use_qk_l2norm: bool,
    block_v: int,
    num_warps: int,
    gates_from_ab: bool,
    initial_from_accepted: bool,
) -> torch.Tensor:
    """One launch over packed tokens (``q``/``k`` ``[n, Hk, K]``, ``v`` ``[n, Hv, V]``, row
    ``r`` from ``starts[r]``); returns ``[n, Hv, V]``, zeros where no row's node is."""
    num_reqs, max_tokens = parents.shape
    num_v_heads, head_v = v.shape[1:]
    num_k_heads, head_k = k.shape[1:]
    assert q.shape[1:] == k.shape[1:] and q.shape[0] == k.shape[0] == v.shape[0]
    assert num_v_heads % num_k_heads == 0, "value heads must be a multiple of key heads"
    if state_pool.dtype not in STATE_DTYPES:
        raise ValueError(
            f"tree node states must be one of {STATE_DTYPES}, got a {state_pool.dtype} pool"
        )
    assert state_pool.shape[1:] == (num_v_heads, head_k, head_v)
    assert initial_state.shape[1:] == state_pool.shape[1:], "initial states are [S', Hv, K, V]"
    assert parents.stride(-1) == 1 and state_slots.stride(-1) == 1
    for t in (q, k, v):
        assert t.stride(-1) == 1
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if num_reqs == 0:
        return out
    save = saved_slots is not None
    if save:
        assert saved_slots.is_contiguous() and saved_slots.shape[1] == max_tokens
    block_v = min(block_v, triton.next_power_of_2(head_v))
    grid = (num_reqs, num_v_heads, triton.cdiv(head_v, block_v))
    _tree_gated_delta_kernel[grid](
        q,
        k,
        v,
        g_or_a,
        beta_or_b,
        a_log if a_log is not None else g_or_a,
        dt_bias if dt_bias is not None else g_or_a,
        starts,
        parents,
        num_tokens,
        state_pool,
        initial_state,
        initial_index,
        state_slots,
        out,
        saved_slots if save else state_slots,
        head_k**-0.5,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        g_or_a.stride(0),
        g_or_a.stride(1),
        beta_or_b.stride(0),
        beta_or_b.stride(1),
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
        BLOCK_T=triton.next_power_of_2(max_tokens),
        USE_QK_L2NORM=use_qk_l2norm,
        GATES_FROM_AB=gates_from_ab,
        INITIAL_FROM_ACCEPTED=initial_from_accepted,
        SAVE_SLOTS=save,
        SOFTPLUS_LINEAR_FROM=SOFTPLUS_THRESHOLD,
        num_warps=num_warps,
    )
    return out


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
    block_v: int = BLOCK_V,
    initial_state: torch.Tensor | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Gated delta rule over per-request trees (see the module docstring for shapes).

    One program per (request, value head, block of V): it walks the nodes in index order, reads
    each parent's state from the pool (from registers where the parent is the node before)
    and writes the node's; a node's inputs and its parent's stored state are read while the
    node before it computes. ``initial_state``
    ``[S', Hv, K, V]`` (any float dtype and strides; default: ``state_pool``) holds the
    committed states ``initial_slots`` points at. Returns ``[R, T, Hv, V]``.
    """
    num_reqs, max_tokens, num_v_heads, head_v = v.shape
    assert g.shape == beta.shape == (num_reqs, max_tokens, num_v_heads)
    starts = torch.arange(num_reqs + 1, device=v.device) * max_tokens

    def packed(t):
        return t.reshape(num_reqs * max_tokens, *t.shape[2:])

    out = _launch(
        packed(q),
        packed(k),
        packed(v),
        packed(g),
        packed(beta),
        None,
        None,
        starts,
        parents,
        num_tokens,
        state_pool,
        state_pool if initial_state is None else initial_state,
        initial_slots,
        state_slots,
        None,
        use_qk_l2norm,
        block_v,
        num_warps,
        gates_from_ab=False,
        initial_from_accepted=False,
    )
    return out.view(v.shape)


def tree_gated_delta_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    query_start_loc: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    num_accepted: torch.Tensor,
    use_qk_l2norm: bool = True,
    saved_slots: torch.Tensor | None = None,
    block_v: int = BLOCK_V,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """The gated delta rule over trees as vLLM's speculative GDN call passes them, in one
    launch: tokens packed (``q``/``k`` ``[n, Hk, K]``, ``v`` ``[n, Hv, V]``, any token and head
    strides; row ``r`` from ``query_start_loc[r]``; tokens past the last row get zeros), the
    raw gate inputs ``a``/``b`` ``[>= n, Hv]`` with ``A_log``/``dt_bias`` ``[Hv]`` (the gates
    as ``gdn_gates_ref``), and vLLM's speculative state layout: node ``t`` of row ``r`` in block
    ``state_slots[r, t]`` of ``state_pool``, the committed state in block ``state_slots[r,
    num_accepted[r] - 1]``. With ``saved_slots`` (int32 ``[>= R, T]``) it also keeps each row's
    blocks there (what the commit after the walk reads). ``block_v`` and ``num_warps``: the
    launch (a program per value head and block of ``block_v`` of its V columns). Returns
    ``[n, Hv, V]``."""
    return _launch(
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        query_start_loc,
        parents,
        num_tokens,
        state_pool,
        state_pool,
        num_accepted,
        state_slots,
        saved_slots,
        use_qk_l2norm,
        block_v,
        num_warps,
        gates_from_ab=True,
        initial_from_accepted=True,
    )
