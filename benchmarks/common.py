"""What the benchmarks share: the commit a run measured, how a benchmark starts a copy of
itself in a fresh process, and the device time of one call on a GPU."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

from vllm_ddtree import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The commit measured: $VLLM_DDTREE_COMMIT (hosts without the git metadata), else HEAD."""
    if envs.commit():
        return envs.commit()
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def module_command(module: str) -> list[str]:
    """The command that runs ``benchmarks.<module>`` in a fresh interpreter (run it with
    ``cwd=ROOT``, where the ``benchmarks`` package and the plugin's source are)."""
    return [sys.executable, "-m", f"benchmarks.{module}"]


def timed_ms(fn, calls: int, graph: bool, rounds: int = 1) -> float:
    """Device ms per call of ``fn`` on a CUDA GPU: ``calls`` replays of its CUDA graph, or
    ``calls`` launches back to back, between two events; the median of ``rounds`` such
    timings."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        captured = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
            with torch.cuda.graph(captured, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        run = captured.replay
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)
