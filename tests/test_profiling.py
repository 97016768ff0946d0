"""The tree step's profiler ranges: present while a profiler records, free otherwise."""

import contextlib

import torch

from vllm_ddtree.profiling import step_range


def test_a_step_range_is_recorded_only_while_a_profiler_runs():
    assert isinstance(step_range("ddtree::test_range"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with step_range("ddtree::test_range"):
            torch.zeros(4).add_(1)
    names = {event.key for event in prof.key_averages()}
    assert "ddtree::test_range" in names
