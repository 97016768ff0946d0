"""What ``"tree_budget": "auto"`` predicted, beside what the engine realised, in vLLM's periodic
spec-decode log line and on ``/metrics``.

Engine core: each refresh of the online budget (``online_budget.OnlineBudget``) leaves its
predicted tokens per verify step by budget on the scheduler (``set_predictions``). Every
request's verify step then adds the prediction for the tree it verified (``observe``: the
prediction of the largest budget at most its tree nodes), and the step's ``SchedulerStats``
carry the sums to the front end under ``"ddtree"`` in ``kv_connector_stats``: the one
free-form field vLLM sends from the engine core (its serialiser drops any attribute that is
not a declared field; ``with_predictions``, at the end of ``Scheduler.make_stats``). Stats
that travel without request outputs give their sums back for the next ones
(``keep_unsent_predictions``, at the end of ``Scheduler.update_from_output``: vLLM's
synchronous ``LLMEngine`` records no stats from such outputs). In the front end the sums are
taken out of the field before any stat logger runs (``take_payload``, at the start of
``StatLoggerManager.record``), so custom stat loggers and vLLM's KV-connector metrics see the
connector's stats as vLLM sent them.

vLLM calls these functions where this happens (upstream patch 15); the plugin wraps the same
methods (``compat/budget_hooks.py``).

Front end: the log line ends with the predicted tokens per verify step next to vLLM's mean
acceptance length (the realised one), and ``/metrics`` has

* ``vllm:ddtree_predicted_tokens`` and ``vllm:ddtree_predicted_verify_steps`` (counters): the
  predicted tokens of the verify steps "auto" predicted, and those steps; their ratio set
  against vLLM's ``1 + accepted / drafts`` is predicted against realised;
* ``vllm:ddtree_tree_nodes_per_verify`` (gauge): the tree nodes a request verified per step
  in the last step with trees, the budget served (after per-batch-size schedules and
  requests' own budgets cut the trees).
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.handles import held, hold
from vllm_ddtree.scheduler_state import SchedulerState

PAYLOAD_KEY = "ddtree"  # in SchedulerStats.kv_connector_stats, engine core to front end
PAYLOAD_ATTR = "_ddtree_payload"  # on a SchedulerStats once the front end took it out


class BudgetPredictions:
    """The online budget's predicted tokens per verify step by budget, and the sums of the
    predictions for the verify steps since the last ``drain``."""

    def __init__(self):
        self.by_budget: dict[int, float] = {}
        self.tokens = 0.0
        self.steps = 0

    def set(self, by_budget: dict[int, float]) -> None:
        self.by_budget = dict(by_budget)

    def predicted(self, num_nodes: int) -> float | None:
        """The prediction for a tree of ``num_nodes`` nodes: that of the largest budget at
        most ``num_nodes`` (a cut tree is the best-first tree of its size), None when no
        budget is that small or nothing was predicted yet."""
        fitting = [b for b in self.by_budget if b <= num_nodes]
        return self.by_budget[max(fitting)] if fitting else None

    def observe(self, num_nodes: int) -> None:
        if num_nodes <= 0:
            return
        predicted = self.predicted(num_nodes)
        if predicted is not None:
            self.tokens += predicted
            self.steps += 1

    def give_back(self, payload: dict[str, Any]) -> None:
        """Sums ``drain`` gave that did not reach the front end: sent with the next ones."""
        self.tokens += payload["predicted_tokens"]
        self.steps += payload["predicted_steps"]

    def drain(self) -> dict[str, Any] | None:
        if not self.steps:
            return None
        payload = {"predicted_tokens": self.tokens, "predicted_steps": self.steps}
        self.tokens, self.steps = 0.0, 0
        return payload


def predictions(scheduler) -> BudgetPredictions | None:
    """The scheduler's ``BudgetPredictions`` (``scheduler_state.SchedulerState``), or None."""
    state = held(scheduler, SchedulerState)
    return state.predictions if state is not None else None


def set_predictions(scheduler, by_budget: dict[int, float]) -> None:
    """The online budget's latest predicted tokens per verify step by budget."""
    state = hold(scheduler, SchedulerState)
    if state.predictions is None:
        state.predictions = BudgetPredictions()
    state.predictions.set(by_budget)


def observe(scheduler, num_nodes: int) -> None:
    """A request's verify step of ``num_nodes`` tree nodes (engine core)."""
    kept = predictions(scheduler)
    if kept is not None:
        kept.observe(num_nodes)


def with_predictions(scheduler, stats):
    """At the end of ``Scheduler.make_stats`` (engine core): the predictions of the verify
    steps since the last stats ride to the front end in ``stats.kv_connector_stats``. Returns
    ``stats``."""
    kept = predictions(scheduler)
    if stats is None or kept is None:
        return stats
    payload = kept.drain()
    if payload is not None:
        stats.kv_connector_stats = {**(stats.kv_connector_stats or {}), PAYLOAD_KEY: payload}
    return stats


