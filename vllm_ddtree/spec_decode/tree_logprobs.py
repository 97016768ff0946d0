"""Logprobs of the tokens a tree step emits, in the layouts vLLM's V1 and V2 runners read.

vLLM's V1 runner reads a speculative step's logprobs as ``R x W`` rows (``W``: the width of
the sampled tokens), row ``(r, j)`` belonging to request ``r``'s ``j``-th emitted token, and
keeps the rows whose token is not -1 (``RejectionSampler.parse_output``); its V2 runner reads
one row per logits row and keeps each request's first ``num_sampled``
(``tree_step_logprobs_v2``). A chain's token ``j`` is chosen at logits row ``start[r] + j``; a
tree's at the row of the ``j``-th node of the accepted path (the root first, the bonus token at
the last accepted node), so those rows are gathered. Each runner reports them in vLLM's
``logprobs_mode``, as its sampler does for the target alone: raw (the target's logits before
the sampling parameters; on V1 the caller undoes ``min_tokens``' stop-token ban first) or
processed (V1: after the logits processors and, in a batch that samples, temperature and top-k
/ top-p; V2: vLLM's own sampler's).
"""

from __future__ import annotations

import torch


def processed_logprobs_mode(sampler) -> bool:
    """Whether vLLM ``sampler`` reports logprobs of the processed logits (after the sampling
    parameters) rather than of the raw ones."""
    return sampler.logprobs_mode in ("processed_logprobs", "processed_logits")


def mode_logprobs(sampler, logits: torch.Tensor) -> torch.Tensor:
    """float32 ``[rows, V]`` in vLLM ``sampler``'s logprobs mode: its ``compute_logprobs`` of
    ``logits`` (``*_logprobs``) or the logits themselves (``*_logits``), a new tensor either
    way. ``logits``: the raw or the processed ones, as the mode says."""
    if sampler.logprobs_mode.endswith("_logits"):
        return logits.to(torch.float32, copy=True)
    return sampler.compute_logprobs(logits)


def asks_for_logprobs(sampling_metadata) -> bool:
    """Whether a V1 batch asks for logprobs: top-k (``max_num_logprobs``) or labels
    (``logprob_token_ids``)."""
    return sampling_metadata.max_num_logprobs is not None or bool(
        sampling_metadata.logprob_token_ids
    )


def gather_step_logprobs(
    sampler, scores: torch.Tensor, tokens: torch.Tensor, sampling_metadata, width: int = 1
):
    """vLLM's V1 ``LogprobsTensors`` of emitted tokens, chosen as its sampler chooses: where
    any request of the batch gave ``logprob_token_ids``, every row gets the emitted token and
    its request's labels (``gather_specific_token_logprobs``), else the top
    ``max_num_logprobs``. ``scores`` ``[R * width, V]`` (request ``r``'s rows ``r * width``
    onwards) in the sampler's logprobs mode; ``tokens`` long ``[R * width]``."""
    labels = sampling_metadata.logprob_token_ids
    if labels:
        by_row = {r * width + j: ids for r, ids in labels.items() for j in range(width)}
        return sampler.gather_specific_token_logprobs(scores, by_row, tokens)
    return sampler.gather_logprobs(scores, sampling_metadata.max_num_logprobs, tokens)


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
    sampling_metadata,
):
    """vLLM's ``LogprobsTensors`` of a tree step: ``R x W`` rows (``sampled`` ``[R, W]``: the
    emitted tokens, then -1), each the emitted token's logprob and rank with the top
    ``max_num_logprobs`` or the request's labels (``gather_step_logprobs``) at the logits row
    that chose it (``path_logit_rows``)."""
    width = sampled.shape[1]
    rows = path_logit_rows(first_row, accepted, num_accepted, width)
    logprobs = mode_logprobs(sampler, logits.index_select(0, rows))
    tokens = sampled.reshape(-1).long().clamp(min=0)  # -1 past the path: filtered by vLLM
    return gather_step_logprobs(sampler, logprobs, tokens, sampling_metadata, width)


def emitted_logit_rows(
    first_row: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    requests: torch.Tensor,
    local: torch.Tensor,
) -> torch.Tensor:
    """V2 layout: long ``[rows]``, for each logits row (request ``requests[t]``, its
    ``local[t]``-th) the row that chose the request's ``local[t]``-th emitted token,
    ``first_row[r] + accepted[r, j]`` while ``j <= num_accepted[r]``; the request's root row
    past its path (read by nobody: vLLM keeps the first ``num_sampled`` rows)."""
    on_path = local <= num_accepted.long()[requests]
    node = accepted.long()[requests, local.clamp(max=accepted.shape[1] - 1)].clamp(min=0)
    return first_row.long()[requests] + torch.where(on_path, node, 0)


def tree_step_logprobs_v2(
    sampler,
    logits: torch.Tensor,
    processed_logits: torch.Tensor,
    input_batch,
    requests: torch.Tensor,
    local: torch.Tensor,
    first_row: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    sampled: torch.Tensor,
):
    """vLLM's V2 ``LogprobsTensors`` of a tree step, or None when no request asked.

    vLLM's V2 runner reads a speculative step's logprobs one row per logits row, request
    ``r``'s ``j``-th emitted token at row ``cu_num_logits[r] + j`` (``num_sampled[r]`` of
    them). Here row ``cu_num_logits[r] + j`` holds the scores of the row that chose that token
    (``emitted_logit_rows``), computed as vLLM's sampler computes a target-alone step's: in its
    ``logprobs_mode`` (raw: ``logits`` as the model gave them, the grammar bitmask applied;
    processed: ``processed_logits`` after every sampling parameter), its top ``logprobs`` and
    each request's own ``logprob_token_ids``. ``requests``, ``local`` long ``[rows]``: each
    logits row's request and its place among that request's rows (``ops/path_tokens.row_layout``);
    ``sampled`` ``[R, W]``: the emitted tokens, then -1.
    """
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    idx_mapping_np = input_batch.idx_mapping_np
    if not sampler.returns_logprobs(idx_mapping_np):
        return None
    scored = processed_logits if processed_logprobs_mode(sampler) else logits
    num_rows = scored.shape[0]
    rows = emitted_logit_rows(first_row, accepted, num_accepted, requests, local)
    column = local.clamp(max=sampled.shape[1] - 1)
    tokens = sampled.long()[requests, column].clamp(min=0)
    max_num_logprobs = sampler.sampling_states.max_num_logprobs(idx_mapping_np)
    max_per_req_token_ids = sampler.logprob_token_ids_state.max_num_token_ids(idx_mapping_np)
    expanded = num_rows != idx_mapping_np.shape[0]
    return compute_topk_scores(
        scored.index_select(0, rows),
        max_num_logprobs if max_num_logprobs != NO_LOGPROBS else 0,
        tokens,
        input_batch.cu_num_logits_np.tolist() if expanded else None,
        logprob_token_ids_state=sampler.logprob_token_ids_state,
        expanded_idx_mapping=input_batch.expanded_idx_mapping,
        max_per_req_token_ids=max_per_req_token_ids,
        logits_mode=sampler.logprobs_mode.endswith("_logits"),
    )
