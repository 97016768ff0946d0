"""Sampling on a tree's rows, V1 runner: the target's token at every node, as target-alone
decoding would choose it there.

Greedy rows take the argmax. Sampled rows take one keyed Gumbel draw each, keyed by the request's
seed and the row's (depth) position (``ops/keyed_gumbel.py``), after the request's temperature,
top-k and top-p: a node's token is the one target-alone decoding would draw at that position,
whatever tree it sits in (``target_tokens``). ``min_tokens`` bans a request's stop tokens on the
rows whose depth leaves it short (``ban_stop_tokens_before_min_tokens``); a
``thinking_token_budget`` is applied along each row's own path (``thinking_budget_of``,
``tree_thinking_budget.py``). Steps without trees sample the same way
(``sample_without_trees``), so a seeded request's tokens do not depend on which of its steps
carried other requests' trees. The walk that follows is shared with the V2 runner
(``tree_step.walk_tree_step``), whose sampler vLLM keys the same way.
"""

from __future__ import annotations

import torch

from vllm_ddtree.metrics.step_ranges import step_range
from vllm_ddtree.ops.keyed_gumbel import keyed_gumbel_noise
from vllm_ddtree.spec_decode.request_seeds import batch_seeds
from vllm_ddtree.spec_decode.step_state import runner_step_state
from vllm_ddtree.spec_decode.tree_logprobs import (
    asks_for_logprobs,
    gather_step_logprobs,
    mode_logprobs,
    processed_logprobs_mode,
)
from vllm_ddtree.spec_decode.tree_thinking_budget import (
    TreeThinkingBudget,
    budgeted_requests,
    without_thinking_budget,
)
from vllm_ddtree.tree import DDTreeBatch


def thinking_budget_of(runner, num_reqs: int):
    """The step's ``thinking_token_budget`` requests with the worker's ``TreeThinkingBudget``
    (made on first use, from the markers of vLLM's holder), or None when no request of the step
    has a budget."""
    holder = getattr(runner.input_batch, "thinking_budget_state_holder", None)
    if holder is None or not holder.has_tracked_requests():
        return None
    state = runner_step_state(runner)
    if state.thinking_budget is None:
        state.thinking_budget = TreeThinkingBudget(
            holder.think_start_token_ids, holder.think_end_token_ids
        )
    state.thinking_budget.retain(runner.requests)
    requests = budgeted_requests(runner.input_batch, runner.requests, num_reqs)
    return (state.thinking_budget, requests) if requests else None


def target_tokens(logits: torch.Tensor, sampling_metadata, request_of_row, row_seeds_and_keys):
    """long ``[rows]``: argmax, or at each request's temperature, top-k and top-p the Gumbel-max
    sample ``argmax(logits / T + G(seed, key))`` with the request's keyed noise
    (``ops/keyed_gumbel.py``; an exact sample per row, the one target-alone decoding with that
    noise draws at the row's position). ``request_of_row()``: long ``[rows]``, each row's
    request; ``row_seeds_and_keys(request_of_row)``: int64 ``[rows]`` twice, each row's seed
    and key (``seeds_and_keys_of_rows``); both called only when sampling.

    Also returns the rows' processed logits as vLLM's V1 sampler reports them in a processed
    logprobs mode: ``logits`` in a greedy batch; in a batch that samples, every row after
    temperature (1 for greedy rows) and its top-k / top-p."""
    if sampling_metadata.all_greedy:
        return logits.argmax(dim=-1), logits
    rows = request_of_row()
    temperature = sampling_metadata.temperature.index_select(0, rows)
    greedy = temperature <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if sampling_metadata.top_k is not None or sampling_metadata.top_p is not None:
        # vLLM's own top-k / top-p masks, per row at its request's values (after temperature,
        # as vLLM's sampler): each node samples from the target's exact distribution.
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        scaled = apply_top_k_top_p(
            scaled,
            top_k.index_select(0, rows) if top_k is not None else None,
            top_p.index_select(0, rows) if top_p is not None else None,
        )
    # Every row's sample, the greedy rows' argmax put back: no host test of which rows sample
    # (it would wait for the device mid-step).
    seeds, keys = row_seeds_and_keys(rows)
    noise = keyed_gumbel_noise(seeds, keys.unsqueeze(1), logits.shape[-1]).squeeze(1)
    chosen = torch.where(greedy, logits.argmax(dim=-1), (scaled + noise).argmax(dim=-1))
    return chosen, scaled


