"""The scheduler's side of a request's own DDTree options (``options.py``): each running
request's draft tokens cut to its own tree budget before a step is planned, and each request's
tree statistics kept until it is freed, then logged and returned in its final output's
``kv_transfer_params``. Plain functions vLLM's ``Scheduler`` calls from its methods (the
plugin's wrappers: ``compat/scheduler_options.py``); the statistics live in the scheduler's
``SchedulerState`` (``handles``).
"""

from __future__ import annotations

import logging

from vllm_ddtree.config import DDTreeConfigError
from vllm_ddtree.handles import held, hold
from vllm_ddtree.requests.options import (
    SERVED_CHAIN,
    SERVED_TREES,
    STATS_RESPONSE_KEY,
    RequestStatsBook,
    RequestTreeStats,
    cap_request_budgets,
    wants_tree_stats,
)
from vllm_ddtree.scheduler_state import SchedulerState

logger = logging.getLogger("vllm.ddtree")


def stats_book(scheduler) -> RequestStatsBook | None:
    """The scheduler's ``RequestStatsBook`` (``scheduler_state.SchedulerState``), or None."""
    state = held(scheduler, SchedulerState)
    return state.stats_book if state is not None else None


def before_schedule(scheduler) -> None:
    """At the start of the scheduler's ``schedule``: requests' own tree budgets cap their
    draft tokens first (engines asked for DDTree, trees or the chain)."""
    if stats_book(scheduler) is not None:
        cap_request_budgets(scheduler.running)


def observe_request(
    scheduler, num_draft_tokens: int, num_accepted_tokens: int, num_invalid_spec_tokens, request_id
) -> int:
    """Where the scheduler counts a request's verified drafts (``make_spec_decoding_stats``):
    the request's own tree statistics, its invalid drafts taken off. Returns its valid draft
    tokens."""
    if num_invalid_spec_tokens:
        num_draft_tokens -= num_invalid_spec_tokens.get(request_id, 0)
    book = stats_book(scheduler)
    if book is not None:
        book.observe(request_id, num_draft_tokens, num_accepted_tokens)
    return num_draft_tokens


def finish_request_stats(scheduler, request, kv_transfer_params):
    """At the end of the scheduler's ``_free_request``: a finished request's tree statistics
    go to the log and, when it asked for them, into the ``kv_transfer_params`` of its final
    output (returned; ``kv_transfer_params`` unchanged otherwise)."""
    book = stats_book(scheduler)
    if book is None:  # not the scheduler of an engine asked for DDTree
        return kv_transfer_params
    stats = book.finish(request.request_id)
    try:
        asked = wants_tree_stats(request.sampling_params)
    except DDTreeConfigError:  # a request that skipped vLLM's validation: not asked
        asked = False
    if asked and stats is None:  # finished before its first tree
        stats = RequestTreeStats()
    served = SERVED_CHAIN if book.serves_chain else SERVED_TREES
    if stats is not None:
        level = logging.INFO if asked else logging.DEBUG
        described = stats.describe()
        if book.serves_chain:
            described += " (vLLM's DFlash chain: tree_budget 'auto' chose it)"
        logger.log(level, "vllm-ddtree: request %s: %s", request.request_id, described)
    if not asked:
        return kv_transfer_params
    returned = {**stats.as_dict(), "served": served}
    return {**(kv_transfer_params or {}), STATS_RESPONSE_KEY: returned}


def install_stats_book(scheduler, serves_chain: bool = False) -> None:
    """The scheduler of an engine asked for DDTree keeps a ``RequestStatsBook`` (its
    ``__init__`` wrapper); ``serves_chain``: "auto" chose vLLM's DFlash chain."""
    hold(scheduler, SchedulerState).stats_book = RequestStatsBook(serves_chain)
