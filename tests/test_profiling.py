"""The tree step's profiler ranges: present while a profiler records, free otherwise."""

import contextlib
import time

import torch

from vllm_ddtree.metrics.step_ranges import step_range


def test_a_step_range_is_recorded_only_while_a_profiler_runs():
    assert isinstance(step_range("ddtree::test_range"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with step_range("ddtree::test_range"):
            torch.zeros(4).add_(1)
    names = {event.key for event in prof.key_averages()}
    assert "ddtree::test_range" in names


def test_host_timers_add_up_each_range_between_time_phases_on_and_off():
    from vllm_ddtree.metrics.step_ranges import phase_times, time_phases

    time_phases(True)
    try:
        for _ in range(3):
            with step_range("ddtree::walk_test"):
                time.sleep(0.002)
        with step_range("ddtree::other_test"):
            pass
        times = phase_times()
    finally:
        time_phases(False)
    seconds, count = times["ddtree::walk_test"]
    assert count == 3 and seconds >= 0.006
    assert times["ddtree::other_test"][1] == 1
    assert phase_times() == {}
    assert isinstance(step_range("ddtree::walk_test"), contextlib.nullcontext)
    # A profiler that records still gets its ranges while timing is on.
    time_phases(True)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with step_range("ddtree::profiled_test"):
                torch.zeros(4).add_(1)
    finally:
        time_phases(False)
    assert "ddtree::profiled_test" in {event.key for event in prof.key_averages()}
