"""The drafter's context rows after a walk: Triton kernel, launcher and PyTorch reference.

vLLM's DFlash drafter reads, for each request, the step's rows from the root on: token ids,
positions and the target's hidden states of the feature layers. After a tree walk the committed
tokens are the accepted path, so rows ``root + accepted[r, j]`` move to rows ``root + j``
(``j = 1..num_accepted[r]``) in the token ids and hidden states. ``accepted`` increases along a
path, so moving in increasing ``j`` never overwrites a row before it is read (as in the KV
commit).

Positions are rewritten, not moved: every row ``root + j`` (``j = 0..num_draft[r]``) gets
``positions[root] + j``. The drafter stores every row's context K/V at the slot of the row's
position and attends only up to the end of the accepted path. A tree's rows carry depth
positions, so the rows left after the path (siblings, other branches) share positions with
path rows: kept, they would overwrite the path's context with another branch's (greedy output
unchanged, acceptance lower). Past the path they land where nothing reads them until later
steps overwrite them, as a chain's rejected tokens do.

Shapes: ``input_ids`` int ``[T]``, ``positions`` long ``[T]``, ``hidden`` a list of ``[T, H]``
tensors (the feature layers' hidden states); ``root`` long ``[R]`` (the row of each request's
root); ``accepted`` long ``[R, L + 1]``; ``num_accepted`` long ``[R]``; ``num_draft`` long
``[R]`` (tree nodes scheduled after each root, at most ``max_nodes``).
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops import use_triton

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
    num_draft: torch.Tensor,
    max_nodes: int,
) -> None:
    """PyTorch reference: one gather and one scatter per tensor (in place), then the
    sequential positions.

    Entries past a request's path (or its rows) write its root row onto itself (a no-op), so
    there is no boolean indexing and no host synchronisation.
    """
    device = accepted.device
    depth = accepted.shape[1]
    j = torch.arange(depth, device=device).unsqueeze(0)
    keep = (j <= num_accepted.unsqueeze(1)) & (accepted >= 0)
    start = root.unsqueeze(1)
    src = torch.where(keep, start + accepted.clamp(min=0), start).flatten()
    dst = torch.where(keep, start + j, start).flatten()
    for tensor in (input_ids, *hidden):
        tensor[dst] = tensor[src]
    rows = torch.arange(max_nodes + 1, device=device).unsqueeze(0)
    inside = rows <= num_draft.unsqueeze(1)
    root_position = positions[root].unsqueeze(1)
    positions[torch.where(inside, start + rows, start).flatten()] = torch.where(
        inside, root_position + rows, root_position
    ).flatten()


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

    @triton.jit
    def _sequential_positions_kernel(positions_ptr, root_ptr, num_draft_ptr, BLOCK: tl.constexpr):
        req = tl.program_id(0)
        root = tl.load(root_ptr + req)
        count = tl.load(num_draft_ptr + req)
        base = tl.load(positions_ptr + root)
        j = tl.arange(0, BLOCK)
        tl.store(positions_ptr + root + j, base + j, mask=(j >= 1) & (j <= count))


def move_path_rows_triton(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden: list[torch.Tensor],
    root: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
    max_nodes: int,
) -> None:
    """``move_path_rows_ref`` with one launch per tensor (``R x column blocks`` programs each)
    and one for the positions, no index tensors and no host synchronisation; rows must have a
    contiguous last dim."""
    num_reqs, path_len = accepted.shape
    if num_reqs == 0:
        return
    _sequential_positions_kernel[(num_reqs,)](
        positions, root, num_draft, BLOCK=triton.next_power_of_2(max_nodes + 1)
    )
    if path_len <= 1:
        return
    for tensor in (input_ids.view(-1, 1), *hidden):
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


def move_path_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden: list[torch.Tensor],
    root: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
    max_nodes: int,
) -> None:
    """``move_path_rows_triton`` on CUDA when every hidden tensor has rows with a contiguous
    last dim, else ``move_path_rows_ref`` (same arguments, in place)."""
    rows_ok = all(h.dim() == 2 and h.stride(-1) == 1 for h in hidden)
    move = move_path_rows_triton if use_triton(accepted.device) and rows_ok else move_path_rows_ref
    move(input_ids, positions, hidden, root, accepted, num_accepted, num_draft, max_nodes)
