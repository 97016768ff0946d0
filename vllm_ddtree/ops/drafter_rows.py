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
    def _move_row(data_ptr, stride_row, src, dst, cols, in_row):
        """Row ``src`` of a ``[T, width]`` tensor onto row ``dst`` (this program's columns)."""
        row = tl.load(data_ptr + src * stride_row + cols, mask=in_row)
        tl.store(data_ptr + dst * stride_row + cols, row, mask=in_row)

    @triton.jit
    def _move_path_rows_kernel(
        h0_ptr,
        h1_ptr,
        h2_ptr,
        h3_ptr,
        h4_ptr,
        h5_ptr,
        h6_ptr,
        h7_ptr,
        ids_ptr,
        positions_ptr,
        root_ptr,
        accepted_ptr,
        num_accepted_ptr,
        num_draft_ptr,
        stride_h0,
        stride_h1,
        stride_h2,
        stride_h3,
        stride_h4,
        stride_h5,
        stride_h6,
        stride_h7,
        stride_accepted,
        width,
        NUM_HIDDEN: tl.constexpr,
        WITH_IDS: tl.constexpr,
        MAX_DEPTH: tl.constexpr,
        BLOCK: tl.constexpr,
        POSITIONS_BLOCK: tl.constexpr,
    ):
        req = tl.program_id(0)
        column_block = tl.program_id(1)
        cols = column_block * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < width
        count = tl.load(num_accepted_ptr + req)
        root = tl.load(root_ptr + req)
        if WITH_IDS:
            if column_block == 0:
                # Sequential positions from the root on (the root's own is read first).
                base = tl.load(positions_ptr + root)
                rows = tl.arange(0, POSITIONS_BLOCK)
                drafted = tl.load(num_draft_ptr + req)
                tl.store(
                    positions_ptr + root + rows, base + rows, mask=(rows >= 1) & (rows <= drafted)
                )
        for j in range(1, MAX_DEPTH + 1):
            node = tl.load(accepted_ptr + req * stride_accepted + j, mask=j <= count, other=j)
            if (j <= count) & (node != j):
                src, dst = root + node, root + j
                if NUM_HIDDEN > 0:
                    _move_row(h0_ptr, stride_h0, src, dst, cols, in_row)
                if NUM_HIDDEN > 1:
                    _move_row(h1_ptr, stride_h1, src, dst, cols, in_row)
                if NUM_HIDDEN > 2:
                    _move_row(h2_ptr, stride_h2, src, dst, cols, in_row)
                if NUM_HIDDEN > 3:
                    _move_row(h3_ptr, stride_h3, src, dst, cols, in_row)
                if NUM_HIDDEN > 4:
                    _move_row(h4_ptr, stride_h4, src, dst, cols, in_row)
                if NUM_HIDDEN > 5:
                    _move_row(h5_ptr, stride_h5, src, dst, cols, in_row)
                if NUM_HIDDEN > 6:
                    _move_row(h6_ptr, stride_h6, src, dst, cols, in_row)
                if NUM_HIDDEN > 7:
                    _move_row(h7_ptr, stride_h7, src, dst, cols, in_row)
                if WITH_IDS:
                    if column_block == 0:
                        tl.store(ids_ptr + dst, tl.load(ids_ptr + src))


HIDDEN_PER_LAUNCH = 8  # the kernel's hidden-state pointer arguments (a z-lab drafter reads 5)


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
    """``move_path_rows_ref`` in one launch (``R x column blocks`` programs) for the token
    ids, the positions and up to eight hidden tensors of one row width (a DFlash drafter's
    feature layers), one more per eight further tensors; no index tensors and no host
    synchronisation. Rows must have a contiguous last dim."""
    num_reqs, path_len = accepted.shape
    if num_reqs == 0:
        return
    for tensor in hidden:
        assert tensor.dim() == 2 and tensor.stride(-1) == 1, "rows need a contiguous last dim"
    ids = input_ids.view(-1)
    by_width: dict[int, list[torch.Tensor]] = {}
    for tensor in hidden:
        by_width.setdefault(tensor.shape[1], []).append(tensor)
    launches = [
        tensors[i : i + HIDDEN_PER_LAUNCH]
        for tensors in by_width.values()
        for i in range(0, len(tensors), HIDDEN_PER_LAUNCH)
    ] or [[]]
    for index, group in enumerate(launches):
        width = group[0].shape[1] if group else 1
        block = min(1024, max(16, triton.next_power_of_2(width)))
        # Unused pointer slots get a tensor the kernel never reads (NUM_HIDDEN says so).
        slots = group + [ids.view(-1, 1)] * (HIDDEN_PER_LAUNCH - len(group))
        _move_path_rows_kernel[(num_reqs, triton.cdiv(width, block))](
            *slots,
            ids,
            positions,
            root,
            accepted,
            num_accepted,
            num_draft,
            *(t.stride(0) for t in slots),
            accepted.stride(0),
            width,
            NUM_HIDDEN=len(group),
            WITH_IDS=index == 0,
            MAX_DEPTH=max(path_len - 1, 0),
            BLOCK=block,
            POSITIONS_BLOCK=triton.next_power_of_2(max_nodes + 1),
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