def _pop_payload(scheduler_stats) -> dict[str, Any] | None:
    """The predictions in ``scheduler_stats.kv_connector_stats``, removed from it (the field
    left None when nothing else is there)."""
    connector = scheduler_stats.kv_connector_stats
    if not isinstance(connector, dict) or PAYLOAD_KEY not in connector:
        return None
    rest = dict(connector)
    payload = rest.pop(PAYLOAD_KEY)
    scheduler_stats.kv_connector_stats = rest or None
    return payload


def keep_unsent_predictions(scheduler, outputs) -> None:
    """At the end of ``Scheduler.update_from_output`` (engine core): predictions in stats sent
    without request outputs go back to the scheduler, to ride with the next stats."""
    kept = predictions(scheduler)
    if kept is None or not outputs:
        return
    for engine_core_outputs in outputs.values():
        stats = engine_core_outputs.scheduler_stats
        if stats is not None and not engine_core_outputs.outputs:
            payload = _pop_payload(stats)
            if payload is not None:
                kept.give_back(payload)


def take_payload(scheduler_stats) -> dict[str, Any] | None:
    """Front end (first at the start of ``StatLoggerManager.record``, before any stat logger
    runs): the engine core's predictions in ``scheduler_stats``, taken out of its
    ``kv_connector_stats`` (left None when nothing else is there) the first time, so that
    vLLM's KV-connector metrics never see them; every stat logger gets the same."""
    if scheduler_stats is None:
        return None
    if hasattr(scheduler_stats, PAYLOAD_ATTR):
        return getattr(scheduler_stats, PAYLOAD_ATTR)
    payload = _pop_payload(scheduler_stats)
    setattr(scheduler_stats, PAYLOAD_ATTR, payload)
    return payload


def observe_logged(stat_logger, scheduler_stats) -> None:
    """At the start of ``LoggingStatLogger.record`` (front end): the predictions go to the
    spec-decode log line (``spec_counters.TreeSpecDecodingLogging``)."""
    payload = take_payload(scheduler_stats)
    logging = getattr(stat_logger, "spec_decoding_logging", None)
    if payload is not None and hasattr(logging, "observe_predicted"):
        logging.observe_predicted(payload["predicted_tokens"], payload["predicted_steps"])


class BudgetProm:
    """The DDTree metrics of one ``PrometheusStatLogger``, per engine."""

    def __init__(self, stat_logger):
        labelnames = ["model_name", "engine"]
        engines = stat_logger.per_engine_labelvalues

        def per_engine(metric):
            return {idx: metric.labels(*values) for idx, values in engines.items()}

        self.predicted_tokens = per_engine(
            stat_logger._counter_cls(
                name="vllm:ddtree_predicted_tokens",
                documentation="Tokens per verify step tree_budget 'auto' predicted, summed "
                "over the verify steps it predicted.",
                labelnames=labelnames,
            )
        )
        self.predicted_steps = per_engine(
            stat_logger._counter_cls(
                name="vllm:ddtree_predicted_verify_steps",
                documentation="Verify steps (one per request and step) tree_budget 'auto' "
                "predicted tokens for.",
                labelnames=labelnames,
            )
        )
        self.nodes_per_verify = per_engine(
            stat_logger._gauge_cls(
                name="vllm:ddtree_tree_nodes_per_verify",
                documentation="Tree nodes a request verified per step, in the last step "
                "with trees (the tree budget served).",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
        )

    def observe(self, scheduler_stats, payload, engine_idx: int) -> None:
        if payload is not None:
            self.predicted_tokens[engine_idx].inc(payload["predicted_tokens"])
            self.predicted_steps[engine_idx].inc(payload["predicted_steps"])
        spec = scheduler_stats.spec_decoding_stats
        if spec is not None and spec.num_drafts:
            self.nodes_per_verify[engine_idx].set(spec.num_draft_tokens / spec.num_drafts)


def prometheus_metrics(stat_logger, vllm_config) -> BudgetProm | None:
    """At the end of ``PrometheusStatLogger.__init__`` (front end): a DDTree engine's
    ``BudgetProm``, None for any other engine."""
    from vllm_ddtree.config import get_ddtree_config

    if get_ddtree_config(vllm_config.speculative_config) is None:
        return None
    return BudgetProm(stat_logger)


def observe_prometheus(stat_logger, scheduler_stats, engine_idx: int) -> None:
    """At the start of ``PrometheusStatLogger.record`` (front end): the DDTree metrics of
    ``scheduler_stats`` (the logger's ``ddtree_prom``, where ``prometheus_metrics`` made one)."""
    payload = take_payload(scheduler_stats)
    prom = getattr(stat_logger, "ddtree_prom", None)
    if prom is not None and scheduler_stats is not None:
        prom.observe(scheduler_stats, payload, engine_idx)
