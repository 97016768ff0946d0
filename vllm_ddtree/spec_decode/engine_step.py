"""The engine core's step loops (``EngineCore.step``, ``step_with_batch_queue``) in an engine
whose ``"tree_budget": "auto"`` moves online: before each step, the engine's ``OnlineBudget``
(``budget/online.py``) refreshes its per-batch-size budgets every ``REFRESH_STEPS`` steps,
reading the first worker's step state through the readers this module hands it. vLLM calls
``before_engine_step`` at the start of both loops (upstream patch 15; the plugin wraps them,
``compat/budget_hooks.py``)."""

from __future__ import annotations

from vllm_ddtree.budget.online import WorkerReaders, online_budget
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.spec_decode.step_state import worker_acceptance, worker_step_costs

READERS = WorkerReaders(acceptance=worker_acceptance, step_costs=worker_step_costs)


def before_engine_step(engine_core) -> None:
    """At the start of the engine core's step: an online "auto" engine refreshes its budgets
    first; a no-op in every other engine."""
    speculative_config = getattr(engine_core.vllm_config, "speculative_config", None)
    if get_ddtree_config(speculative_config) is None:
        return
    controller = online_budget(engine_core, READERS)
    if controller is not None:
        controller.before_step()
