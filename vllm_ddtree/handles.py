"""The one handle DDTree keeps on a vLLM object: its ``_ddtree`` attribute.

A DDTree engine runs in objects vLLM builds; what DDTree owns per engine lives in one typed
object per vLLM object, always on the attribute ``HANDLE``:

* the model runner (each worker): its ``StepState`` (``spec_decode/step_state.py``), which the
  proposer / speculator owns and the runner hooks reach through the runner;
* the scheduler (the engine core process): a ``SchedulerState`` (``scheduler_state.py``):
  each request's tree statistics, what ``"auto"`` predicted and the engine core's online
  budget;
* the plugin's ``EngineArgs`` (where the config is made): an ``ArgsState``
  (the plugin's installer): what the next ``create_speculative_config`` call must know.

What DDTree adds to vLLM's messages rides beside them instead (``config.DDTREE_ATTR`` on the
speculative config, the trees' parents on vLLM's draft-token output and requests, "auto"'s
payload on ``SchedulerStats``): data that travels, not a handle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

HANDLE = "_ddtree"

T = TypeVar("T")


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
