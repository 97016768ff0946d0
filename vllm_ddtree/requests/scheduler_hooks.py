"""The scheduler's side of a request's own DDTree options (``options.py``): each running
request's draft tokens cut to its own tree budget before a step is planned, and each request's
tree statistics kept until it is freed, then logged and returned in its final output's
``kv_transfer_params``. Wrappers of vLLM's ``Scheduler`` (``compat/seams.py``); the statistics
live in the scheduler's ``SchedulerState`` (``handles``).
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
    """The scheduler's ``RequestStatsBook`` (``handles.SchedulerState``), or None."""
    state = held(scheduler, SchedulerState)
    return state.stats_book if state is not None else None


def _wrap_schedule(original):
    """``Scheduler.schedule``: requests' own tree budgets cap their draft tokens first."""

    def schedule(self, *args, **kwargs):
        if stats_book(self) is not None:  # an engine asked for DDTree (trees or the chain)
            cap_request_budgets(self.running)
        return original(self, *args, **kwargs)

    return schedule


def _wrap_free_request(original):
    """``Scheduler._free_request``: a finished request's tree statistics go to the log and, when
    it asked for them, into the ``kv_transfer_params`` of its final output."""

    def _free_request(self, request, *args, **kwargs):
        book = stats_book(self)
        if book is None:  # not the scheduler of an engine asked for DDTree
            return original(self, request, *args, **kwargs)
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
        freed = original(self, request, *args, **kwargs)
        if asked:
            kv_params, *rest = freed
            returned = {**stats.as_dict(), "served": served}
            kv_params = {**(kv_params or {}), STATS_RESPONSE_KEY: returned}
            freed = (kv_params, *rest)
        return freed

    return _free_request


def install_stats_book(scheduler, serves_chain: bool = False) -> None:
    """The scheduler of an engine asked for DDTree keeps a ``RequestStatsBook`` (its
    ``__init__`` wrapper); ``serves_chain``: "auto" chose vLLM's DFlash chain."""
    hold(scheduler, SchedulerState).stats_book = RequestStatsBook(serves_chain)
