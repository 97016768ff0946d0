"""What one request may ask of DDTree, and what the engine core keeps about each request's trees.

A request asks through ``SamplingParams.extra_args`` (the OpenAI server's ``vllm_xargs``):

* ``"tree_budget"``: at most this many tree nodes verified per step for this request, an int in
  1..the engine's ``tree_budget``, or ``"auto"`` (the engine's choice, the default). The
  scheduler schedules that many of the request's draft nodes (``cap_request_budgets``), and the
  model runner cuts the request's tree to the nodes scheduled, as it does for vLLM's
  per-batch-size schedule: the first ``b`` nodes of a best-first tree are the best-first tree
  of budget ``b``, so the request's steps verify the tree an engine of budget ``b`` would.
* ``"ddtree_stats"``: ``true`` returns the request's tree statistics with its final output and
  logs them when it finishes, at INFO (otherwise at DEBUG only): verify steps, tree nodes
  verified (in all and at most in one step), accepted draft tokens and the acceptance length
  (``RequestTreeStats``). They ride in the one field vLLM carries from the engine core to a
  finished request's response, ``kv_transfer_params`` (``RequestOutput.kv_transfer_params``
  offline, ``"kv_transfer_params"`` in the OpenAI server's non-streamed responses), under
  ``"ddtree_stats"``, beside whatever a KV connector put there. A request the front end stops
  (a stop string) finishes without a final engine output: its statistics are in the log only.

Both are checked when vLLM validates the request (``check_ddtree_request``): a bad value is
refused before the request reaches the engine, naming the key and the values allowed. The
scheduler's side (each request's cut and statistics) is ``scheduler_hooks.py``. An
engine where ``"tree_budget": "auto"`` chose vLLM's DFlash chain takes the same options: a
request's ``tree_budget`` (an int >= 1 or ``"auto"``) caps its chain's draft tokens, and its
statistics count the chain's verify steps and say ``"served": "dflash_chain"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_ddtree.config import (
    AUTO_BUDGET,
    DDTreeConfigError,
    check_sampling_params,
    get_ddtree_config,
    serves_chain_for_ddtree,
)

REQUEST_BUDGET_KEY = "tree_budget"
REQUEST_STATS_KEY = "ddtree_stats"
STATS_RESPONSE_KEY = "ddtree_stats"  # in a finished request's kv_transfer_params
# What its engine verified, in a request's returned statistics ("served").
SERVED_TREES, SERVED_CHAIN = "ddtree", "dflash_chain"


def _extra_args(params: Any) -> dict:
    return getattr(params, "extra_args", None) or {}


def request_tree_budget(params: Any, engine_budget: int | None) -> int | None:
    """The nodes per step ``params`` asks for when fewer than ``engine_budget`` (None: the
    engine's budget). ``engine_budget`` None: the engine serves the DFlash chain, whose draft
    tokens any int >= 1 caps. Raises ``DDTreeConfigError`` for a value outside the allowed
    ones."""
    value = _extra_args(params).get(REQUEST_BUDGET_KEY)
    if value is None or value == AUTO_BUDGET:
        return None
    highest = engine_budget if engine_budget is not None else float("inf")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= highest:
        allowed = (
            f"an int in 1..{engine_budget} (this engine's tree_budget)"
            if engine_budget is not None
            else "an int >= 1 (this engine serves the DFlash chain: it caps the draft tokens)"
        )
        raise DDTreeConfigError(
            f"extra_args['{REQUEST_BUDGET_KEY}'] (vllm_xargs) = {value!r}: allowed are "
            f"{allowed} or '{AUTO_BUDGET}'"
        )
    return value if value < highest else None


def wants_tree_stats(params: Any) -> bool:
    """Whether ``params`` asks for its tree statistics (False unset). The OpenAI
    server's ``vllm_xargs`` has no booleans: its JSON ``true`` arrives as 1, so 1 / 0 and
    "true" / "false" are read as the booleans."""
    value = _extra_args(params).get(REQUEST_STATS_KEY, False)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if type(value) in (bool, int) and value in (0, 1):
        return bool(value)
    raise DDTreeConfigError(
        f"extra_args['{REQUEST_STATS_KEY}'] (vllm_xargs) = {value!r}: allowed are true or false"
    )


def check_ddtree_request(params: Any, speculative_config: Any) -> None:
    """Where vLLM validates a request against the engine's speculative config: with DDTree,
    what the tree sampler cannot apply (``config.check_sampling_params``) and the request's
    DDTree options (``check_request_options``; an engine where "auto" chose the chain checks
    the options too) raise ``DDTreeConfigError`` naming the fields. Nothing for other engines."""
    ddtree = get_ddtree_config(speculative_config)
    if ddtree is not None:
        check_sampling_params(params, ddtree.runner)
        check_request_options(params, ddtree.tree_budget)
    elif serves_chain_for_ddtree(speculative_config):
        check_request_options(params, None)


def check_request_options(params: Any, engine_budget: int | None) -> None:
    """Raise ``DDTreeConfigError`` when a request's DDTree options are not allowed values
    (``engine_budget`` None: the engine serves the DFlash chain)."""
    request_tree_budget(params, engine_budget)
    wants_tree_stats(params)


def cap_request_budgets(requests) -> None:
    """Before the scheduler plans a step: each running request that asked for fewer tree nodes
    than it has draft tokens keeps only its first ones (the shared placeholder list of async
    scheduling is replaced, not changed). Values were checked when the request came in."""
    for request in requests:
        cap = _extra_args(request.sampling_params).get(REQUEST_BUDGET_KEY)
        if type(cap) is int and len(request.spec_token_ids) > cap:
            request.spec_token_ids = request.spec_token_ids[:cap]


@dataclass
class RequestTreeStats:
    """One request's verified trees so far."""

    verify_steps: int = 0  # steps that verified at least one tree node
    nodes: int = 0  # tree nodes verified, in all
    max_nodes: int = 0  # tree nodes verified in one step, at most
    accepted: int = 0  # draft tokens accepted, in all

    def observe(self, num_nodes: int, num_accepted: int) -> None:
        if num_nodes <= 0:
            return
        self.verify_steps += 1
        self.nodes += num_nodes
        self.max_nodes = max(self.max_nodes, num_nodes)
        self.accepted += num_accepted

    @property
    def acceptance_length(self) -> float:
        """Tokens a verify step emitted on average (accepted drafts + the bonus token), as
        vLLM's mean acceptance length counts them."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "verify_steps": self.verify_steps,
            "tree_nodes": self.nodes,
            "max_tree_nodes_per_step": self.max_nodes,
            "accepted_tokens": self.accepted,
            "acceptance_length": round(self.acceptance_length, 4),
        }

    def describe(self) -> str:
        return (
            f"{self.verify_steps} verify steps, {self.nodes} tree nodes verified (at most "
            f"{self.max_nodes} in a step), {self.accepted} draft tokens accepted, acceptance "
            f"length {self.acceptance_length:.2f}"
        )


class RequestStatsBook:
    """The scheduler's ``RequestTreeStats`` by request id, from a request's first verify step
    until it is freed; ``serves_chain``: the engine verifies vLLM's DFlash chain ("auto" chose
    it), whose drafts count as trees of one branch."""

    def __init__(self, serves_chain: bool = False):
        self._by_request: dict[str, RequestTreeStats] = {}
        self.serves_chain = serves_chain

    def observe(self, request_id: str, num_nodes: int, num_accepted: int) -> None:
        stats = self._by_request.get(request_id)
        if stats is None:
            stats = self._by_request[request_id] = RequestTreeStats()
        stats.observe(num_nodes, num_accepted)

    def finish(self, request_id: str) -> RequestTreeStats | None:
        return self._by_request.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._by_request)
