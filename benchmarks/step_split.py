"""Where a decode step's time goes, in the end-to-end bench: host timers and torch.profiler.

DDTree's step opens ``ddtree::*`` profiler ranges (``vllm_ddtree/metrics/step_ranges.py``;
free when no profiler records): ``ddtree::draft`` (the drafter pass and the tree build; on the V2
runner one CUDA graph holds both), ``ddtree::build_trees`` (the tree build, inside ``draft``; V1
only), ``ddtree::prepare_tree_inputs`` (positions, ancestor masks, slots), ``ddtree::target_tokens``
and ``ddtree::follow_tree`` (the walk), ``ddtree::commit_kv`` (the accepted nodes' K/V). What
no range covers, the wall time per target forward minus the top-level phases' host time, is
the target's verify forward and vLLM's own step (scheduler, sampler, outputs).

Host ms is the range's wall time on the host (waits for the device included); device ms is
the time the GPU spent in it (the profiler's device total). The profiler slows the host, so
the wall time here is above the bench's unprofiled ms/step; compare phases with each other.
Beside the phases: the GPU's busy ms per forward (every kernel and copy, annotations left out:
a step far above it waits on the host), the operators and kernels with the most host and
device time, and the host synchronisations and kernel launches per forward.
"""

from __future__ import annotations

import time

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item")
# Eager kernel launches (PyTorch, Triton) vs CUDA-graph replays: is the step graph-captured?
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
# vLLM's attention op as the host sees it: called once per attention layer in a forward that
# runs outside a FULL CUDA graph (piecewise graphs or eager; a prefill always does), never in
# a FULL graph's replay.
EAGER_ATTENTION_OPS = ("vllm::unified_attention_with_output", "vllm::unified_attention")

# phase -> the ``ddtree::*`` ranges it sums (per target forward).
PHASES = {
    "draft": ("ddtree::draft",),
    "tree build": ("ddtree::build_trees",),
    "tree inputs": ("ddtree::prepare_tree_inputs",),
    "walk": ("ddtree::target_tokens", "ddtree::follow_tree"),
    "commit": ("ddtree::commit_kv",),
}
# The phases that do not nest in another (``tree build`` runs inside ``draft``).
TOP_LEVEL = ("draft", "tree inputs", "walk", "commit")
REST = "verify and the rest"
# vLLM's histogram of tokens per engine step: its count is the engine's steps.
ENGINE_STEPS = "vllm:iteration_tokens_total"


def step_split(
    events,
    target_forwards: int,
    wall_seconds: float,
    on_device: bool,
    top: int = 12,
    top_device: int = 60,
) -> dict:
    """Per target forward: the profiled wall ms, each phase's host (and, ``on_device``, device)
    ms, and ``REST``, from ``events`` (torch.profiler's ``key_averages()``: ``key``, ``count``,
    ``cpu_time_total``, ``device_time_total`` and their ``self_`` parts in microseconds,
    ``device_type``, ``is_user_annotation``). A range can appear twice (its host entry and its
    GPU annotation): each range counts its largest host and device totals once. Also, per
    forward: ``device_busy_ms`` (``on_device``), the ``top`` operators by self host time, the
    ``top_device`` kernels by self device time, host synchronisations and kernel launches."""
    forwards = max(1, target_forwards)
    host_us: dict[str, float] = {}
    device_us: dict[str, float] = {}
    for event in events:
        host_us[event.key] = max(host_us.get(event.key, 0.0), float(event.cpu_time_total))
        device = float(getattr(event, "device_time_total", 0.0) or 0.0)
        device_us[event.key] = max(device_us.get(event.key, 0.0), device)
    split = {
        **_phase_split(host_us, device_us if on_device else None, target_forwards, wall_seconds),
        "host_syncs_per_forward": _counts(events, SYNC_EVENTS, forwards),
        "launches_per_forward": _counts(events, LAUNCH_EVENTS, forwards),
        "eager_attention_per_forward": sum(_counts(events, EAGER_ATTENTION_OPS, forwards).values()),
        "top_host_ops": _top(events, "self_cpu_time_total", forwards, top),
    }
    if on_device:
        on_gpu = [e for e in events if _on_gpu(e)]
        busy_us = sum(float(getattr(e, "self_device_time_total", 0.0) or 0.0) for e in on_gpu)
        split["device_busy_ms"] = busy_us / 1000.0 / forwards
        split["top_device_ops"] = _top(on_gpu, "self_device_time_total", forwards, top_device)
    return split


