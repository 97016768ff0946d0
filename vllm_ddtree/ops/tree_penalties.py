"""Presence, frequency and repetition penalties on a tree step's rows: Triton kernel, launcher
and PyTorch reference.

vLLM's V2 sampler penalises a chain's ``k``-th row with the request's output counts plus its
``k`` drafts (``PenaltiesState``). A tree row continues its own path, so its counts are the
request's output counts (``output_bin_counts``, the root's token included) plus its path tokens
(``path_tokens.py``). The arithmetic is vLLM's, in the same order and float32, so each row's
logits are bit for bit the ones target-alone decoding penalises at that point:

* repetition ``p`` on tokens of the prompt or the counts: a positive logit divided by ``p``
  (times ``1 / p``), another multiplied by ``p``;
* frequency ``f``: minus ``f`` times the count; presence ``q``: minus ``q`` where counted.

Rows of requests without penalties are left untouched.

Shapes: ``logits`` ``[rows, V]`` (changed in place), ``row_state`` int ``[rows]`` (each row's
request state), ``path_tokens`` long ``[rows, L]``; vLLM's state: ``repetition`` /
``frequency`` / ``presence`` float32 ``[S]``, ``prompt_bin_mask`` int32 ``[S, ceil(V / 32)]``
(bit-packed prompt tokens), ``output_bin_counts`` int32 ``[S, V]``.
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


def unpack_token_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[n, vocab_size]`` from int32 words ``[n, W]`` (bit ``t % 32`` of word
    ``t // 32``)."""
    bits = torch.arange(32, device=words.device, dtype=words.dtype)
    unpacked = (words.unsqueeze(-1) >> bits) & 1
    return unpacked.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def apply_tree_penalties_ref(
    logits: torch.Tensor,
    row_state: torch.Tensor,
    path_tokens: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    prompt_bin_mask: torch.Tensor,
    output_bin_counts: torch.Tensor,
) -> None:
    """PyTorch reference (one host read of the rows that have penalties)."""
    state = row_state.long()
    rep, freq, pres = repetition[state], frequency[state], presence[state]
    rows = ((rep != 1.0) | (freq != 0.0) | (pres != 0.0)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    state = state[rows]
    rep, freq, pres = rep[rows].unsqueeze(1), freq[rows].unsqueeze(1), pres[rows].unsqueeze(1)
    counts = output_bin_counts[state].clone()
    path = path_tokens[rows].long()
    counts.scatter_add_(1, path.clamp(min=0), (path >= 0).to(counts.dtype))
    seen = counts > 0
    x = logits[rows].to(torch.float32)
    in_prompt = unpack_token_bits(prompt_bin_mask[state], logits.shape[1])
    scale = torch.where(in_prompt | seen, rep, torch.ones_like(rep))
    x = torch.where(rep != 1.0, x * torch.where(x > 0, 1.0 / scale, scale), x)
    x = x - freq * counts
    x = x - pres * seen
    logits[rows] = x.to(logits.dtype)


if HAS_TRITON:

    @triton.jit
    def _tree_penalties_kernel(
        logits_ptr,
        logits_stride,
        row_state_ptr,
        path_ptr,
        path_stride,
        repetition_ptr,
        frequency_ptr,
        presence_ptr,
        prompt_mask_ptr,
        prompt_mask_stride,
        counts_ptr,
        counts_stride,
        vocab_size,
        DEPTH: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        state = tl.load(row_state_ptr + row).to(tl.int64)
        rep = tl.load(repetition_ptr + state)
        freq = tl.load(frequency_ptr + state)
        pres = tl.load(presence_ptr + state)
        if (rep == 1.0) & (freq == 0.0) & (pres == 0.0):
            return
        block = tl.program_id(1)
        cols = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_vocab = cols < vocab_size
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=in_vocab).to(tl.float32)
        counts = tl.load(counts_ptr + state * counts_stride + cols, mask=in_vocab, other=0)
        for k in tl.static_range(DEPTH):  # the row's path tokens (-1 matches nothing)
            token = tl.load(path_ptr + row * path_stride + k)
            counts += (cols == token).to(tl.int32)
        seen = counts > 0
        if rep != 1.0:
            words = block * (BLOCK_SIZE // 32) + tl.arange(0, BLOCK_SIZE // 32)
            packed = tl.load(
                prompt_mask_ptr + state * prompt_mask_stride + words,
                mask=words < tl.cdiv(vocab_size, 32),
                other=0,
            )
            in_prompt = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1
            in_prompt = tl.reshape(in_prompt.to(tl.int1), (BLOCK_SIZE,))
            scale = tl.where(in_prompt | seen, rep, 1.0)
            x *= tl.where(x > 0, 1.0 / scale, scale)
        x -= freq * counts
        x -= pres * seen
        tl.store(logits_ptr + row * logits_stride + cols, x, mask=in_vocab)


def apply_tree_penalties_triton(
    logits: torch.Tensor,
    row_state: torch.Tensor,
    path_tokens: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    prompt_bin_mask: torch.Tensor,
    output_bin_counts: torch.Tensor,
) -> None:
    """Launcher: one program per row and block of 8192 vocabulary entries."""
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    block_size = 8192
    path_tokens = path_tokens.contiguous()
    _tree_penalties_kernel[(num_rows, triton.cdiv(vocab_size, block_size))](
        logits,
        logits.stride(0),
        row_state,
        path_tokens,
        path_tokens.stride(0),
        repetition,
        frequency,
        presence,
        prompt_bin_mask,
        prompt_bin_mask.stride(0),
        output_bin_counts,
        output_bin_counts.stride(0),
        vocab_size,
        DEPTH=path_tokens.shape[1],
        BLOCK_SIZE=block_size,
    )


def apply_tree_penalties(logits: torch.Tensor, *args) -> None:
    """``apply_tree_penalties_triton`` on CUDA, ``apply_tree_penalties_ref`` elsewhere (same
    arguments)."""
    if use_triton(logits.device):
        apply_tree_penalties_triton(logits, *args)
    else:
        apply_tree_penalties_ref(logits, *args)
