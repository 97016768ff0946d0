"""Depthwise causal conv1d over a draft tree: Triton kernel, launcher and PyTorch reference.

GatedDeltaNet layers run a short causal convolution (width ``W``, usually 4) over their input
before the recurrence. In a tree, node ``t``'s window is its own input and the inputs of its
``W - 1`` nearest ancestors, falling back into the committed history (the conv state, the last
``W - 1`` committed inputs, oldest first) once the walk passes the root:

    y_t[c] = act(bias[c] + sum_{j < W} weight[c, j] * window_t[j][c]),  window_t[W-1] = x_t

Where the committed history sits: vLLM's speculative layout keeps a request's conv window in
one block of ``K - 1 + B`` columns (``K = W``) and, after a step that accepted ``n`` tokens,
reads the window from column ``n - 1`` on (``num_accepted_tokens``, its chain convention; the
GatedDeltaNet commit, ``ops/gdn_commit.py``, leaves the accepted path in the same layout).
``num_accepted`` (per row, or None for column 0) says where each row's window starts.

Shapes: ``x`` ``[R, T, C]``; ``parents`` long ``[R, T]`` (``-1`` for the root, t = 0);
``num_tokens`` long ``[R]``; ``conv_state`` ``[S, C, >= W - 1]`` (any strides: vLLM's default
window-first ``[S, W - 1 + B, C]`` cache is passed as ``.transpose(1, 2)``) with ``state_index``
int ``[R]`` (any stride: vLLM passes column 0 of its ``[R, 1 + B]`` state-index table);
``num_accepted`` int ``[R]`` or None; ``weight`` ``[C, W]``; ``bias`` ``[C]`` or None;
activation ``"silu"`` or None.
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


def window_offsets(num_accepted: torch.Tensor | None, rows: int, device) -> torch.Tensor:
    """Each row's first column of its committed window: ``num_accepted - 1`` (at least 0), or 0
    for every row when ``num_accepted`` is None. Long ``[rows]``."""
    if num_accepted is None:
        return torch.zeros(rows, dtype=torch.long, device=device)
    return (num_accepted[:rows].long() - 1).clamp(min=0)


def tree_causal_conv1d_ref(
    x: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_state: torch.Tensor,
    state_index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    num_accepted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: each node's window built from its root-to-node path, in float64."""
    num_reqs, max_tokens, channels = x.shape
    width = weight.shape[1]
    out = torch.zeros_like(x)
    offsets = window_offsets(num_accepted, num_reqs, x.device)
    for r in range(num_reqs):
        first = int(offsets[r])
        block = conv_state[int(state_index[r])]
        history = block[:, first : first + width - 1].double().T  # [W - 1, C], oldest first
        for t in range(int(num_tokens[r])):
            path = [t]
            while int(parents[r, path[-1]]) >= 0:
                path.append(int(parents[r, path[-1]]))
            inputs = torch.cat([history, x[r, list(reversed(path))].double()], 0)
            window = inputs[-width:]  # [W, C]
            y = (window.T * weight.double()).sum(-1)
            if bias is not None:
                y = y + bias.double()
            if activation == "silu":
                y = y * torch.sigmoid(y)
            out[r, t] = y.to(x.dtype)
    return out


def conv_state_after_path(
    conv_state: torch.Tensor, x: torch.Tensor, path: list[int], width: int
) -> torch.Tensor:
    """Reference commit: the conv state ``[C, W - 1]`` after the accepted ``path`` (tree
    indices, root first) of one request: the last ``W - 1`` inputs of history + path."""
    inputs = torch.cat([conv_state.T, x[path].to(conv_state.dtype)], 0)
    return inputs[-(width - 1) :].T.contiguous()


