"""The plugin's wrappers of vLLM's ``Scheduler`` for a request's own DDTree options (the seam
group ``ENGINE``): each calls the function of ``requests/scheduler_hooks.py`` that vLLM's tree
calls from the same method."""

from __future__ import annotations

from vllm_ddtree.requests.scheduler_hooks import before_schedule, finish_request_stats


def _wrap_schedule(original):
    """``Scheduler.schedule``: requests' own tree budgets cap their draft tokens first."""

    def schedule(self, *args, **kwargs):
        before_schedule(self)
        return original(self, *args, **kwargs)

    return schedule


def _wrap_free_request(original):
    """``Scheduler._free_request``: a finished request's tree statistics logged, and returned
    in its final output's ``kv_transfer_params`` when it asked for them."""

    def _free_request(self, request, *args, **kwargs):
        kv_transfer_params, *rest = original(self, request, *args, **kwargs)
        return (finish_request_stats(self, request, kv_transfer_params), *rest)

    return _free_request
