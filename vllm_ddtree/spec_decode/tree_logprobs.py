"""Logprobs of the tokens a tree step emits, in the layout vLLM's V1 runner reads.

vLLM's V1 runner reads a speculative step's logprobs as ``R x W`` rows (``W``: the width of
the sampled tokens), row ``(r, j)`` belonging to request ``r``'s ``j``-th emitted token, and
keeps the rows whose token is not -1 (``RejectionSampler.parse_output``). A chain's token
``j`` is chosen at logits row ``start[r] + j``; a tree's at the row of the ``j``-th node of the
accepted path (the root first, the bonus token at the last accepted node), so those rows are
gathered. The logprobs are vLLM's "raw" ones (``config.TREE_LOGPROBS_MODES``; the processed
modes are refused per request): of the target's logits
before temperature, top-k / top-p and ``min_tokens`` (whose stop-token ban the caller undoes
first), as vLLM's sampler reports them for the target alone.
"""

from __future__ import annotations

import torch


def raw_logprobs(sampler, logits: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, V]`` in vLLM ``sampler``'s logprobs mode: its ``compute_logprobs`` of
    ``logits`` (``raw_logprobs``) or the logits themselves (``raw_logits``), a new tensor
    either way."""
    if sampler.logprobs_mode == "raw_logits":
        return logits.to(torch.float32, copy=True)
    return sampler.compute_logprobs(logits)


def path_logit_rows(
    first_row: torch.Tensor, accepted: torch.Tensor, num_accepted: torch.Tensor, width: int
) -> torch.Tensor:
    """long ``[R * width]``: for request ``r``'s ``j``-th emitted token the logits row it was
    chosen at, ``first_row[r] + accepted[r, j]`` for ``j <= num_accepted[r]`` (``accepted``:
    tree indices, root first, -1 past the path); the root's row past the path."""
    num_reqs, path_width = accepted.shape
    node = torch.zeros((num_reqs, width), dtype=torch.long, device=accepted.device)
    shared = min(width, path_width)
    node[:, :shared] = accepted[:, :shared].long().clamp(min=0)
    j = torch.arange(width, device=accepted.device).unsqueeze(0)
    node = torch.where(j <= num_accepted.long().unsqueeze(1), node, 0)
    return (first_row.long().unsqueeze(1) + node).flatten()


def tree_step_logprobs(
    sampler,
    logits: torch.Tensor,
    first_row: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    sampled: torch.Tensor,
    max_num_logprobs: int,
):
    """vLLM's ``LogprobsTensors`` of a tree step: ``R x W`` rows (``sampled`` ``[R, W]``: the
    emitted tokens, then -1), each the top ``max_num_logprobs`` and the emitted token's
    logprob and rank at the logits row that chose it (``path_logit_rows``)."""
    width = sampled.shape[1]
    rows = path_logit_rows(first_row, accepted, num_accepted, width)
    logprobs = raw_logprobs(sampler, logits.index_select(0, rows))
    tokens = sampled.reshape(-1).long().clamp(min=0)  # -1 past the path: filtered by vLLM
    return sampler.gather_logprobs(logprobs, max_num_logprobs, tokens)
