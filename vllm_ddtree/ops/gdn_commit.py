"""GatedDeltaNet state commit after a tree walk: Triton kernel, launcher, PyTorch reference.

A hybrid target's verify wrote every tree node's SSM state to its own block (vLLM's
speculative layout: node ``t`` of speculative row ``s`` at ``ssm_blocks[s, t]``) and kept the
conv inputs of every node (``inputs[s, t]``). After the walk accepts the path
``accepted[r, 0..n]`` (tree indices, root first; ``n = num_accepted[r]``) of batch row ``r``,
the commit leaves the caches as vLLM's own chain step would have left them had it verified
that path as a chain, in the places vLLM reads:

* SSM: block ``ssm_blocks[s, n]`` gets the accepted leaf's state (where vLLM's next step
  starts, ``num_accepted_tokens - 1``), and with prefix caching (vLLM's ``align`` layout) a row
  whose path crosses a block boundary at depth ``d = boundary[r]`` also gets path node
  ``accepted[r, d]``'s state in block ``ssm_blocks[s, d]``, from where vLLM copies it into the
  boundary's cached block. Nothing is copied where the node is already there (a chain).
* Conv: the row's conv block holds, from column 0, the last ``K - 2`` inputs of the window the
  step read (from column ``conv_offsets[s]``), then the inputs of the path's nodes, root
  first, as vLLM's chain kernel leaves it: the window after path depth ``j`` is then at columns
  ``j .. j + K - 2``, where vLLM reads it (``num_accepted_tokens - 1`` next step; the boundary's
  depth in the ``align`` copies).

Speculative rows are the batch rows with drafts (``num_draft[r] > 0``), in batch order. The
kernel commits every GDN layer in one launch (``GDNStateLayers`` holds their base addresses);
the eager alternative, a dozen PyTorch ops per layer, took some 600 launches a step on a
48-layer hybrid. Shapes: ``ssm_state`` ``[blocks, Hv, V, K]`` and ``conv_state`` ``[blocks, C,
K - 1 + B]`` (any strides), ``ssm_blocks`` int32 ``[rows, T]``, ``conv_blocks`` and
``conv_offsets`` int32 ``[rows]`` (contiguous), ``inputs`` ``[rows, T, C]`` (contiguous);
``accepted`` long ``[R, L + 1]`` (``-1`` padded), ``num_accepted``, ``num_draft`` and
``boundary`` long ``[R]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.ops import triton_dtype

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

NULL_BLOCK = 0  # vLLM's reserved block: writes there are harmless


@dataclass(frozen=True)
class GDNStateLayers:
    """The GDN layers a commit updates: per layer its SSM cache, conv cache and the step's
    buffers (``ssm_blocks``, ``conv_blocks``, ``inputs``, ``conv_offsets``), and ``window``
    (``K - 1``, one for all). ``pointers`` int64 ``[6, L]`` on the device holds their base
    addresses for one launch, or is None where the layers' layouts differ (the reference then
    commits them)."""

    ssm_states: tuple[torch.Tensor, ...]
    ssm_blocks: tuple[torch.Tensor, ...]
    conv_states: tuple[torch.Tensor, ...]
    conv_blocks: tuple[torch.Tensor, ...]
    inputs: tuple[torch.Tensor, ...]
    conv_offsets: tuple[torch.Tensor, ...]
    window: int
    pointers: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.ssm_states)

    @classmethod
    def of(
        cls, ssm_states, ssm_blocks, conv_states, conv_blocks, inputs, conv_offsets, window: int
    ):
        """The table of these per-layer tensors (lists of equal length); ``pointers`` only
        where every layer shares each tensor's shape, strides and dtype."""
        tensors = (ssm_states, ssm_blocks, conv_states, conv_blocks, inputs, conv_offsets)
        groups = [tuple(t) for t in tensors]
        if len({len(g) for g in groups}) != 1:
            raise ValueError("every GDN layer needs all six tensors")
        uniform = bool(groups[0]) and all(
            all(
                t.shape == g[0].shape and t.stride() == g[0].stride() and t.dtype == g[0].dtype
                for t in g
            )
            for g in groups
        )
        # The step's buffers: contiguous, the block tables and offsets int32.
        buffers = (*groups[1], *groups[3], *groups[4], *groups[5])
        uniform = uniform and all(t.is_contiguous() for t in buffers)
        indices = (*groups[1], *groups[3], *groups[5])
        uniform = uniform and all(t.dtype == torch.int32 for t in indices)
        pointers = None
        if uniform:
            device = groups[0][0].device
            table = [[t.data_ptr() for t in g] for g in groups]
            pointers = torch.tensor(table, dtype=torch.int64).to(device)
        return cls(*groups, window=window, pointers=pointers)


