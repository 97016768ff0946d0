"""GatedDeltaNet state commit after a tree walk: Triton kernel, launcher, PyTorch reference.

A hybrid target's verify wrote every tree node's SSM state to its own block (vLLM's
speculative layout: node ``t`` of speculative row ``s`` at ``ssm_blocks[s, t]``) and kept the
conv inputs of every node (``inputs[s, t]``). After the walk accepts the path
``accepted[r, 0..num_accepted[r]]`` (tree indices, root first) of batch row ``r``, vLLM's next
step reads the SSM state from block ``ssm_blocks[s, num_accepted]`` and the conv window from
the first ``K - 1`` columns of block ``conv_blocks[s]``, so in every GDN layer:

* ``ssm_state[ssm_blocks[s, n]] = ssm_state[ssm_blocks[s, accepted[r, n]]]``, ``n =
  num_accepted[r]`` (no copy where the accepted leaf is node ``n`` itself, a chain-shaped path);
* the window's columns become the newest ``K - 1`` of (old window, the path's inputs), oldest
  first, as vLLM's conv kernels read them.

Speculative rows are the batch rows with drafts (``num_draft[r] > 0``), in batch order. The
kernel commits every GDN layer in one launch (``GDNStateLayers`` holds their base addresses);
the eager alternative, a dozen PyTorch ops per layer, took some 600 launches a step on a
48-layer hybrid. Shapes: ``ssm_state`` ``[blocks, Hv, V, K]`` and ``conv_state`` ``[blocks, C,
K - 1 + B]`` (any strides), ``ssm_blocks`` int32 ``[rows, T]`` and ``conv_blocks`` int32
``[rows]`` (contiguous), ``inputs`` ``[rows, T, C]`` (contiguous); ``accepted`` long ``[R, L +
1]`` (``-1`` padded), ``num_accepted`` and ``num_draft`` long ``[R]``.
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
    buffers (``ssm_blocks``, ``conv_blocks``, ``inputs``), and ``window`` (``K - 1``, one for
    all). ``pointers`` int64 ``[5, L]`` on the device holds their base addresses for one
    launch, or is None where the layers' layouts differ (the reference then commits them)."""

    ssm_states: tuple[torch.Tensor, ...]
    ssm_blocks: tuple[torch.Tensor, ...]
    conv_states: tuple[torch.Tensor, ...]
    conv_blocks: tuple[torch.Tensor, ...]
    inputs: tuple[torch.Tensor, ...]
    window: int
    pointers: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.ssm_states)

    @classmethod
    def of(cls, ssm_states, ssm_blocks, conv_states, conv_blocks, inputs, window: int):
        """The table of these per-layer tensors (lists of equal length); ``pointers`` only
        where every layer shares each tensor's shape, strides and dtype."""
        groups = [tuple(t) for t in (ssm_states, ssm_blocks, conv_states, conv_blocks, inputs)]
        if len({len(g) for g in groups}) != 1:
            raise ValueError("every GDN layer needs all five tensors")
        uniform = bool(groups[0]) and all(
            all(
                t.shape == g[0].shape and t.stride() == g[0].stride() and t.dtype == g[0].dtype
                for t in g
            )
            for g in groups
        )
        # The step's buffers: contiguous, the block tables int32.
        buffers = (*groups[1], *groups[3], *groups[4])
        uniform = uniform and all(t.is_contiguous() for t in buffers)
        uniform = uniform and all(t.dtype == torch.int32 for t in (*groups[1], *groups[3]))
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