def _phase_split(
    host_us: dict[str, float],
    device_us: dict[str, float] | None,
    target_forwards: int,
    wall_seconds: float,
) -> dict:
    """Per target forward: wall ms, each phase's ``host_ms`` (and ``device_ms`` given
    ``device_us``) from the ranges' microseconds by name, and the uncovered rest."""
    forwards = max(1, target_forwards)
    phases: dict[str, dict[str, float]] = {}
    for phase, keys in PHASES.items():
        present = [key for key in keys if key in host_us]
        if not present:
            continue
        phases[phase] = {"host_ms": sum(host_us[k] for k in present) / 1000.0 / forwards}
        if device_us is not None:
            phases[phase]["device_ms"] = sum(device_us[k] for k in present) / 1000.0 / forwards
    wall_ms = 1000.0 * wall_seconds / forwards
    covered = sum(phases[p]["host_ms"] for p in TOP_LEVEL if p in phases)
    return {
        "target_forwards": target_forwards,
        "wall_ms_per_forward": wall_ms,
        "phases_per_forward": phases,
        "rest_host_ms": wall_ms - covered,
    }


def _on_gpu(event) -> bool:
    """A kernel, copy or memset on the GPU (not a host op, not a range's GPU annotation)."""
    device_type = str(getattr(event, "device_type", "CPU"))
    return not device_type.endswith("CPU") and not getattr(event, "is_user_annotation", False)


def _counts(events, keys: tuple[str, ...], forwards: int) -> dict[str, float]:
    return {e.key: e.count / forwards for e in events if e.key in keys}


def _top(events, attribute: str, forwards: int, top: int) -> list[dict]:
    """The ``top`` events by ``attribute`` (microseconds): name (cut to 120 characters), calls
    and ms per forward."""
    ranked = sorted(events, key=lambda e: float(getattr(e, attribute, 0.0) or 0.0), reverse=True)
    return [
        {
            "name": e.key[:120],
            "calls": e.count / forwards,
            "ms": float(getattr(e, attribute, 0.0) or 0.0) / 1000.0 / forwards,
        }
        for e in ranked[:top]
        if float(getattr(e, attribute, 0.0) or 0.0) > 0
    ]


def profiled_step_split(
    llm, prompts: list[list[int]], max_tokens: int, counters, temperature: float = 0.0
) -> dict:
    """``prompts`` (token ids) submitted together at ``temperature`` (per-request seeds) under
    torch.profiler on engine ``llm`` (which must run in this process:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU); their ``step_split``, with ``batch`` and
    ``temperature`` (target forwards: ``_generate``'s)."""
    import torch

    on_device = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        seconds, forwards = _generate(llm, prompts, max_tokens, temperature, counters)
    split = step_split(prof.key_averages(), forwards, seconds, on_device)
    return {"batch": len(prompts), "temperature": temperature, **split}


def host_phase_split(
    llm, prompts: list[list[int]], max_tokens: int, counters, temperature: float = 0.0
) -> dict:
    """The same requests as ``profiled_step_split`` without the profiler: each phase's host ms
    per target forward from the ranges' own timers (``vllm_ddtree.metrics.step_ranges.time_phases``;
    ``llm`` must run in this process), the wall ms per forward and the uncovered rest, with
    ``batch`` and ``temperature``."""
    from vllm_ddtree.metrics.step_ranges import phase_times, time_phases

    time_phases(True)
    try:
        seconds, forwards = _generate(llm, prompts, max_tokens, temperature, counters)
        times = phase_times()
    finally:
        time_phases(False)
    host_us = {name: 1e6 * spent for name, (spent, _) in times.items()}
    split = _phase_split(host_us, None, forwards, seconds)
    return {"batch": len(prompts), "temperature": temperature, **split}


