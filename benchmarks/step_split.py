"""Where a decode step's time goes, in the end-to-end bench: one request under torch.profiler.

DDTree's step opens ``ddtree::*`` profiler ranges (``vllm_ddtree/profiling.py``; free when no
profiler records): ``ddtree::draft`` (the drafter pass and the tree build; on the V2 runner one
CUDA graph holds both), ``ddtree::build_trees`` (the tree build, inside ``draft``; V1 only),
``ddtree::prepare_tree_inputs`` (positions, ancestor masks, slots), ``ddtree::target_tokens``
and ``ddtree::follow_tree`` (the walk), ``ddtree::commit_kv`` (the accepted nodes' K/V). What
no range covers, the wall time per target forward minus the top-level phases' host time, is
the target's verify forward and vLLM's own step (scheduler, sampler, outputs).

Host ms is the range's wall time on the host (waits for the device included); device ms is
the time the GPU spent in it (the profiler's device total). The profiler slows the host, so
the wall time here is above the bench's unprofiled ms/step; compare phases with each other.
"""

from __future__ import annotations

import time

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


def step_split(events, target_forwards: int, wall_seconds: float, on_device: bool) -> dict:
    """Per target forward: the profiled wall ms, each phase's host (and, ``on_device``, device)
    ms, and ``REST``, from ``events`` (torch.profiler's ``key_averages()``: ``key``, ``count``,
    ``cpu_time_total`` and ``device_time_total`` in microseconds). A range can appear twice
    (its host entry and its GPU annotation): each range counts its largest host and device
    totals once."""
    forwards = max(1, target_forwards)
    host_us: dict[str, float] = {}
    device_us: dict[str, float] = {}
    for event in events:
        host_us[event.key] = max(host_us.get(event.key, 0.0), float(event.cpu_time_total))
        device = float(getattr(event, "device_time_total", 0.0) or 0.0)
        device_us[event.key] = max(device_us.get(event.key, 0.0), device)
    phases: dict[str, dict[str, float]] = {}
    for phase, keys in PHASES.items():
        present = [key for key in keys if key in host_us]
        if not present:
            continue
        phases[phase] = {"host_ms": sum(host_us[k] for k in present) / 1000.0 / forwards}
        if on_device:
            phases[phase]["device_ms"] = sum(device_us[k] for k in present) / 1000.0 / forwards
    wall_ms = 1000.0 * wall_seconds / forwards
    covered = sum(phases[p]["host_ms"] for p in TOP_LEVEL if p in phases)
    return {
        "target_forwards": target_forwards,
        "wall_ms_per_forward": wall_ms,
        "phases_per_forward": phases,
        "rest_host_ms": wall_ms - covered,
    }


def profiled_step_split(llm, prompt: list[int], max_tokens: int, counters) -> dict:
    """One request of ``prompt`` (token ids), T = 0, under torch.profiler on engine ``llm``
    (which must run in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU); its
    ``step_split``. ``counters(llm)`` reads vLLM's metrics (target forwards: the drafts made,
    else one per output token)."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    on_device = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = counters(llm)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [params], use_tqdm=False)
    seconds = time.perf_counter() - start
    drafts = counters(llm).get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0
    )
    forwards = int(drafts) or len(out[0].outputs[0].token_ids)
    return step_split(prof.key_averages(), forwards, seconds, on_device)


def split_table(engines: dict[str, dict]) -> list[str]:
    """Markdown lines: one row per engine with a ``step_split`` (host ms per target forward,
    device ms in parentheses); none when no engine has one."""
    measured = {name: e["step_split"] for name, e in engines.items() if e.get("step_split")}
    if not measured:
        return []
    lines = [
        "",
        "## Step-time split (batch 1, T = 0, one request under torch.profiler)",
        "",
        "Per target forward, host ms (device ms). draft: the drafter pass and the tree build "
        "(tree build: inside it, V1 only); walk: target tokens + tree walk; commit: the "
        f"accepted K/V; {REST}: wall minus those (the verify forward and vLLM's step). The "
        "profiler slows the host: compare phases, not these walls with ms/step above.",
        "",
        f"| engine | forwards | wall ms | {' | '.join(PHASES)} | {REST} |",
        "| --- | --- | --- |" + " --- |" * (len(PHASES) + 1),
    ]
    for name, split in measured.items():
        cells = []
        for phase in PHASES:
            value = split["phases_per_forward"].get(phase)
            if value is None:
                cells.append("")
            elif "device_ms" in value:
                cells.append(f"{value['host_ms']:.2f} ({value['device_ms']:.2f})")
            else:
                cells.append(f"{value['host_ms']:.2f}")
        lines.append(
            f"| {name} | {split['target_forwards']} | {split['wall_ms_per_forward']:.2f} | "
            + " | ".join(cells)
            + f" | {split['rest_host_ms']:.2f} |"
        )
    return lines
