"""What a DDTree engine keeps on vLLM's scheduler (the engine core process), on its handle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_ddtree.budget.metrics import BudgetPredictions
    from vllm_ddtree.budget.online import OnlineBudget
    from vllm_ddtree.requests.options import RequestStatsBook


@dataclass
class SchedulerState:
    """What a DDTree engine keeps on vLLM's scheduler (``handles.hold(scheduler, ...)``)."""

    # Each request's tree statistics (engines asked for DDTree: trees or the chain).
    stats_book: RequestStatsBook | None = None
    predictions: BudgetPredictions | None = None  # "auto"'s predictions
    online_budget: OnlineBudget | None = None  # the engine core's online "auto"
    online_budget_decided: bool = False  # online_budget made (or found not to move)
