"""The one handle DDTree keeps on a vLLM object: its ``_ddtree`` attribute.

A DDTree engine runs in objects vLLM builds; what DDTree owns per engine lives in one typed
object per vLLM object, always on the attribute ``HANDLE``:

* the model runner (each worker): its ``StepState`` (``spec_decode/step_state.py``), which the
  proposer / speculator owns and the runner hooks reach through the runner;
* the scheduler (the engine core process): a ``SchedulerState``: each request's tree
  statistics, what ``"auto"`` predicted and the engine core's online budget;
* ``EngineArgs`` (where the config is made): an ``ArgsState``: the parsed ``DDTreeConfig``
  and what the next ``create_speculative_config`` call must know.

What DDTree adds to vLLM's messages rides beside them instead (``config.DDTREE_ATTR`` on the
speculative config, the trees' parents on vLLM's draft-token output and requests, "auto"'s
payload on ``SchedulerStats``): data that travels, not a handle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vllm_ddtree.budget.metrics import BudgetPredictions
    from vllm_ddtree.budget.online import OnlineBudget
    from vllm_ddtree.config import DDTreeConfig
    from vllm_ddtree.requests.options import RequestStatsBook
    from vllm_ddtree.spec_request import TreeGraphSizing

HANDLE = "_ddtree"

T = TypeVar("T")


@dataclass
class SchedulerState:
    """What a DDTree engine keeps on vLLM's scheduler (the engine core process)."""

    stats_book: RequestStatsBook | None = None  # engines asked for DDTree (trees or chain)
    predictions: BudgetPredictions | None = None  # "auto"'s predicted tokens per verify
    online_budget: OnlineBudget | None = None  # the engine core's online "auto"
    online_budget_decided: bool = False  # online_budget was made (or found not to move)


@dataclass
class ArgsState:
    """What the config rewrite keeps on vLLM's ``EngineArgs`` between its calls."""

    config: DDTreeConfig | None = None  # the parsed DDTree settings
    served_chain: bool = False  # "auto" chose vLLM's DFlash chain
    # How the graphs were sized; create_engine_config finishes them (spec_request).
    sizing: TreeGraphSizing | None = None


def held(owner: Any, kind: type[T]) -> T | None:
    """The ``kind`` object DDTree keeps on ``owner``, or None."""
    value = getattr(owner, HANDLE, None)
    return value if isinstance(value, kind) else None


def hold(owner: Any, kind: type[T], make: Callable[[], T] | None = None) -> T:
    """The ``kind`` object on ``owner``, made (``make``, else ``kind()``) on first use."""
    value = held(owner, kind)
    if value is None:
        value = make() if make is not None else kind()
        setattr(owner, HANDLE, value)
    return value