def conv_window_sources(
    path: torch.Tensor, path_len: torch.Tensor, kept: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each of the ``kept`` (``K - 1``) committed conv columns comes from, per row: bool
    ``[rows, kept]`` whether from the accepted path, long ``[rows, kept]`` the path node (tree
    index) it is then, and long ``[rows, kept]`` the old window's column otherwise. ``path``
    long ``[rows, L + 1]`` (tree indices, root first), ``path_len`` long ``[rows]`` (root and
    accepted nodes). Column ``c`` holds the input ``kept - c`` back from the newest."""
    back = kept - torch.arange(kept, device=path.device)  # 1 = the newest input
    from_path = back.unsqueeze(0) <= path_len.unsqueeze(1)
    node = path.gather(1, (path_len.unsqueeze(1) - back.unsqueeze(0)).clamp(min=0))
    old_column = (kept - (back.unsqueeze(0) - path_len.unsqueeze(1))).clamp(0, kept - 1)
    return from_path, node, old_column


def commit_gdn_states_ref(
    layers: GDNStateLayers,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
) -> None:
    """PyTorch commit (the CPU path, and the kernel's reference): a few ops per layer, each
    reading all it needs before writing."""
    if layers.num_layers == 0 or accepted.shape[0] == 0:
        return
    spare = layers.ssm_blocks[0].shape[0] - 1
    rows, has = speculative_rows(num_draft, spare)
    path = accepted.clamp(min=0)
    taken = num_accepted.long()
    # Each row's (accepted leaf, last accepted) tree indices, and the conv columns' sources.
    leaf_and_taken = torch.cat([path.gather(1, taken.unsqueeze(1)), taken.unsqueeze(1)], 1)
    from_path, node, old_column = conv_window_sources(path, taken + 1, layers.window)
    for ssm_state, ssm_blocks, conv_state, conv_blocks, inputs in zip(
        layers.ssm_states,
        layers.ssm_blocks,
        layers.conv_states,
        layers.conv_blocks,
        layers.inputs,
        strict=True,
    ):
        # [R, 2]: the accepted leaf's state block, then block [s, num_accepted].
        pair = ssm_blocks[rows].long().gather(1, leaf_and_taken)
        pair = torch.where(has.unsqueeze(1), pair, NULL_BLOCK)
        ssm_state.index_copy_(0, pair[:, 1], ssm_state.index_select(0, pair[:, 0]))
        kept = layers.window
        blocks = torch.where(has, conv_blocks[rows].long(), NULL_BLOCK)
        channels = inputs.shape[-1]
        old = conv_state[blocks, :, :kept]  # [R, C, K - 1], read before any write
        x_val = inputs[rows].gather(1, node.unsqueeze(2).expand(-1, -1, channels))
        h_val = old.gather(2, old_column.unsqueeze(1).expand(-1, channels, -1))
        new = torch.where(from_path.unsqueeze(1), x_val.transpose(1, 2).to(old.dtype), h_val)
        conv_state[blocks, :, :kept] = new


if HAS_TRITON:

    @triton.jit
    def _commit_gdn_states_kernel(
        pointers_ptr,
        accepted_ptr,
        num_accepted_ptr,
        num_draft_ptr,
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
        HEAD_V: tl.constexpr,
        HEAD_K: tl.constexpr,
        SSM_SIZE: tl.constexpr,
        SSM_CHUNKS: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
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
                if src != dst:
                    offs = chunk * BLOCK + tl.arange(0, BLOCK)
                    inside = offs < SSM_SIZE
                    head = offs // (HEAD_V * HEAD_K)
                    v = (offs // HEAD_K) % HEAD_V
                    k = offs % HEAD_K
                    at = head * stride_ssm_h + v * stride_ssm_v + k * stride_ssm_k
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
                block = tl.load(conv_blocks + row).to(tl.int64)
                channel = (chunk - SSM_CHUNKS) * BLOCK + tl.arange(0, BLOCK)
                inside = channel < CHANNELS
                window = conv + block * stride_conv_blk + channel * stride_conv_c
                path_len = taken + 1  # the root and the accepted nodes
                # Column c <- the input KEPT - c back from the newest. Increasing c reads each
                # old column (c + path_len) before this thread writes it.
                for c in tl.static_range(KEPT):
                    back = KEPT - c
                    if back <= path_len:
                        node = tl.load(accepted_ptr + req * stride_accepted + path_len - back)
                        at = inputs + (row * TOKENS + node) * CHANNELS + channel
                        value = tl.load(at, mask=inside).to(CONV_DTYPE)
                    else:
                        value = tl.load(window + (c + path_len) * stride_conv_w, mask=inside)
                    tl.store(window + c * stride_conv_w, value, mask=inside)


def commit_gdn_states(
    layers: GDNStateLayers,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
    block: int = 2048,
) -> None:
    """Commit the accepted paths into every GDN layer's caches, in place: one launch of ``R x
    layers x (SSM chunks + conv chunks)`` programs (the reference where ``layers.pointers`` is
    None)."""
    num_reqs = accepted.shape[0]
    if layers.num_layers == 0 or num_reqs == 0:
        return
    if layers.pointers is None:
        commit_gdn_states_ref(layers, accepted, num_accepted, num_draft)
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
        HEAD_V=head_v,
        HEAD_K=head_k,
        SSM_SIZE=ssm_size,
        SSM_CHUNKS=ssm_chunks,
        BLOCK=block,
        BLOCK_ROWS=triton.next_power_of_2(num_reqs),
    )