def tree_causal_conv1d_packed_ref(
    x: torch.Tensor,
    query_start_loc: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_state: torch.Tensor,
    state_index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    saved_inputs: torch.Tensor | None = None,
    saved_index: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
    saved_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``tree_causal_conv1d_packed``: the rows gathered, ``tree_causal_conv1d_ref``,
    the outputs scattered back (zeros where no row's node is)."""
    rows, width = parents.shape
    total = x.shape[0]
    index = row_token_index(query_start_loc, rows, width, total)
    count = torch.minimum(num_tokens.long(), row_lengths(query_start_loc, rows))
    gathered = gather_rows(x, index)
    out_rows = tree_causal_conv1d_ref(
        gathered, parents, count, conv_state, state_index, weight, bias, activation, num_accepted
    )
    if saved_inputs is not None:
        saved_inputs[:rows].copy_(gathered)
        saved_index[:rows].copy_(state_index[:rows])
    if saved_offset is not None:
        saved_offset[:rows].copy_(window_offsets(num_accepted, rows, x.device))
    return scatter_rows(out_rows, index, total)


if HAS_TRITON:

    @triton.jit
    def _tree_causal_conv1d_kernel(
        x_ptr,
        starts_ptr,
        parents_ptr,
        num_tokens_ptr,
        conv_state_ptr,
        state_index_ptr,
        weight_ptr,
        bias_ptr,
        out_ptr,
        saved_inputs_ptr,
        saved_index_ptr,
        num_accepted_ptr,
        saved_offset_ptr,
        channels,
        stride_x_t,
        stride_out_t,
        stride_tree_r,
        stride_index_r,
        stride_state_s,
        stride_state_c,
        stride_state_w,
        stride_w_c,
        MAX_TOKENS: tl.constexpr,
        WIDTH: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        SAVE: tl.constexpr,
        HAS_ACCEPTED: tl.constexpr,
        SAVE_OFFSET: tl.constexpr,
    ):
        req = tl.program_id(0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_valid = offs_c < channels
        first = tl.load(starts_ptr + req).to(tl.int64)  # row req's tokens from here on
        row_len = tl.load(starts_ptr + req + 1).to(tl.int64) - first
        count = tl.minimum(tl.load(num_tokens_ptr + req).to(tl.int64), row_len)
        state = tl.load(state_index_ptr + req * stride_index_r).to(tl.int64)
        if SAVE:
            if tl.program_id(1) == 0:
                tl.store(saved_index_ptr + req, state.to(saved_index_ptr.dtype.element_ty))
        first_column = tl.full([], 0, tl.int64)
        if HAS_ACCEPTED:  # the window starts at column num_accepted - 1 (vLLM's convention)
            first_column = tl.maximum(tl.load(num_accepted_ptr + req).to(tl.int64) - 1, 0)
        if SAVE_OFFSET:
            if tl.program_id(1) == 0:
                tl.store(saved_offset_ptr + req, first_column.to(saved_offset_ptr.dtype.element_ty))
        window = (
            conv_state_ptr
            + state * stride_state_s
            + first_column * stride_state_w
            + offs_c * stride_state_c
        )  # [BLOCK_C]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_c, mask=c_valid, other=0.0).to(tl.float32)
        # BLOCK_T nodes at once: their windows are walked up the tree together, tap by tap, so
        # a chunk costs WIDTH dependent reads of parents, not WIDTH per node.
        for t0 in range(0, MAX_TOKENS, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            t_valid = offs_t < count
            acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            if HAS_BIAS:
                acc += bias[None, :]
            node = offs_t.to(tl.int64)  # each token's window position j, up its path
            past_root = tl.zeros([BLOCK_T], dtype=tl.int32)  # how far past the root the walk is
            for j in tl.static_range(WIDTH):
                # tap WIDTH-1-j looks j steps up the path from the token.
                on_tree = t_valid & (node >= 0)
                raw = tl.load(
                    x_ptr + (first + node)[:, None] * stride_x_t + offs_c[None, :],
                    mask=on_tree[:, None] & c_valid[None, :],
                    other=0.0,
                )
                if SAVE:
                    if j == 0:  # the node's own input, for the commit
                        at = (req * MAX_TOKENS + offs_t)[:, None] * channels + offs_c[None, :]
                        tl.store(
                            saved_inputs_ptr + at, raw, mask=t_valid[:, None] & c_valid[None, :]
                        )
                past_root += (node < 0).to(tl.int32)
                column = WIDTH - 1 - past_root  # newest committed input last
                history = tl.load(
                    window[None, :] + column[:, None] * stride_state_w,
                    mask=(t_valid & (node < 0))[:, None] & c_valid[None, :],
                    other=0.0,
                )
                value = tl.where(on_tree[:, None], raw.to(tl.float32), history.to(tl.float32))
                tap = tl.load(
                    weight_ptr + offs_c * stride_w_c + (WIDTH - 1 - j),
                    mask=c_valid,
                    other=0.0,
                ).to(tl.float32)
                acc += tap[None, :] * value
                if j < WIDTH - 1:
                    up = tl.load(parents_ptr + req * stride_tree_r + node, mask=on_tree, other=-1)
                    node = tl.where(on_tree, up, node)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(
                out_ptr + (first + offs_t)[:, None] * stride_out_t + offs_c[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=t_valid[:, None] & c_valid[None, :],
            )


def tree_causal_conv1d_packed(
    x: torch.Tensor,
    query_start_loc: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_state: torch.Tensor,
    state_index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    saved_inputs: torch.Tensor | None = None,
    saved_index: torch.Tensor | None = None,
    num_accepted: torch.Tensor | None = None,
    saved_offset: torch.Tensor | None = None,
    block_c: int = 64,
    block_t: int = 32,
) -> torch.Tensor:
    """Causal conv1d over trees whose tokens lie packed, as vLLM passes a forward's: ``x``
    ``[n, C]`` (last dim contiguous), row ``s``'s tokens from ``query_start_loc[s]`` (int
    ``[>= R + 1]``; tokens past the last row, CUDA-graph padding, get zeros); ``parents``
    ``[R, T]``, ``num_tokens`` ``[R]`` and ``num_accepted`` ``[>= R]`` (or None) as in the
    module docstring. One launch; with ``saved_inputs`` (contiguous ``[>= R, T, C]``, ``x``'s
    dtype) and ``saved_index`` (``[>= R]``) it also keeps each node's input and each row's
    ``state_index`` there, and with ``saved_offset`` (``[>= R]``) each row's window column
    (what the commit after the walk reads). One program per row and ``block_c`` channels,
    ``block_t`` nodes at a time. Returns ``[n, C]``."""
    channels = x.shape[1]
    num_reqs, max_tokens = parents.shape
    width = weight.shape[1]
    assert conv_state.shape[1] == channels and conv_state.shape[2] >= width - 1
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and parents.stride(-1) == 1
    save = saved_inputs is not None
    if save:
        assert saved_index is not None and saved_inputs.is_contiguous()
        assert saved_inputs.shape[1:] == (max_tokens, channels)
        assert saved_inputs.dtype == x.dtype
    out = torch.zeros_like(x)
    if num_reqs == 0:
        return out
    block_c = min(block_c, triton.next_power_of_2(channels))
    block_t = min(block_t, triton.next_power_of_2(max_tokens))
    grid = (num_reqs, triton.cdiv(channels, block_c))
    _tree_causal_conv1d_kernel[grid](
        x,
        query_start_loc,
        parents,
        num_tokens,
        conv_state,
        state_index,
        weight,
        bias if bias is not None else weight,
        out,
        saved_inputs if save else x,
        saved_index if save else state_index,
        num_accepted if num_accepted is not None else state_index,
        saved_offset if saved_offset is not None else state_index,
        channels,
        x.stride(0),
        out.stride(0),
        parents.stride(0),
        state_index.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        weight.stride(0),
        MAX_TOKENS=max_tokens,
        WIDTH=width,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        SAVE=save,
        HAS_ACCEPTED=num_accepted is not None,
        SAVE_OFFSET=saved_offset is not None,
    )
    return out


def tree_causal_conv1d(
    x: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_state: torch.Tensor,
    state_index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    num_accepted: torch.Tensor | None = None,
    block_c: int = 64,
    block_t: int = 32,
) -> torch.Tensor:
    """Causal conv1d over per-request trees (see the module docstring). Returns ``[R, T, C]``."""
    num_reqs, max_tokens, channels = x.shape
    assert x.is_contiguous()
    starts = torch.arange(num_reqs + 1, device=x.device) * max_tokens
    out = tree_causal_conv1d_packed(
        x.view(num_reqs * max_tokens, channels),
        starts,
        parents,
        num_tokens,
        conv_state,
        state_index,
        weight,
        bias,
        activation,
        num_accepted=num_accepted,
        block_c=block_c,
        block_t=block_t,
    )
    return out.view(num_reqs, max_tokens, channels)
