"""Packed tokens <-> per-request rows, for the PyTorch references of the hybrid ops.

vLLM passes a forward's tokens packed, request ``s``'s from ``query_start_loc[s]`` on; the
references (and the float32 prefill test kit) work on rows ``[S, T, ...]``. The Triton kernels
read the packed tokens directly.
"""

from __future__ import annotations

import torch


def row_token_index(
    query_start_loc: torch.Tensor, num_rows: int, width: int, total: int
) -> torch.Tensor:
    """long ``[S, width]``: the flat token of each packed row's ``t``-th token (row ``s`` from
    ``query_start_loc[s]``, ``S = num_rows``), ``total`` (a spare slot) past a row's end."""
    starts = query_start_loc[: num_rows + 1].long()
    offsets = torch.arange(width, device=starts.device)
    index = starts[:num_rows, None] + offsets[None, :]
    inside = offsets[None, :] < (starts[1:] - starts[:-1])[:, None]
    return torch.where(inside, index, total)


def gather_rows(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``flat`` ``[n, ...]`` -> ``[S, T, ...]`` by ``row_token_index`` (zeros at the spare
    index ``n``)."""
    padded = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])
    return padded[index]


def scatter_rows(rows: torch.Tensor, index: torch.Tensor, total: int) -> torch.Tensor:
    """``rows`` ``[S, T, ...]`` -> ``[total, ...]`` (what lies past a row's end dropped; zeros
    where no row's token is)."""
    out = rows.new_zeros((total + 1, *rows.shape[2:]))
    out.index_copy_(0, index.flatten(), rows.flatten(0, 1))
    return out[:total]


def row_lengths(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """long ``[S]``: each packed row's token count."""
    starts = query_start_loc[: num_rows + 1].long()
    return starts[1:] - starts[:-1]
