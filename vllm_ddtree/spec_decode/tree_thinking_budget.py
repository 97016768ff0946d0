"""``thinking_token_budget`` on a step's logits rows (V1 runner), trees or not.

vLLM's ``ThinkingBudgetStateHolder`` counts a request's thinking tokens (those after the
reasoning start marker) and, once the request's budget is spent, forces the reasoning end
marker token by token: its logit becomes 1e9. Target-alone decoding updates a request's state
once per position with the tokens before it, so the state at a position depends on those
tokens only. Here each logits row gets the state target-alone decoding has at the row's
position:

* a request's root row: its state after its outputs, kept between steps and advanced once per
  token committed since (``TreeThinkingBudget.root_state``);
* a tree node's row: its parent's state advanced once with the node's path
  (``tree_row_outputs``), so each node counts its own path's thinking tokens.

The states and the forcing are vLLM's own: a holder of vLLM's in non-speculative mode (one row
per position) advances them and applies them to the rows (``apply_to_logits``). vLLM's holder
of the input batch, made for a chain, only tells which requests have a budget and the markers;
the DDTree sampler hides it from vLLM's sampler (``without_thinking_budget``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from vllm_ddtree.spec_decode.tree_logits_processors import tree_row_outputs


@dataclasses.dataclass
class BudgetedRequest:
    """One request of the step with a ``thinking_token_budget``."""

    index: int  # its batch row (request index in the step)
    req_id: str
    prompt_token_ids: list[int] | None
    thinking_token_budget: int


class TreeThinkingBudget:
    """Per worker: each budgeted request's committed thinking state, and the forcing of the
    end marker on a step's rows."""

    def __init__(self, start_token_ids: list[int], end_token_ids: list[int]):
        from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

        markers = SimpleNamespace(
            reasoning_start_token_ids=list(start_token_ids),
            reasoning_end_token_ids=list(end_token_ids),
        )
        # Non-speculative: one logits row per state, each state advanced one position a call;
        # its row capacity is only a bound checked against the rows (the logits bound them).
        self._holder = ThinkingBudgetStateHolder(
            markers, 1 << 30, 0, torch.device("cpu"), is_pin_memory=False
        )
        # req_id -> (its state after `length` outputs, length, its budget)
        self._committed: dict[str, tuple[dict[str, Any], int, int]] = {}

    def _advance(self, state: dict[str, Any], tokens_before: list[int]) -> dict[str, Any]:
        """``state`` updated for the next position, ``tokens_before`` the outputs before it
        (a new state; ``state`` is kept)."""
        self._holder._state = {0: dict(state)}
        self._holder.update_state([tokens_before], None)
        advanced = self._holder._state[0]
        self._holder._state = {}
        return advanced

    def root_state(self, request: BudgetedRequest, outputs: list[int]) -> dict[str, Any]:
        """The request's state at the position after ``outputs``: the one kept from its last
        step, advanced once per token committed since (from its prompt when new, preempted
        back or given another budget)."""
        held = self._committed.get(request.req_id)
        if held is None or held[1] > len(outputs) or held[2] != request.thinking_token_budget:
            state = self._holder._init_state_entry(
                request.prompt_token_ids, request.thinking_token_budget
            )
            done = -1
        else:
            state, done, _ = held
        for length in range(done + 1, len(outputs) + 1):
            state = self._advance(state, outputs[:length])
        self._committed[request.req_id] = (state, len(outputs), request.thinking_token_budget)
        return state

    def retain(self, live_req_ids) -> None:
        """Forget the requests not in ``live_req_ids`` (finished or aborted)."""
        for req_id in [r for r in self._committed if r not in live_req_ids]:
            del self._committed[req_id]

    def apply(
        self,
        logits: torch.Tensor,
        requests: list[BudgetedRequest],
        outputs: list[list[int]],
        token_ids: list[list[int]] | None,
        parents: list[list[int]] | None,
        num_draft: list[int],
    ) -> torch.Tensor:
        """``logits`` ``[rows, V]`` (each request's root row, then its ``num_draft[r]`` nodes
        in tree order; changed in place and returned) with the end marker forced on every row
        whose state says so. ``outputs``: each request's committed output tokens;
        ``token_ids`` / ``parents``: its nodes (``tree_row_outputs``; None when no request
        has a tree)."""
        first_row = [0]
        for n in num_draft:
            first_row.append(first_row[-1] + 1 + n)
        states: dict[int, dict[str, Any]] = {}
        for request in requests:
            r = request.index
            state = self.root_state(request, outputs[r])
            states[first_row[r]] = state
            if not num_draft[r]:
                continue
            row_tokens = tree_row_outputs(
                [outputs[r]], [token_ids[r]], [parents[r]], [num_draft[r]]
            )
            node_states = [state]
            for i in range(num_draft[r]):
                parent = parents[r][i]
                base = node_states[parent] if 0 <= parent <= i else state
                node_states.append(self._advance(base, row_tokens[i + 1]))
                states[first_row[r] + 1 + i] = node_states[-1]
        if not states:
            return logits
        self._holder._state = states
        try:
            return self._holder.apply_to_logits(logits, False, None)
        finally:
            self._holder._state = {}


def budgeted_requests(input_batch, requests, num_reqs: int) -> list[BudgetedRequest]:
    """The step's requests with a ``thinking_token_budget`` (V1 runner: its persistent
    ``input_batch`` and ``requests`` by id)."""
    found = []
    for index, req_id in enumerate(input_batch.req_ids[:num_reqs]):
        request = requests.get(req_id)
        params = getattr(request, "sampling_params", None)
        budget = getattr(params, "thinking_token_budget", None)
        if budget is not None:
            prompt = request.prompt_token_ids
            found.append(BudgetedRequest(index, req_id, prompt, budget))
    return found


def without_thinking_budget(sampling_metadata):
    """``sampling_metadata`` without vLLM's chain holder, for vLLM's sampler in a DDTree step
    (its thinking budget is applied here instead)."""
    if getattr(sampling_metadata, "thinking_budget_state_holder", None) is None:
        return sampling_metadata
    return dataclasses.replace(sampling_metadata, thinking_budget_state_holder=None)
