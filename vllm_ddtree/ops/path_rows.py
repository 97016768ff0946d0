"""The drafter's context rows after a walk: Triton kernel, launcher and PyTorch reference.

vLLM's DFlash drafter reads, for each request, the step's rows from the root on: token ids,
positions and the target's hidden states of the feature layers. After a tree walk the committed
tokens are the accepted path, so rows ``root + accepted[r, j]`` move to rows ``root + j``
(``j = 1..num_accepted[r]``), in every one of those tensors. ``accepted`` increases along a
path, so moving in increasing ``j`` never overwrites a row before it is read (as in the KV
commit).

Shapes: ``input_ids`` int ``[T]``, ``positions`` long ``[T]``, ``hidden`` a list of ``[T, H]``
tensors (the feature layers' hidden states); ``root`` long ``[R]`` (the row of each request's
root); ``accepted`` long ``[R, L + 1]``; ``num_accepted`` long ``[R]``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def move_path_rows_ref(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden: list[torch.Tensor],
    root: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """PyTorch reference: one gather and one scatter per tensor (in place).

    Entries past a request's path copy its root row onto itself (a no-op), so there is no
    boolean indexing and no host synchronisation.
    """
    device = accepted.device
    depth = accepted.shape[1]
    j = torch.arange(depth, device=device).unsqueeze(0)
    keep = (j <= num_accepted.unsqueeze(1)) & (accepted >= 0)
    start = root.unsqueeze(1)
    src = torch.where(keep, start + accepted.clamp(min=0), start).flatten()
    dst = torch.where(keep, start + j, start).flatten()
    for tensor in (input_ids, positions, *hidden):
        tensor[dst] = tensor[src]


if HAS_TRITON:

    @triton.jit
    def _move_path_rows_kernel(
        data_ptr,
        root_ptr,
        accepted_ptr,
        num_accepted_ptr,
        stride_row,
        stride_accepted,
        width,
        MAX_DEPTH: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        req = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < width
        count = tl.load(num_accepted_ptr + req)
        root = tl.load(root_ptr + req)
        for j in range(1, MAX_DEPTH + 1):
            node = tl.load(accepted_ptr + req * stride_accepted + j, mask=j <= count, other=j)
            if (j <= count) & (node != j):
                row = tl.load(data_ptr + (root + node) * stride_row + cols, mask=in_row)
                tl.store(data_ptr + (root + j) * stride_row + cols, row, mask=in_row)


def move_path_rows_triton(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden: list[torch.Tensor],
    root: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """``move_path_rows_ref`` with one launch per tensor (``R x column blocks`` programs each),
    no index tensors and no host synchronisation; rows must have a contiguous last dim."""
    num_reqs, path_len = accepted.shape
    if num_reqs == 0 or path_len <= 1:
        return
    for tensor in (input_ids.view(-1, 1), positions.view(-1, 1), *hidden):
        assert tensor.dim() == 2 and tensor.stride(-1) == 1, "rows need a contiguous last dim"
        width = tensor.shape[1]
        block = min(1024, max(16, triton.next_power_of_2(width)))
        _move_path_rows_kernel[(num_reqs, triton.cdiv(width, block))](
            tensor,
            root,
            accepted,
            num_accepted,
            tensor.stride(0),
            accepted.stride(0),
            width,
            MAX_DEPTH=path_len - 1,
            BLOCK=block,
        )