def ban_stop_tokens_before_min_tokens(
    logits: torch.Tensor, sampling_metadata, trees: DDTreeBatch, first_row, num_draft
) -> None:
    """``min_tokens`` on trees (vLLM's ``MinTokensLogitsProcessor``, which assumes chains):
    at tree index ``i`` of request ``r`` the request has ``len(outputs) + depth(i)`` tokens, so
    its stop tokens get ``-inf`` there while that is below ``min_tokens``. In place on
    ``logits`` ``[rows, V]``; costs nothing unless a request in the batch has ``min_tokens``.
    Returns what puts the banned logits back (for raw logprobs), or None when nothing was."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    entries = []
    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor):
            for req, (min_tokens, outputs, stop_ids) in processor.min_toks.items():
                left = min_tokens - len(outputs)
                entries += [(req, token, left) for token in sorted(stop_ids) if left > 0]
    if not entries:
        return None
    device = logits.device
    req, token, left = (
        torch.tensor(c, dtype=torch.long, device=device) for c in zip(*entries, strict=True)
    )
    num_reqs, width = trees.token_ids.shape
    depth = torch.cat(
        [torch.zeros((num_reqs, 1), dtype=torch.long, device=device), trees.depths.long()], 1
    )
    index = torch.minimum(
        torch.arange(width + 1, device=device).unsqueeze(0), num_draft[req].unsqueeze(1)
    )  # past a request's drafts: its last row again (same depth rule, same value)
    rows = first_row[req].unsqueeze(1) + index  # [P, N + 1]
    banned = depth[req].gather(1, index) < left.unsqueeze(1)
    columns = token.unsqueeze(1).expand_as(rows)
    original = logits[rows, columns]
    logits[rows, columns] = torch.where(banned, float("-inf"), original)

    def undo() -> None:
        logits[rows, columns] = original

    return undo


def seeds_and_keys_of_rows(runner, num_reqs: int):
    """``row_seeds_and_keys`` for ``target_tokens`` in this step: given each logits row's
    request (long ``[rows]``), the row's request seed and its key, the row's position (a tree
    node's depth position), both int64 ``[rows]``."""

    def row_seeds_and_keys(request_of_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = request_of_row.device
        seeds = batch_seeds(runner, num_reqs, device).index_select(0, request_of_row)
        rows = runner_step_state(runner).logits_indices.to(device)
        return seeds, runner.positions.index_select(0, rows).long()

    return row_seeds_and_keys


def sample_without_trees(runner, logits):
    """A DDTree engine's step in which no request verifies a tree (prefills, the first step):
    greedy batches as vLLM samples them; otherwise one keyed sample per request
    (``target_tokens``, after vLLM's ``min_tokens`` processor), as in steps with trees, so a
    seeded request's tokens do not depend on which of its steps carried other requests' trees.
    A ``thinking_token_budget`` is applied as in steps with trees (``tree_thinking_budget``),
    vLLM's chain holder hidden from its sampler. None where vLLM's sampler serves the step."""
    sampling_metadata = runner.input_batch.sampling_metadata
    thinking = thinking_budget_of(runner, logits.shape[0]) if logits is not None else None
    if logits is None or (sampling_metadata.all_greedy and thinking is None):
        return None
    from vllm.v1.outputs import SamplerOutput

    runner.input_batch.update_async_output_token_ids()
    wants_logprobs = asks_for_logprobs(sampling_metadata)
    processed_mode = processed_logprobs_mode(runner.sampler)
    raw = None  # before the processors, as vLLM's sampler reports "raw" logprobs
    if wants_logprobs and not processed_mode:
        raw = mode_logprobs(runner.sampler, logits)
    # vLLM's own: allowed token ids, bad words, min_tokens and the other processors, penalties.
    logits = runner.sampler.apply_logits_processors(
        logits.to(torch.float32),
        without_thinking_budget(sampling_metadata),
        predict_bonus_token=False,
    )
    if thinking is not None:
        budget, requests = thinking
        outputs = sampling_metadata.output_token_ids
        budget.apply(logits, requests, outputs, None, None, [0] * logits.shape[0])
    num_reqs, device = logits.shape[0], logits.device

    def request_of_row() -> torch.Tensor:
        return torch.arange(num_reqs, device=device)

    with step_range("ddtree::target_tokens"):
        keyed_rows = seeds_and_keys_of_rows(runner, num_reqs)
        chosen, processed = target_tokens(logits, sampling_metadata, request_of_row, keyed_rows)
    sampled = chosen.to(torch.int32).view(num_reqs, 1)
    logprobs_tensors = None
    if wants_logprobs:
        scores = mode_logprobs(runner.sampler, processed) if processed_mode else raw
        logprobs_tensors = gather_step_logprobs(
            runner.sampler, scores, chosen.long(), sampling_metadata
        )
    return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)
