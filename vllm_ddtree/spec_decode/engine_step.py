"""The engine core's step loops (``EngineCore.step``, ``step_with_batch_queue``) in an engine
whose ``"tree_budget": "auto"`` moves online: before each step, the engine's ``OnlineBudget``
(``budget/online.py``) refreshes its per-batch-size budgets every ``REFRESH_STEPS`` steps,
reading the first worker's step state through the readers this module hands it."""

from __future__ import annotations

from vllm_ddtree.budget.online import WorkerReaders, online_budget
from vllm_ddtree.spec_decode.step_state import worker_acceptance, worker_step_costs

READERS = WorkerReaders(acceptance=worker_acceptance, step_costs=worker_step_costs)


def _wrap_engine_step(original):
    """``EngineCore.step`` / ``step_with_batch_queue``: an online "auto" engine refreshes its
    budgets first."""

    def step(self, *args, **kwargs):
        controller = online_budget(self, READERS)
        if controller is not None:
            controller.before_step()
        return original(self, *args, **kwargs)

    return step