KEPT_FUNCTION_MS = 0.01  # host_profile keeps every function of this cumulative ms per forward


def host_profile(
    llm,
    prompts: list[list[int]],
    max_tokens: int,
    counters,
    temperature: float = 0.0,
    top: int = 20,
) -> dict:
    """The same requests as ``profiled_step_split`` under cProfile (``llm`` must run in this
    process): per target forward, the ``top`` Python functions by own time and by cumulative
    time (ms, calls). Own time spent blocked (a wait for the device, a lock) shows in the C
    function that blocked: this finds the host work and the waits the device's idle time
    comes from. cProfile slows Python calls: compare functions, not its wall with ms/step."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        seconds, forwards = _generate(llm, prompts, max_tokens, temperature, counters)
    finally:
        profile.disable()
    functions = [
        {
            "function": _function_name(where),
            "calls": calls / forwards,
            "self_ms": 1000.0 * own / forwards,
            "cumulative_ms": 1000.0 * cumulative / forwards,
        }
        for where, (_, calls, own, cumulative, _) in pstats.Stats(profile).stats.items()
    ]
    return {
        "batch": len(prompts),
        "temperature": temperature,
        "target_forwards": forwards,
        "wall_ms_per_forward": 1000.0 * seconds / forwards,
        "top_self": sorted(functions, key=lambda f: -f["self_ms"])[:top],
        "top_cumulative": sorted(functions, key=lambda f: -f["cumulative_ms"])[:top],
        # Every function worth a look (the tables show the top; this finds the rest).
        "functions": sorted(
            (f for f in functions if f["cumulative_ms"] >= KEPT_FUNCTION_MS),
            key=lambda f: -f["cumulative_ms"],
        ),
    }


def _function_name(where: tuple[str, int, str]) -> str:
    """cProfile's ``(file, line, function)`` as ``package/module.py:line(function)``, the
    file from its package root on (``site-packages/`` or this repository's)."""
    path, line, function = where
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        for package in ("vllm_ddtree/", "tree_attn_backend/", "benchmarks/"):
            if package in path:
                path = package + path.split(package, 1)[1]
                break
    return f"{path}:{line}({function})" if line else function


def host_profile_table(engines: dict[str, dict], top: int = 12) -> list[str]:
    """Markdown lines: per engine with a ``host_profile``, its ``top`` functions by own time
    and by cumulative time per target forward."""
    lines = []
    for name, entry in engines.items():
        for profile in entry.get("host_profile") or []:
            if not lines:
                lines += [
                    "",
                    "## Host profile (cProfile, one run per engine)",
                    "",
                    "Per target forward: the Python functions with the most own time (waits "
                    "for the device show in the function that blocked) and the most cumulative "
                    "time. cProfile slows Python calls: compare functions, not walls.",
                ]
            lines += [
                "",
                f"{name}, batch {profile['batch']}, T = {profile['temperature']:g}, wall "
                f"{profile['wall_ms_per_forward']:.2f} ms per forward:",
                "",
                "| own ms | function | cumulative ms | function |",
                "| --- | --- | --- | --- |",
            ]
            pairs = zip(profile["top_self"][:top], profile["top_cumulative"][:top], strict=False)
            for own, total in pairs:
                lines.append(
                    f"| {own['self_ms']:.3f} | `{own['function']}` | "
                    f"{total['cumulative_ms']:.3f} | `{total['function']}` |"
                )
    return lines


def _generate(
    llm, prompts: list[list[int]], max_tokens: int, temperature: float, counters
) -> tuple[float, int]:
    """``prompts`` submitted together at ``temperature`` (request ``i`` seeded ``i``): the wall
    seconds and the target forwards, vLLM's engine steps (``ENGINE_STEPS``, one forward each,
    prefills included); without that metric, the drafts made (``counters(llm)``, vLLM's
    spec-decode counters) over the batch, else the longest output's tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens)
        for i in range(len(prompts))
    ]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    before, steps_before = counters(llm), engine_steps(llm)
    start = time.perf_counter()
    out = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = engine_steps(llm) - steps_before
    drafts = counters(llm).get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0
    )
    # Else: a step drafts once per running request (drafts / batch: exact at batch 1).
    longest = max(len(o.outputs[0].token_ids) for o in out)
    forwards = steps or (round(drafts / len(prompts)) if drafts else longest)
    return seconds, max(1, forwards)


def engine_steps(llm) -> int:
    """The steps engine ``llm`` has run (``ENGINE_STEPS``'s count; 0 without the metric)."""
    return sum(
        int(getattr(metric, "count", 0) or 0)
        for metric in llm.get_metrics()
        if metric.name == ENGINE_STEPS
    )


def split_table(engines: dict[str, dict]) -> list[str]:
    """Markdown lines: per batch and temperature, one row per engine with a split: the
    unprofiled host phases (``host_phases``: ``host_phase_split`` results), then the profiled
    split (``step_split``: ``profiled_step_split`` results, host ms per target forward with
    device ms in parentheses, the GPU's busy ms); none when no engine has one."""
    lines = _config_tables(
        engines,
        "host_phases",
        "## Host time per step (unprofiled: the ranges' own timers)",
        "Per target forward, host ms of each phase (as below) and the wall ms per forward; "
        f"{REST}: wall minus the phases. Without the profiler's slowdown: these walls are the "
        "bench's ms/step (prefills included).",
    )
    return lines + _config_tables(
        engines,
        "step_split",
        "## Step-time split (one run per batch and temperature under torch.profiler)",
        "Per target forward, host ms (device ms). draft: the drafter pass and the tree build "
        "(tree build: inside it, V1 only); walk: target tokens + tree walk; commit: the "
        f"accepted K/V; {REST}: wall minus those (the verify forward and vLLM's step); GPU "
        "busy: every kernel and copy (a wall far above it waits on the host); eager attn: "
        "vLLM's attention op called by the host per forward, once per attention layer in a "
        "forward outside a FULL CUDA graph (each request's prefill is one). The profiler "
        "slows the host: compare phases, not these walls with ms/step above.",
    )


def _config_tables(engines: dict[str, dict], key: str, title: str, legend: str) -> list[str]:
    measured = {name: e[key] for name, e in engines.items() if e.get(key)}
    if not measured:
        return []
    lines = ["", title, "", legend]
    configs = sorted(
        {(s["batch"], s["temperature"]) for splits in measured.values() for s in splits}
    )
    for batch, temperature in configs:
        lines += [
            "",
            f"Batch {batch}, T = {temperature:g}:",
            "",
            f"| engine | forwards | wall ms | GPU busy ms | eager attn | {' | '.join(PHASES)} "
            f"| {REST} |",
            "| --- | --- | --- | --- | --- |" + " --- |" * (len(PHASES) + 1),
        ]
        for name, splits in measured.items():
            for split in splits:
                if (split["batch"], split["temperature"]) == (batch, temperature):
                    lines.append(_split_row(name, split))
    return lines


def _split_row(name: str, split: dict) -> str:
    cells = []
    for phase in PHASES:
        value = split["phases_per_forward"].get(phase)
        if value is None:
            cells.append("")
        elif "device_ms" in value:
            cells.append(f"{value['host_ms']:.2f} ({value['device_ms']:.2f})")
        else:
            cells.append(f"{value['host_ms']:.2f}")
    busy = split.get("device_busy_ms")
    eager = split.get("eager_attention_per_forward")
    return (
        f"| {name} | {split['target_forwards']} | {split['wall_ms_per_forward']:.2f} | "
        + ("" if busy is None else f"{busy:.2f}")
        + " | "
        + ("" if eager is None else f"{eager:.1f}")
        + " | "
        + " | ".join(cells)
        + f" | {split['rest_host_ms']:.2f} |"
    )
