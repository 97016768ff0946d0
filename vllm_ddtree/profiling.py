"""The ``ddtree::*`` profiler ranges of the tree step, free when nothing profiles.

``torch.profiler.record_function`` costs a dispatcher call on entry and exit even with no
profiler running (about two small tensor operations' worth of host time), and a small model's
DDTree step is host-bound. ``step_range`` opens the range only while a
profiler is recording (``benchmarks/profile_step.py`` reads these ranges).
"""

from __future__ import annotations

import contextlib

import torch

_NO_RANGE = contextlib.nullcontext()


def step_range(name: str):
    """``torch.profiler.record_function(name)`` while a profiler records, else a no-op."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_RANGE
