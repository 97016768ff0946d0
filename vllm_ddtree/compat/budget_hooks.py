"""The plugin's wrappers for an online ``"tree_budget": "auto"`` (the seam group ``ENGINE``):
the engine core's two step loops (``spec_decode/engine_step.py``), the scheduler's stats and
the front end's stat loggers (``budget/metrics.py``). Each calls vLLM's method and, at its
start or end, the plain function vLLM's tree calls from the same place (upstream patch 15)."""

from __future__ import annotations

from vllm_ddtree.budget import metrics as budget_metrics
from vllm_ddtree.compat import bind_arguments
from vllm_ddtree.spec_decode.engine_step import before_engine_step


def _wrap_engine_step(original):
    """``EngineCore.step`` / ``step_with_batch_queue``: an online "auto" engine refreshes its
    budgets first."""

    def step(self, *args, **kwargs):
        before_engine_step(self)
        return original(self, *args, **kwargs)

    return step


def _wrap_make_stats(original):
    def make_stats(self, *args, **kwargs):
        return budget_metrics.with_predictions(self, original(self, *args, **kwargs))

    return make_stats


def _wrap_update_from_output(original):
    def update_from_output(self, *args, **kwargs):
        outputs = original(self, *args, **kwargs)
        budget_metrics.keep_unsent_predictions(self, outputs)
        return outputs

    return update_from_output


def _wrap_stat_logger_manager_record(original):
    def record(self, scheduler_stats, *args, **kwargs):
        budget_metrics.take_payload(scheduler_stats)
        return original(self, scheduler_stats, *args, **kwargs)

    return record


def _wrap_logging_record(original):
    def record(self, scheduler_stats, *args, **kwargs):
        budget_metrics.observe_logged(self, scheduler_stats)
        return original(self, scheduler_stats, *args, **kwargs)

    return record


def _wrap_prometheus_init(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        self.ddtree_prom = budget_metrics.prometheus_metrics(self, vllm_config)

    return __init__


def _wrap_prometheus_record(original):
    def record(self, *args, **kwargs):
        bound = bind_arguments(original, self, *args, **kwargs)
        bound.apply_defaults()
        budget_metrics.observe_prometheus(
            self, bound.arguments["scheduler_stats"], bound.arguments["engine_idx"]
        )
        return original(self, *args, **kwargs)

    return record
