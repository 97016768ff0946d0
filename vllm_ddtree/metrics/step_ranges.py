"""The ``ddtree::*`` ranges of the tree step: profiler ranges, host timers, or free.

``torch.profiler.record_function`` costs a dispatcher call on entry and exit even with no
profiler running (about two small tensor operations' worth of host time), and a small model's
DDTree step is host-bound. ``step_range`` opens the range only while a profiler is recording
(``benchmarks/profile_step.py`` and ``benchmarks/step_split.py`` read these ranges). Between
``time_phases(True)`` and ``time_phases(False)`` it instead adds each range's host wall time
(``time.perf_counter``) to ``phase_times()``: the phases' cost without the profiler's slowdown,
for an engine running in this process (``benchmarks/step_split.py``).
"""

from __future__ import annotations

import contextlib
import time

import torch

_NO_RANGE = contextlib.nullcontext()
# Range name -> [host seconds, entries] while timing (``time_phases``), else None.
_PHASE_TIMES: dict[str, list[float]] | None = None


class _HostTimer:
    """Adds its block's host wall time to ``_PHASE_TIMES[name]``."""

    __slots__ = ("name", "start")

    def __init__(self, name: str):
        self.name = name
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if _PHASE_TIMES is not None:
            entry = _PHASE_TIMES.setdefault(self.name, [0.0, 0])
            entry[0] += time.perf_counter() - self.start
            entry[1] += 1


def step_range(name: str):
    """``torch.profiler.record_function(name)`` while a profiler records, a host timer while
    ``time_phases`` is on, else a no-op."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    if _PHASE_TIMES is not None:
        return _HostTimer(name)
    return _NO_RANGE


def time_phases(on: bool) -> None:
    """Start timing the ranges of this process from zero (``on``), or stop timing."""
    global _PHASE_TIMES
    _PHASE_TIMES = {} if on else None


def phase_times() -> dict[str, tuple[float, int]]:
    """Range name -> (host seconds, entries) since ``time_phases(True)`` (empty when off)."""
    return {name: (seconds, int(count)) for name, (seconds, count) in (_PHASE_TIMES or {}).items()}