def speculative_rows(num_draft: torch.Tensor, spare: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch row -> speculative row (the rows with drafts, in order; the others -> ``spare``)
    and the with-drafts mask. ``num_draft`` long ``[R]``."""
    has = num_draft > 0
    return torch.where(has, torch.cumsum(has.long(), 0) - 1, spare), has


def path_depths(boundary: torch.Tensor | None, rows: int, device) -> torch.Tensor:
    """Each row's boundary depth (``-1``: none), long ``[rows]``; all ``-1`` when None."""
    if boundary is None:
        return torch.full((rows,), -1, dtype=torch.long, device=device)
    return boundary.long()


def commit_gdn_states_ref(
    layers: GDNStateLayers,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
    boundary: torch.Tensor | None = None,
) -> None:
    """PyTorch commit (the CPU path, and the kernel's reference): a few ops per layer, each
    reading all it needs before writing."""
    num_reqs = accepted.shape[0]
    if layers.num_layers == 0 or num_reqs == 0:
        return
    device = accepted.device
    spare = layers.ssm_blocks[0].shape[0] - 1
    rows, has = speculative_rows(num_draft, spare)
    path = accepted.clamp(min=0)
    taken = num_accepted.long()
    depth = path_depths(boundary, num_reqs, device)
    crossing = has & (depth >= 0)
    # The SSM copies, [R, 2] each: (the accepted leaf, the boundary's path node) -> (column
    # ``taken``, column ``depth``), tree indices.
    columns = torch.stack([taken, depth.clamp(min=0)], 1)
    nodes = path.gather(1, columns)
    wanted = torch.stack([has, crossing], 1)
    # The conv columns: the read window's last K - 2 inputs, then the path's inputs.
    kept = layers.window
    path_len = taken + 1  # the root and the accepted nodes
    conv_width = layers.conv_states[0].shape[-1]
    count = min(kept - 1 + path.shape[1], conv_width)
    column = torch.arange(count, device=device)
    from_old = column < kept - 1
    written = column.unsqueeze(0) < (kept - 1 + path_len).unsqueeze(1)  # [R, count]
    node = path.gather(1, (column - (kept - 1)).clamp(0, path.shape[1] - 1).expand(num_reqs, -1))
    for ssm_state, ssm_blocks, conv_state, conv_blocks, inputs, conv_offsets in zip(
        layers.ssm_states,
        layers.ssm_blocks,
        layers.conv_states,
        layers.conv_blocks,
        layers.inputs,
        layers.conv_offsets,
        strict=True,
    ):
        blocks = ssm_blocks[rows].long()
        src = torch.where(wanted, blocks.gather(1, nodes), NULL_BLOCK).flatten()
        dst = torch.where(wanted, blocks.gather(1, columns), NULL_BLOCK).flatten()
        ssm_state.index_copy_(0, dst, ssm_state.index_select(0, src))
        block = torch.where(has, conv_blocks[rows].long(), NULL_BLOCK)
        old = conv_state[block]  # [R, C, K - 1 + B], read before any write
        channels = old.shape[1]
        old_column = conv_offsets[rows].long().unsqueeze(1) + 1 + column.unsqueeze(0)
        old_column = old_column.clamp(max=conv_width - 1)
        old_val = old.gather(2, old_column.unsqueeze(1).expand(-1, channels, -1))
        x_val = inputs[rows].gather(1, node.unsqueeze(2).expand(-1, -1, channels))
        new = torch.where(from_old, old_val, x_val.transpose(1, 2).to(old.dtype))
        keep = old[:, :, :count]
        conv_state[block, :, :count] = torch.where(written.unsqueeze(1), new, keep)


if HAS_TRITON:

    @triton.jit
    def _commit_gdn_states_kernel(
        pointers_ptr,
        accepted_ptr,
        num_accepted_ptr,
        num_draft_ptr,
        boundary_ptr,
        num_rows,
        num_layers,
        stride_accepted,
        stride_ssm_blk,
        stride_ssm_h,
        stride_ssm_v,
        stride_ssm_k,
        stride_conv_blk,
        stride_conv_c,
        stride_conv_w,
        SSM_DTYPE: tl.constexpr,
        CONV_DTYPE: tl.constexpr,
        INPUT_DTYPE: tl.constexpr,
        TOKENS: tl.constexpr,
        CHANNELS: tl.constexpr,
        KEPT: tl.constexpr,
        PATH: tl.constexpr,
        HEAD_V: tl.constexpr,
        HEAD_K: tl.constexpr,
        SSM_SIZE: tl.constexpr,
        SSM_CHUNKS: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        HAS_BOUNDARY: tl.constexpr,
    ):
        req = tl.program_id(0)
        layer = tl.program_id(1)
        chunk = tl.program_id(2)
        count = tl.load(num_draft_ptr + req)
        if count > 0:
            # This batch row's speculative row: the rows with drafts before it.
            before = tl.arange(0, BLOCK_ROWS)
            drafts = tl.load(num_draft_ptr + before, mask=before < req, other=0)
            row = tl.sum((drafts > 0).to(tl.int32))
            taken = tl.load(num_accepted_ptr + req)
            if chunk < SSM_CHUNKS:
                ssm = tl.load(pointers_ptr + layer).to(tl.pointer_type(SSM_DTYPE))
                blocks = tl.load(pointers_ptr + num_layers + layer).to(tl.pointer_type(tl.int32))
                leaf = tl.load(accepted_ptr + req * stride_accepted + taken)
                src = tl.load(blocks + row * TOKENS + leaf).to(tl.int64)
                dst = tl.load(blocks + row * TOKENS + taken).to(tl.int64)
                offs = chunk * BLOCK + tl.arange(0, BLOCK)
                inside = offs < SSM_SIZE
                head = offs // (HEAD_V * HEAD_K)
                v = (offs // HEAD_K) % HEAD_V
                k = offs % HEAD_K
                at = head * stride_ssm_h + v * stride_ssm_v + k * stride_ssm_k
                depth = tl.full([], -1, tl.int64)
                if HAS_BOUNDARY:
                    depth = tl.load(boundary_ptr + req).to(tl.int64)
                if depth >= 0:
                    # Both states read before either is written: either copy's source can be
                    # the other's destination.
                    node = tl.load(accepted_ptr + req * stride_accepted + depth)
                    src_b = tl.load(blocks + row * TOKENS + node).to(tl.int64)
                    dst_b = tl.load(blocks + row * TOKENS + depth).to(tl.int64)
                    state = tl.load(ssm + src * stride_ssm_blk + at, mask=inside)
                    state_b = tl.load(ssm + src_b * stride_ssm_blk + at, mask=inside)
                    tl.store(ssm + dst * stride_ssm_blk + at, state, mask=inside)
                    tl.store(ssm + dst_b * stride_ssm_blk + at, state_b, mask=inside)
                elif src != dst:
                    state = tl.load(ssm + src * stride_ssm_blk + at, mask=inside)
                    tl.store(ssm + dst * stride_ssm_blk + at, state, mask=inside)
            else:
                conv = tl.load(pointers_ptr + 2 * num_layers + layer).to(
                    tl.pointer_type(CONV_DTYPE)
                )
                conv_blocks = tl.load(pointers_ptr + 3 * num_layers + layer).to(
                    tl.pointer_type(tl.int32)
                )
                inputs = tl.load(pointers_ptr + 4 * num_layers + layer).to(
                    tl.pointer_type(INPUT_DTYPE)
                )
                offsets = tl.load(pointers_ptr + 5 * num_layers + layer).to(
                    tl.pointer_type(tl.int32)
                )
                block = tl.load(conv_blocks + row).to(tl.int64)
                first = tl.load(offsets + row).to(tl.int64)  # the window the step read
                channel = (chunk - SSM_CHUNKS) * BLOCK + tl.arange(0, BLOCK)
                inside = channel < CHANNELS
                window = conv + block * stride_conv_blk + channel * stride_conv_c
                # Columns 0 .. K - 3: the read window's last K - 2 inputs. Column c reads
                # column first + 1 + c > c, which no earlier iteration wrote.
                for c in tl.static_range(KEPT - 1):
                    value = tl.load(window + (first + 1 + c) * stride_conv_w, mask=inside)
                    tl.store(window + c * stride_conv_w, value, mask=inside)
                # Then the path's inputs, root first (``taken + 1`` of the ``PATH`` columns).
                for j in tl.static_range(PATH):
                    on_path = j <= taken
                    node = tl.load(accepted_ptr + req * stride_accepted + j, mask=on_path, other=0)
                    source = inputs + (row * TOKENS + node) * CHANNELS + channel
                    value = tl.load(source, mask=inside & on_path).to(CONV_DTYPE)
                    column = window + (KEPT - 1 + j) * stride_conv_w
                    tl.store(column, value, mask=inside & on_path)


def commit_gdn_states(
    layers: GDNStateLayers,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
    boundary: torch.Tensor | None = None,
    block: int = 2048,
) -> None:
    """Commit the accepted paths into every GDN layer's caches, in place: one launch of ``R x
    layers x (SSM chunks + conv chunks)`` programs (the reference where ``layers.pointers`` is
    None)."""
    num_reqs = accepted.shape[0]
    if layers.num_layers == 0 or num_reqs == 0:
        return
    if layers.pointers is None:
        commit_gdn_states_ref(layers, accepted, num_accepted, num_draft, boundary)
        return
    ssm, conv, inputs = layers.ssm_states[0], layers.conv_states[0], layers.inputs[0]
    num_v_heads, head_v, head_k = ssm.shape[1:]
    ssm_size = num_v_heads * head_v * head_k
    channels = inputs.shape[-1]
    ssm_chunks = triton.cdiv(ssm_size, block)
    grid = (num_reqs, layers.num_layers, ssm_chunks + triton.cdiv(channels, block))
    _commit_gdn_states_kernel[grid](
        layers.pointers,
        accepted,
        num_accepted,
        num_draft,
        boundary if boundary is not None else num_draft,
        num_reqs,
        layers.num_layers,
        accepted.stride(0),
        *ssm.stride(),
        *conv.stride(),
        SSM_DTYPE=triton_dtype(ssm.dtype),
        CONV_DTYPE=triton_dtype(conv.dtype),
        INPUT_DTYPE=triton_dtype(inputs.dtype),
        TOKENS=inputs.shape[1],
        CHANNELS=channels,
        KEPT=layers.window,
        PATH=accepted.shape[1],
        HEAD_V=head_v,
        HEAD_K=head_k,
        SSM_SIZE=ssm_size,
        SSM_CHUNKS=ssm_chunks,
        BLOCK=block,
        BLOCK_ROWS=triton.next_power_of_2(num_reqs),
        HAS_BOUNDARY=boundary is not None,
    )
