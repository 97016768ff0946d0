"""Depthwise causal conv1d over a draft tree: Triton kernel, launcher and PyTorch reference.

GatedDeltaNet layers run a short causal convolution (width ``W``, usually 4) over their input
before the recurrence. In a tree, node ``t``'s window is its own input and the inputs of its
``W - 1`` nearest ancestors, falling back into the committed history (the conv state, the last
``W - 1`` committed inputs, oldest first) once the walk passes the root:

    y_t[c] = act(bias[c] + sum_{j < W} weight[c, j] * window_t[j][c]),  window_t[W-1] = x_t

Shapes: ``x`` ``[R, T, C]``; ``parents`` long ``[R, T]`` (``-1`` for the root, t = 0);
``num_tokens`` long ``[R]``; ``conv_state`` ``[S, C, W - 1]`` (any strides: vLLM's default
window-first ``[S, W - 1, C]`` cache is passed as ``.transpose(1, 2)``) with ``state_index`` int
``[R]`` (any stride: vLLM passes column 0 of its ``[R, 1 + B]`` state-index table); ``weight``
``[C, W]``; ``bias`` ``[C]`` or None; activation ``"silu"`` or None.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def tree_causal_conv1d_ref(
    x: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_state: torch.Tensor,
    state_index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Reference: each node's window built from its root-to-node path, in float64."""
    num_reqs, max_tokens, channels = x.shape
    width = weight.shape[1]
    out = torch.zeros_like(x)
    for r in range(num_reqs):
        history = conv_state[int(state_index[r])].double().T  # [W - 1, C], oldest first
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


if HAS_TRITON:

    @triton.jit
    def _tree_causal_conv1d_kernel(
        x_ptr,
        parents_ptr,
        num_tokens_ptr,
        conv_state_ptr,
        state_index_ptr,
        weight_ptr,
        bias_ptr,
        out_ptr,
        channels,
        stride_x_r,
        stride_x_t,
        stride_tree_r,
        stride_index_r,
        stride_state_s,
        stride_state_c,
        stride_state_w,
        stride_w_c,
        MAX_TOKENS: tl.constexpr,
        WIDTH: tl.constexpr,
        BLOCK_C: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
    ):
        req = tl.program_id(0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_valid = offs_c < channels
        count = tl.load(num_tokens_ptr + req)
        state = tl.load(state_index_ptr + req * stride_index_r).to(tl.int64)
        for t in range(0, MAX_TOKENS):
            if t < count:
                acc = tl.zeros([BLOCK_C], dtype=tl.float32)
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + offs_c, mask=c_valid, other=0.0).to(tl.float32)
                node = t
                history_steps = 0  # how far past the root the window has walked
                for j in range(0, WIDTH):
                    # tap WIDTH-1-j looks j steps up the path from t.
                    if node >= 0:
                        value = tl.load(
                            x_ptr + req * stride_x_r + node * stride_x_t + offs_c,
                            mask=c_valid,
                            other=0.0,
                        ).to(tl.float32)
                        node = tl.load(parents_ptr + req * stride_tree_r + node).to(tl.int32)
                    else:
                        history_steps += 1
                        column = WIDTH - 1 - history_steps  # newest committed input last
                        value = tl.load(
                            conv_state_ptr
                            + state * stride_state_s
                            + offs_c * stride_state_c
                            + column * stride_state_w,
                            mask=c_valid,
                            other=0.0,
                        ).to(tl.float32)
                    tap = tl.load(
                        weight_ptr + offs_c * stride_w_c + (WIDTH - 1 - j),
                        mask=c_valid,
                        other=0.0,
                    ).to(tl.float32)
                    acc += tap * value
                if SILU:
                    acc = acc * tl.sigmoid(acc)
                tl.store(
                    out_ptr + req * stride_x_r + t * stride_x_t + offs_c,
                    acc.to(out_ptr.dtype.element_ty),
                    mask=c_valid,
                )


def tree_causal_conv1d(
    x: torch.Tensor,
    parents: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_state: torch.Tensor,
    state_index: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    block_c: int = 128,
) -> torch.Tensor:
    """Causal conv1d over per-request trees (see the module docstring). Returns ``[R, T, C]``."""
    num_reqs, max_tokens, channels = x.shape
    width = weight.shape[1]
    assert conv_state.shape[1:] == (channels, width - 1)
    assert x.is_contiguous() and weight.stride(-1) == 1
    out = torch.empty_like(x)
    block_c = min(block_c, triton.next_power_of_2(channels))
    grid = (num_reqs, triton.cdiv(channels, block_c))
    _tree_causal_conv1d_kernel[grid](
        x,
        parents,
        num_tokens,
        conv_state,
        state_index,
        weight,
        bias if bias is not None else weight,
        out,
        channels,
        x.stride(0),
        x.stride(1),
        parents.stride(0),
        state_index.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        weight.stride(0),
        MAX_TOKENS=max_tokens,
        WIDTH=width,
        BLOCK_C=block_c,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
    )
    return out
