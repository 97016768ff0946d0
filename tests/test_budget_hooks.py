"""The plugin's wrappers for an online "auto" (``compat/budget_hooks.py``): vLLM's own
``StatLoggerManager.record`` takes DDTree's predictions out before any stat logger runs. In
vLLM's tree the method calls ``budget/metrics.take_payload`` itself (upstream patch 15)."""

from types import SimpleNamespace

import pytest

from vllm_ddtree.budget import metrics as budget_metrics
from vllm_ddtree.compat import budget_hooks


def test_custom_stat_loggers_see_the_connectors_stats_as_vllm_sent_them():
    """vLLM's ``StatLoggerManager`` runs custom stat loggers before its own: they get the KV
    connector's stats without DDTree's predictions (a logger rebuilding connector stats from
    the dict would refuse an unknown key), and without a connector the field stays None; the
    default loggers still get the predictions."""
    pytest.importorskip("vllm")
    from vllm.v1.metrics.loggers import StatLoggerManager

    seen = []

    class CustomLogger:  # what AsyncLLM(stat_loggers=...) or a stat logger plugin adds
        def record(self, scheduler_stats, *args, **kwargs):
            seen.append(scheduler_stats.kv_connector_stats)

    class DefaultLogger:  # vLLM's own, patched: they read take_payload
        def record(self, scheduler_stats, *args, **kwargs):
            seen.append(budget_metrics.take_payload(scheduler_stats))

    manager = SimpleNamespace(stat_loggers=[CustomLogger(), DefaultLogger()])
    record = budget_hooks._wrap_stat_logger_manager_record(StatLoggerManager.record)
    payload = {"predicted_tokens": 6.0, "predicted_steps": 2}
    connector = {"Nixl": {"num_successful_transfers": [3]}}
    for sent in ({**connector, "ddtree": payload}, {"ddtree": payload}):
        seen.clear()
        stats = SimpleNamespace(kv_connector_stats=sent, spec_decoding_stats=None)
        record(manager, stats, None, engine_idx=0)
        assert seen == [connector if len(sent) > 1 else None, payload]
