"""What "auto" predicted, from the engine core's scheduler to the front end's log line and
/metrics (``budget/metrics.py``), against stand-ins for vLLM's stats objects: the
functions vLLM's methods call."""

import functools
from types import SimpleNamespace

import pytest

from vllm_ddtree.budget import metrics as budget_metrics


def test_a_verify_step_is_predicted_by_the_largest_budget_it_holds():
    held = budget_metrics.BudgetPredictions()
    held.observe(16)  # nothing predicted yet: not counted
    assert held.drain() is None
    held.set({4: 2.0, 16: 4.5, 32: 5.0})
    assert held.predicted(3) is None and held.predicted(4) == 2.0
    assert held.predicted(20) == 4.5 and held.predicted(64) == 5.0
    for nodes in (16, 32, 5, 0):  # a 0-node row verified no tree
        held.observe(nodes)
    assert held.drain() == {"predicted_tokens": 11.5, "predicted_steps": 3}
    assert held.drain() is None  # drained


def test_the_predictions_ride_in_kv_connector_stats_and_are_taken_out_once():
    scheduler = SimpleNamespace()
    budget_metrics.set_predictions(scheduler, {8: 3.0})
    budget_metrics.observe(scheduler, 8)
    budget_metrics.observe(scheduler, 8)
    connector = {"num_transfers": 2}  # a KV connector's own stats stay

    def make_stats(scheduler):  # vLLM's make_stats, ending with DDTree's call
        made = SimpleNamespace(kv_connector_stats=dict(connector), spec_decoding_stats=None)
        return budget_metrics.with_predictions(scheduler, made)

    stats = make_stats(scheduler)
    payload = {"predicted_tokens": 6.0, "predicted_steps": 2}
    assert stats.kv_connector_stats == {**connector, "ddtree": payload}
    assert budget_metrics.take_payload(stats) == payload
    assert stats.kv_connector_stats == connector
    assert budget_metrics.take_payload(stats) == payload  # the next stat logger's
    # Without a connector the field is left None, as vLLM sent it; nothing observed: no payload.
    budget_metrics.observe(scheduler, 8)
    alone = budget_metrics.with_predictions(
        scheduler, SimpleNamespace(kv_connector_stats=None, spec_decoding_stats=None)
    )
    assert budget_metrics.take_payload(alone) is not None and alone.kv_connector_stats is None
    quiet = budget_metrics.with_predictions(
        scheduler, SimpleNamespace(kv_connector_stats=None, spec_decoding_stats=None)
    )
    assert quiet.kv_connector_stats is None and budget_metrics.take_payload(quiet) is None
    # A scheduler without predictions (a fixed budget) changes nothing.
    plain = make_stats(SimpleNamespace())
    assert plain.kv_connector_stats == connector


def test_the_metrics_count_predicted_steps_and_gauge_the_nodes_served():
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    stat_logger = SimpleNamespace(
        per_engine_labelvalues={0: ["m", "0"]},
        _counter_cls=functools.partial(prometheus.Counter, registry=registry),
        _gauge_cls=functools.partial(prometheus.Gauge, registry=registry),
    )
    prom = budget_metrics.BudgetProm(stat_logger)
    spec = SimpleNamespace(num_drafts=4, num_draft_tokens=64)
    stats = SimpleNamespace(spec_decoding_stats=spec)
    prom.observe(stats, {"predicted_tokens": 18.0, "predicted_steps": 4}, 0)
    prom.observe(stats, None, 0)  # a step "auto" predicted nothing for
    labels = {"model_name": "m", "engine": "0"}
    value = functools.partial(registry.get_sample_value, labels=labels)
    assert value("vllm:ddtree_predicted_tokens_total") == 18.0
    assert value("vllm:ddtree_predicted_verify_steps_total") == 4.0
    assert value("vllm:ddtree_tree_nodes_per_verify") == 16.0


def test_the_log_line_says_the_predicted_acceptance_length_beside_the_realised_one():
    pytest.importorskip("vllm")
    from vllm_ddtree.metrics.spec_counters import tree_logging_class

    logging = tree_logging_class()()
    spec = SimpleNamespace(
        num_drafts=4,
        num_draft_tokens=64,
        num_accepted_tokens=12,
        num_accepted_tokens_per_pos=[4, 4, 3, 1],
    )
    logging.observe(spec)
    stats = SimpleNamespace(
        kv_connector_stats={"ddtree": {"predicted_tokens": 16.0, "predicted_steps": 4}}
    )
    budget_metrics.observe_logged(SimpleNamespace(spec_decoding_logging=logging), stats)
    lines = []
    logging.log(log_fn=lambda message, *args: lines.append(message % args))
    line = next(line for line in lines if line.startswith("SpecDecoding metrics"))
    assert "Mean acceptance length: 4.00" in line, line
    assert line.endswith(
        "Mean tree nodes verified: 16.0, Predicted acceptance length ('auto'): 4.00"
    )


def test_predictions_sent_without_request_outputs_ride_with_the_next_stats():
    """vLLM's synchronous LLMEngine records no stats that come without request outputs: the
    engine core gives such predictions back, and the next stats carry them."""
    scheduler = SimpleNamespace()
    budget_metrics.set_predictions(scheduler, {8: 3.0})

    def step(with_outputs: bool):
        budget_metrics.observe(scheduler, 8)
        eco = SimpleNamespace(outputs=["out"] if with_outputs else [])
        eco.scheduler_stats = budget_metrics.with_predictions(
            scheduler, SimpleNamespace(kv_connector_stats=None, spec_decoding_stats=None)
        )
        budget_metrics.keep_unsent_predictions(scheduler, {0: eco})
        return eco

    quiet = step(with_outputs=False)
    assert quiet.scheduler_stats.kv_connector_stats is None
    loud = step(with_outputs=True)
    expected = {"predicted_tokens": 6.0, "predicted_steps": 2}
    assert budget_metrics.take_payload(loud.scheduler_stats) == expected
