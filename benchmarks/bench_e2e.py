"""End-to-end speed on a GPU: the target alone (AR) vs DFlash chain vs DDTree, same drafter.

vLLM engines with CUDA graphs, bf16, one engine at a time in its own process. ``--compile
default`` keeps vLLM's defaults (torch.compile, FULL_AND_PIECEWISE graphs: what ``vllm serve``
runs; the V1 runner's DFlash drafter gets piecewise graphs); ``--compile graphs`` (no
torch.compile, full graphs of decode/verify batches only) starts engines faster. Each engine
runs the same measurements on held-out prompts (``benchmarks/prompts.py``'s eval sets, chat
template applied):
- batch 1: ``--batch1-prompts`` prompts of each set, one request at a time;
- batch b > 1: b prompts (round-robin over the sets) submitted together, ``max_num_seqs`` = b;
- T = 0 and T = 1 (per-request seeds), ``--max-tokens`` new tokens at most (EOS ends early).
Each measurement is repeated ``--repeats`` times after one untimed run per batch size and
temperature; the median output tokens/s is reported, with
time per output token, mean acceptance length (tokens per target forward) and the
accepted-depth histogram (vLLM's per-position acceptance counters, differenced). At T = 0 the
outputs of every engine are compared token by token with AR's (lossless on a real pair).
Last, on one GPU, each engine decodes at batch 1 (each temperature) and at the largest batch up
to 16 (T = 0) with the tree step's ranges timed on the host, then under torch.profiler: the
step-time split (``benchmarks/step_split.py``: draft, tree build, tree inputs, walk, commit,
the rest; unprofiled host ms, then the profiled split with the GPU's busy time, top operators).
``--resume`` keeps the engines an earlier run on the same GPU finished in ``--work``, so one
run can span several calls of a GPU lease.

Writes bench_e2e.json, bench_e2e.md and two plots (speedup over AR and acceptance length vs
budget) into --out.

    python -m benchmarks.bench_e2e --target DIR --drafter DIR --prompts prompts.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import ROOT, module_command
from benchmarks.fit_cost_profile import tree_engine_prefix
from benchmarks.step_split import (
    host_phase_split,
    profiled_step_split,
    split_table,
)
from vllm_ddtree import envs

DATASETS = ("humaneval", "mtbench", "sharegpt")
COMPILE_NOTES = {
    "graphs": "CUDA graphs (full, decode/verify batches; no torch.compile)",
    "default": "vLLM's default compilation (torch.compile, full + piecewise CUDA graphs)",
}


def metric_values(llm) -> dict:
    values = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            values[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", 0)
    return values


def timed_generate(
    llm,
    prompts,
    temperature: float,
    one_at_a_time: bool,
    max_tokens: int,
    request_seconds: list | None = None,
):
    """One measurement on ``llm``: ``prompts`` (token-id lists) at ``temperature`` (request
    ``i`` seeded ``i``), all at once or one request at a time. Returns the output token ids,
    the wall seconds and vLLM's spec-decode metrics before and after; one at a time, each
    request's own seconds are appended to ``request_seconds`` when given."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens)
        for i in range(len(prompts))
    ]
    before = metric_values(llm)
    start = time.perf_counter()
    if one_at_a_time:
        outs = []
        for p, sp in zip(prompts, params, strict=True):
            began = time.perf_counter()
            outs.append(llm.generate([TokensPrompt(prompt_token_ids=p)], [sp], use_tqdm=False)[0])
            if request_seconds is not None:
                request_seconds.append(time.perf_counter() - began)
    else:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
    seconds = time.perf_counter() - start
    after = metric_values(llm)
    return [list(o.outputs[0].token_ids) for o in outs], seconds, before, after


def graph_sizes(verify_width: int, max_seqs: int, drafter_width: int | None = None) -> list[int]:
    """CUDA-graph sizes (tokens): the target's verify batch at every running-batch size up to
    ``max_seqs`` (``verify_width`` tokens per request), and the drafter's query batches
    (``drafter_width`` tokens per request) on a ladder up to ``max_seqs``.

    Every verify size is there, not a ladder of them: vLLM's V2 graph manager sends a batch to
    the smallest captured size at least as large, and a FULL graph there serves it only if that
    size is a multiple of the verify width. With a ladder, a verify batch between two ladder
    sizes (15 requests x 17 tokens) landed on a drafter size (16 x 16 tokens) and ran
    piecewise (vLLM's ``dispatch``, tests/test_cost_model.py)."""
    ladder = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 96, 128]
    verify = {verify_width * b for b in range(1, max_seqs + 1)}
    drafter_width = drafter_width or verify_width
    drafter = {drafter_width * b for b in ladder if b <= max_seqs} | {drafter_width * max_seqs}
    return sorted(verify | drafter)


def split_configs(batches: list[int], temperatures: list[float]) -> list[tuple[int, float]]:
    """The (batch, temperature) runs profiled for the step-time split: batch 1 at every
    temperature, and the largest batch up to 16 at T = 0."""
    configs = [(1, t) for t in temperatures]
    larger = [b for b in batches if 1 < b <= 16]
    if larger and 0.0 in temperatures:
        configs.append((max(larger), 0.0))
    return configs


def measure_engine(job: dict, save=None) -> dict:
    """Child process: one engine, every measurement of the job; ``save(result)`` after each
    row, so that an engine stopped by its time limit still reports what it measured."""
    started = time.time()
    from transformers import AutoTokenizer
    from vllm import LLM

    from benchmarks.train_dflash import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(job["target"])
    prompt_sets = {
        name: [chat_ids(tokenizer, p)[-1024:] for p in texts]
        for name, texts in job["prompts"].items()
    }
    width = job["tokens_per_request"]
    max_seqs = max(job["batches"])
    # Full graphs for every running-batch size up to the largest (finished requests shrink a
    # batch; padding 15 requests up to 64 would distort the timing), for the target's verify
    # width and for the drafter's (1 + depth query tokens per request: vLLM's DFlash graphs
    # are whole drafter batches within the largest size, so sizes for 1 + budget alone leave a
    # narrower tree's drafter without graphs).
    drafter_width = job.get("drafter_tokens_per_request") or width
    widths = {width, drafter_width}
    sizes = graph_sizes(width, max_seqs, drafter_width)
    compilation_config = {"cudagraph_capture_sizes": sizes}
    if job["compile"] == "graphs":
        compilation_config.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")
    llm = LLM(
        model=job["target"],
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(8192, max(widths) * max_seqs),
        gpu_memory_utilization=0.5,
        seed=0,
        disable_log_stats=False,
        compilation_config=compilation_config,
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        **job["kwargs"],
    )
    rows = []
    outputs_t0: dict[str, list[list[int]]] = {}

    def run(prompts: list[list[int]], temperature: float, one_at_a_time: bool):
        return timed_generate(llm, prompts, temperature, one_at_a_time, job["max_tokens"])

    run([prompt_sets[DATASETS[0]][0]], 0.0, True)  # warm-up
    config = llm.llm_engine.vllm_config
    extras: dict = {"device_id": device_id()}

    def result() -> dict:
        return {
            "rows": rows,
            "outputs_t0": outputs_t0,
            "runner": "V2" if config.use_v2_model_runner else "V1",
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
            **extras,
        }

    for temperature in job["temperatures"]:
        for batch in job["batches"]:
            if batch == 1:
                groups = {name: ps[: job["batch1_prompts"]] for name, ps in prompt_sets.items()}
            else:
                sets = list(prompt_sets.values())
                mixed = [
                    sets[i % len(sets)][(i // len(sets)) % len(sets[i % len(sets)])]
                    for i in range(batch)
                ]
                groups = {"mixed": mixed}
            warmed = False
            for name, prompts in groups.items():
                if time.time() - started > job["time_limit"]:
                    print(f"time limit: skipped {name} batch {batch} T={temperature}", flush=True)
                    continue
                if not warmed:
                    # Untimed, once per batch size and temperature: the kernels this batch's
                    # shapes and sampling need are compiled before the first timed repeat.
                    run(prompts, temperature, batch == 1)
                    warmed = True
                samples = []
                for repeat in range(job["repeats"]):
                    tokens, seconds, before, after = run(prompts, temperature, batch == 1)
                    if temperature == 0 and repeat == 0:
                        outputs_t0[f"{name}_b{batch}"] = tokens
                    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
                        "vllm:spec_decode_num_drafts", 0
                    )
                    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
                        "vllm:spec_decode_num_accepted_tokens", 0
                    )
                    per_pos_after = after.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
                    per_pos_before = before.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [
                        0
                    ] * len(per_pos_after)
                    produced = sum(map(len, tokens))
                    samples.append(
                        {
                            "tokens": produced,
                            "seconds": seconds,
                            "tok_per_s": produced / seconds,
                            "drafts": drafts,
                            "accepted": accepted,
                            "accepted_per_depth": [
                                a - b for a, b in zip(per_pos_after, per_pos_before, strict=False)
                            ],
                        }
                    )
                median = statistics.median(s["tok_per_s"] for s in samples)
                drafts = sum(s["drafts"] for s in samples)
                accepted = sum(s["accepted"] for s in samples)
                per_depth = [s["accepted_per_depth"] for s in samples]
                depth = [sum(col) for col in zip(*per_depth, strict=False)]
                rows.append(
                    {
                        "dataset": name,
                        "batch": batch,
                        "temperature": temperature,
                        "tok_per_s": median,
                        "ms_per_token_per_request": 1000.0 * batch / median,
                        "runs_tok_per_s": [round(s["tok_per_s"], 1) for s in samples],
                        "output_tokens": samples[0]["tokens"],
                        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                        "accepted_depth_histogram": depth,
                    }
                )
                print(json.dumps({"engine": job["name"], **rows[-1]}), flush=True)
                if save is not None:
                    save(result())
    # The step-time split needs the engine in this process (one GPU: at tensor parallel the
    # model runs in worker processes, which this profiler does not see).
    in_process = job.get("tensor_parallel_size", 1) == 1
    if job.get("step_split", True) and in_process:
        extras["host_phases"], extras["step_split"] = [], []
        for batch, temperature in split_configs(job["batches"], job["temperatures"]):
            if time.time() - started > job["time_limit"]:
                print(f"time limit: skipped the step-time split {batch} {temperature}", flush=True)
                continue
            sets = list(prompt_sets.values())
            prompts = [sets[i % len(sets)][i // len(sets)] for i in range(batch)]
            tokens = min(job["max_tokens"], 128)
            # The phases' host time unprofiled (their own timers), then under the profiler.
            extras["host_phases"].append(
                host_phase_split(llm, prompts, tokens, metric_values, temperature)
            )
            extras["step_split"].append(
                profiled_step_split(llm, prompts, tokens, metric_values, temperature)
            )
            print(json.dumps({"engine": job["name"], **extras}), flush=True)
            if save is not None:
                save(result())
    extras["complete"] = True
    return result()


def device_id() -> str:
    """This process's GPU: its UUID (engines resumed from an earlier call must have run on
    the same GPU), else "cpu"."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return str(torch.cuda.get_device_properties(0).uuid)


def finished_result(job: dict, work: str, device: str) -> dict | None:
    """``--resume``: the complete result of this same job (its time limit aside) left in
    ``work`` by an earlier run on GPU ``device``, else None."""
    path = os.path.join(work, f"{job['name']}.job.json")
    try:
        with open(path) as f:
            earlier = json.load(f)
        with open(path + ".result") as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    same = {k: v for k, v in json.loads(json.dumps(job)).items() if k != "time_limit"}
    earlier.pop("time_limit", None)
    if earlier != same or not result.get("complete") or result.get("device_id") != device:
        return None
    result["resumed"] = True
    return result


def run_child(job: dict, work: str, timeout: int) -> dict:
    path = os.path.join(work, f"{job['name']}.job.json")
    with open(path, "w") as f:
        json.dump(job, f)
    log_path = os.path.join(work, f"{job['name']}.log")
    if os.path.exists(path + ".result"):
        os.remove(path + ".result")  # a stale result from an earlier run
    start = time.time()
    timed_out = False
    with open(log_path, "w") as log:
        try:
            subprocess.run(
                [*module_command("bench_e2e"), "--child", path],
                cwd=ROOT,
                env={**os.environ, **job.get("env", {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            timed_out = True
    try:
        with open(path + ".result") as f:
            result = json.load(f)
        if timed_out:
            result["error"] = "stopped by the per-engine time limit (rows measured until then)"
    except OSError:
        with open(log_path) as f:
            log_text = f.read()
        first = next((ln for ln in log_text.splitlines() if "Error" in ln), "")
        if timed_out:  # killed before its first row: say so, not only the log's last lines
            first = f"stopped by the per-engine time limit ({timeout} s) before any row. {first}"
        result = {"error": f"{first[:400]} ... {log_text[-800:]}", "rows": []}
    result["wall_seconds"] = time.time() - start
    if not timed_out and result.get("complete"):
        with open(path + ".result", "w") as f:  # with its wall time, for --resume
            json.dump(result, f)
    print(
        f"[{time.strftime('%H:%M:%S')}] {job['name']}: {result['wall_seconds']:.0f} s", flush=True
    )
    return result


README_BEGIN = "<!-- bench_e2e headline: generated by benchmarks/bench_e2e.py --readme -->"
README_END = "<!-- /bench_e2e headline -->"


def engine_row(engines: dict, name: str, dataset: str, batch: int, temperature: float):
    """The row engine ``name`` measured for ``(dataset, batch, temperature)``, or None."""
    key = (dataset, batch, temperature)
    rows = engines.get(name, {}).get("rows", [])
    return next((r for r in rows if (r["dataset"], r["batch"], r["temperature"]) == key), None)


def tree_runner_note(summary: dict, name: str) -> str:
    """`` (V2 runner)`` for a DDTree engine that ran on vLLM's V2 model runner (the runner each
    engine reported, else its name), else ``""`` (DDTree's default runner is V1)."""
    runner = summary["engines"].get(name, {}).get("runner")
    on_v2 = runner == "V2" if runner else name.startswith("ddtree_v2_")
    return " (V2 runner)" if name.startswith("ddtree_") and on_v2 else ""


def headline_table(
    summary: dict, rows_link: str = "benchmarks/results/2026-11-30_bfbb8da_speed-v1/bench_e2e.md"
) -> str:
    """Markdown: batch 1, T = 0, per dataset: AR, the DFlash chain (V2 runner) and the fastest
    DDTree budget, with speedups over AR and DDTree over the chain (``rows_link``: the full
    table)."""
    engines = summary["engines"]

    def row_of(name: str, dataset: str):
        return engine_row(engines, name, dataset, 1, 0)

    lines = [
        f"Batch 1, T = 0, {summary['gpu']}, commit {str(summary['commit'])[:7]} "
        f"([all rows]({rows_link})): output tok/s (acceptance length).",
        "",
        "| prompts | AR | DFlash chain | DDTree (best budget) | DDTree / chain "
        '| DDTree "auto" (the default) / chain |',
        "| --- | --- | --- | --- | --- | --- |",
    ]
    # What "auto" serves now (the packaged profile and rule), as measured in that run; the run's
    # JSON also records what it served then ("auto").
    auto = {
        r["dataset"]: r
        for r in auto_choice_rows(summary)
        if (r["batch"], r["temperature"]) == (1, 0)
    }
    for dataset in DATASETS:
        ar, chain = row_of("ar", dataset), row_of("dflash", dataset)
        trees = [(name, row_of(name, dataset)) for name in engines if name.startswith("ddtree_")]
        trees = [(name, r) for name, r in trees if r is not None]
        if ar is None or chain is None or not trees:
            continue
        name, best = max(trees, key=lambda item: item[1]["tok_per_s"])

        def cell(r, base):
            return (
                f"{r['tok_per_s']:.0f} ({r['mean_acceptance_length']:.2f}), "
                f"{r['tok_per_s'] / base['tok_per_s']:.2f}x AR"
            )

        chosen = auto.get(dataset)
        auto_cell = (
            f"{chosen['auto_over_chain']:.2f} ({chosen['auto_serves']})"
            if chosen and chosen["auto_over_chain"] is not None
            else "not measured"
        )
        lines.append(
            f"| {dataset} | {ar['tok_per_s']:.0f} | {cell(chain, ar)} | "
            f"{cell(best, ar)}, budget {name.rsplit('_b', 1)[1]}"
            f"{tree_runner_note(summary, name)} | "
            f"{best['tok_per_s'] / chain['tok_per_s']:.2f} | {auto_cell} |"
        )
    return "\n".join(lines)


def replace_marked_block(path: str, begin: str, end: str, body: str) -> None:
    """Rewrite the text between the marker lines ``begin`` and ``end`` in file ``path`` with
    ``body`` (a generated table); exits naming the markers when the file lacks them."""
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no '{begin}' ... '{end}' block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{body}\n{end}{tail}")


def update_readme(readme: str, summary: dict, rows_link: str) -> None:
    """Replace the block between ``README_BEGIN`` and ``README_END`` in ``readme`` (the
    headline of ``summary``; ``rows_link``: its full table, relative to the README)."""
    replace_marked_block(readme, README_BEGIN, README_END, headline_table(summary, rows_link))


def auto_choice_rows(summary: dict) -> list[dict]:
    """What ``"tree_budget": "auto"`` serves at each batch size the chain was measured at:
    ``choose_automatic`` with the packaged cost profile of the DDTree engines' runner (V2 when
    the run has V2 tree engines) at the run's tensor parallel size and ``max_num_seqs`` = the
    batch, and that engine's measured tok/s
    beside the chain's (one dict per chain row; ``auto_tok_per_s`` None when the chosen budget
    was not measured in this run)."""
    from vllm_ddtree.budget.cost_model import choose_automatic

    engines = summary["engines"]
    on_v2 = any(name.startswith("ddtree_v2_b") for name in engines)
    prefix = "ddtree_v2_b" if on_v2 else "ddtree_b"
    runner, tp = ("V2" if on_v2 else "V1"), summary.get("tensor_parallel_size", 1)
    rows = []
    for chain in engines.get("dflash", {}).get("rows", []):
        key = (chain["dataset"], chain["batch"], chain["temperature"])
        budget, _, _ = choose_automatic(chain["batch"], runner, tp)
        name = "dflash" if budget is None else f"{prefix}{budget}"
        chosen = engine_row(engines, name, *key)
        auto = chosen["tok_per_s"] if chosen else None
        rows.append(
            {
                "dataset": key[0],
                "batch": key[1],
                "temperature": key[2],
                "auto_serves": name,
                "auto_tok_per_s": auto,
                "chain_tok_per_s": chain["tok_per_s"],
                "auto_over_chain": auto / chain["tok_per_s"] if auto else None,
            }
        )
    return rows


def auto_choice_table(summary: dict) -> list[str]:
    """Markdown lines of ``auto_choice_rows``."""
    lines = [
        "",
        '## "tree_budget": "auto" (the default)',
        "",
        "The engine the packaged cost profile chooses at `max_num_seqs` = batch (`dflash`: the "
        "DFlash chain itself), its tok/s in this run, and the chain's.",
        "",
        "| dataset | batch | T | auto serves | tok/s | chain tok/s | auto / chain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in auto_choice_rows(summary):
        measured = r["auto_tok_per_s"] is not None
        lines.append(
            f"| {r['dataset']} | {r['batch']} | {r['temperature']:g} | {r['auto_serves']} | "
            + (f"{r['auto_tok_per_s']:.0f}" if measured else "not measured")
            + f" | {r['chain_tok_per_s']:.0f} | "
            + (f"{r['auto_over_chain']:.2f}" if measured else "")
            + " |"
        )
    return lines


def write_report(summary: dict, out: str) -> None:
    """Markdown tables and PNG plots from the JSON summary."""
    engines = summary["engines"]
    ar = {
        (r["dataset"], r["batch"], r["temperature"]): r
        for r in engines.get("ar", {}).get("rows", [])
    }
    lines = [
        "# End-to-end speed: AR vs DFlash chain vs DDTree",
        "",
        f"Commit {summary['commit']}, {summary['gpu']}, target {summary['target_name']}, drafter "
        f"{summary['drafter_name']}"
        + (
            f" (weights sha256 {summary['drafter_sha256'][:12]})"
            if summary.get("drafter_sha256")
            else ""
        )
        + (
            f"; tensor parallel {summary['tensor_parallel_size']}"
            if summary.get("tensor_parallel_size", 1) > 1
            else ""
        )
        + f"; bf16, {COMPILE_NOTES[summary.get('compile', 'graphs')]}, "
        f"median of {summary['repeats']} runs, up to {summary['max_tokens']} new tokens.",
        "",
        summary.get("note", ""),
        "",
        "ms/step: wall time per target forward (batch x acceptance length / tok/s).",
        "",
        "| engine | dataset | batch | T | tok/s | speedup vs AR | acceptance length | ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in engines.items():
        for r in result["rows"]:
            base = ar.get((r["dataset"], r["batch"], r["temperature"]))
            speedup = r["tok_per_s"] / base["tok_per_s"] if base else float("nan")
            lines.append(
                f"| {name}{tree_runner_note(summary, name)} | {r['dataset']} | {r['batch']} | "
                f"{r['temperature']:g} | "
                f"{r['tok_per_s']:.0f} | {speedup:.2f} | {r['mean_acceptance_length']:.2f} | "
                f"{1000 * r['batch'] * r['mean_acceptance_length'] / r['tok_per_s']:.1f} |"
            )
        if result.get("error"):
            lines.append(f"| {name} | error: {result['error'][:200]!r} | | | | | | |")
    lines += auto_choice_table(summary)
    lines += split_table(engines)
    lines += ["", "## T = 0 outputs vs AR", ""]
    for name, verdict in summary["identical_to_ar"].items():
        lines.append(f"- {name}: {verdict}")
    with open(os.path.join(out, "bench_e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    # One DDTree family per plot: the V1 engines when the run has them, else the V2 ones.
    prefix = tree_engine_prefix(engines)
    budgets = sorted(b for b in summary["budgets"] if engines.get(f"{prefix}{b}", {}).get("rows"))
    if not budgets:
        return  # nothing to plot yet (written again after every engine)
    for metric, file_name, label in (
        ("speedup", "bench_e2e_speedup.png", "speedup over AR (tok/s ratio)"),
        ("mean_acceptance_length", "bench_e2e_acceptance.png", "mean acceptance length"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        keys = sorted(
            {
                (r["dataset"], r["batch"])
                for r in engines.get("ar", {}).get("rows", [])
                if r["temperature"] == 0
            }
        )
        for dataset, batch in keys:
            ys = []
            for b in budgets:
                row = engine_row(engines, f"{prefix}{b}", dataset, batch, 0)
                if row is None:
                    ys.append(float("nan"))
                elif metric == "speedup":
                    ys.append(row["tok_per_s"] / ar[(dataset, batch, 0)]["tok_per_s"])
                else:
                    ys.append(row[metric])
            line = ax.plot(budgets, ys, marker="o", label=f"DDTree {dataset} b{batch}")[0]
            chain = engine_row(engines, "dflash", dataset, batch, 0)
            if chain:
                value = (
                    chain["tok_per_s"] / ar[(dataset, batch, 0)]["tok_per_s"]
                    if metric == "speedup"
                    else chain[metric]
                )
                ax.axhline(value, color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (nodes); dashed: DFlash chain")
        ax.set_ylabel(label)
        ax.set_title(f"T = 0, {summary['gpu']}")
        ax.legend(fontsize=7)
        try:
            fig.tight_layout()
            fig.savefig(os.path.join(out, file_name), dpi=110)
        except ValueError as error:  # a plot must never stop the measurements
            print(f"plot {file_name} skipped: {error}", flush=True)
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--prompts")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work", default="/tmp/vllm-ddtree-bench")
    parser.add_argument("--budgets", default="64,16,256")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch1-prompts", type=int, default=2)
    parser.add_argument("--engine-timeout", type=int, default=110)
    parser.add_argument("--deadline", type=int, default=540, help="seconds for all engines")
    parser.add_argument(
        "--engine-min",
        type=int,
        default=60,
        help="seconds an engine needs at least: none starts with less of the deadline left",
    )
    parser.add_argument("--compile", choices=sorted(COMPILE_NOTES), default="default")
    parser.add_argument("--skip", default="", help="engine names to leave out, e.g. dflash_v1")
    parser.add_argument(
        "--no-step-split",
        action="store_true",
        help="leave out the profiled request of each engine (the step-time split)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallel size of every engine (a target and drafter whose heads it divides, "
        "e.g. from benchmarks/pad_heads.py); the plugin runs DDTree on V2 there too",
    )
    parser.add_argument(
        "--ddtree-runner",
        choices=("v1", "v2", "both"),
        default="v2",
        help="vLLM runner of the DDTree engines (v2: ddtree_v2_bN, the plugin's choice for a "
        "dense GPU target; v1: ddtree_bN; both)",
    )
    parser.add_argument("--readme", help="rewrite this file's headline block from --readme-from")
    parser.add_argument(
        "--readme-from", default="benchmarks/results/2026-11-30_bfbb8da_speed-v1/bench_e2e.json"
    )
    parser.add_argument(
        "--report-from",
        help="write the markdown table and plots again from this bench_e2e.json (next to it)",
    )
    parser.add_argument(
        "--collect",
        help="rebuild the results from the engines' logs in this folder (a run cut short)",
    )
    parser.add_argument("--device-name", default="unknown", help="with --collect")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the complete results of engines an earlier run left in --work on this GPU "
        "(same job) and run only the others: one run over several calls of a lease",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.child:

        def save(result: dict) -> None:
            with open(args.child + ".result.tmp", "w") as f:
                json.dump(result, f)
            os.replace(args.child + ".result.tmp", args.child + ".result")

        with open(args.child) as f:
            save(measure_engine(json.load(f), save))
        return 0

    if args.readme:
        with open(args.readme_from) as f:
            summary = json.load(f)
        rows = os.path.join(os.path.dirname(args.readme_from), "bench_e2e.md")
        update_readme(args.readme, summary, os.path.relpath(rows, os.path.dirname(args.readme)))
        return 0
    if args.report_from:
        with open(args.report_from) as f:
            write_report(json.load(f), os.path.dirname(args.report_from) or ".")
        return 0
    if args.collect:
        return collect(args)
    if not (args.target and args.drafter and args.prompts):
        parser.error("--target, --drafter and --prompts are required")

    os.makedirs(args.work, exist_ok=True)
    with open(args.prompts) as f:
        eval_sets = json.load(f)["eval"]
    budgets = [int(b) for b in args.budgets.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {name: eval_sets[name][: max(batches)] for name in DATASETS}
    with open(os.path.join(args.drafter, "config.json")) as f:
        depth = json.load(f).get("block_size", 16) - 1
    common = {
        "target": args.target,
        "prompts": prompts,
        "batches": batches,
        "temperatures": [float(t) for t in args.temperatures.split(",")],
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "batch1_prompts": args.batch1_prompts,
        "compile": args.compile,
        "tensor_parallel_size": args.tp,
        "step_split": not args.no_step_split,
        # Measurements stop starting after this; the engine's process still reports.
        # (from the engine process's start, engine start included).
        "time_limit": max(10, args.engine_timeout - 25),
    }
    jobs = [
        {"name": "ar", "kwargs": {}, "tokens_per_request": 1},
        {
            "name": "dflash",
            "kwargs": {
                "speculative_config": {
                    "method": "dflash",
                    "model": args.drafter,
                    "num_speculative_tokens": depth,
                }
            },
            "tokens_per_request": 1 + depth,
            "drafter_tokens_per_request": 1 + depth,
        },
    ]
    ddtree = [
        {
            "name": f"ddtree_b{b}",
            "kwargs": {
                "speculative_config": {"method": "ddtree", "model": args.drafter, "tree_budget": b}
            },
            "tokens_per_request": 1 + b,
            "drafter_tokens_per_request": 1 + depth,
        }
        for b in budgets
    ]
    # DDTree on vLLM's V2 model runner (the plugin's choice here) and/or V1; the chain also on
    # V1, for a same-runner ratio.
    v2_env = {"VLLM_DDTREE_RUNNER": "v2"}
    ddtree = [{**job, "env": {"VLLM_DDTREE_RUNNER": "v1"}} for job in ddtree]
    if args.ddtree_runner == "v2":
        ddtree = [
            {**job, "name": job["name"].replace("ddtree_", "ddtree_v2_"), "env": v2_env}
            for job in ddtree
        ]
    elif args.ddtree_runner == "both":
        ddtree += [
            {**job, "name": job["name"].replace("ddtree_", "ddtree_v2_"), "env": v2_env}
            for job in ddtree
        ]
    chain_v1 = {**jobs[1], "name": "dflash_v1", "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
    jobs = jobs + ddtree + [chain_v1]
    skipped = set(args.skip.split(",")) if args.skip else set()
    jobs = [job for job in jobs if job["name"] not in skipped]
    engines: dict[str, dict] = {}
    started = time.time()
    device = device_id() if args.resume else ""
    failed: list[str] = []
    for job in jobs:
        earlier = finished_result({**common, **job}, args.work, device) if args.resume else None
        if earlier is not None:
            print(f"{job['name']}: resumed from an earlier run on this GPU", flush=True)
            engines[job["name"]] = earlier
            failed = summarize(engines, args, budgets, batches, started)
            continue
        left = args.deadline - (time.time() - started)
        if left < max(60, args.engine_min):
            engines[job["name"]] = {"error": "skipped: the run's deadline", "rows": []}
            continue
        timeout = int(min(args.engine_timeout, left - 15))
        engines[job["name"]] = run_child({**common, **job}, args.work, timeout)
        # Written after every engine, so that a run cut short still leaves its results.
        failed = summarize(engines, args, budgets, batches, started)
    return 1 if failed else 0


def collect(args) -> int:
    """Results of a run whose parent was cut short, from the rows each engine printed.

    An engine's log holds one JSON row per finished measurement; an engine that stopped early
    keeps the rows it finished and the first error line of its log. T = 0 outputs are not in
    the logs, so nothing is compared with AR.
    """
    engines: dict[str, dict] = {}
    for name in sorted(os.listdir(args.collect)):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(args.collect, name)) as f:
            lines = f.read().splitlines()
        rows = []
        for line in lines:
            if line.startswith('{"engine"'):
                row = json.loads(line)
                row.pop("engine")
                rows.append(row)
        error = next((ln for ln in lines if "Error" in ln and "[rank0]" in ln), None)
        engine = name[: -len(".log")]
        engines[engine] = {"rows": rows}
        if error:
            engines[engine]["error"] = error[:400]
        elif not any("Graph capturing finished" in ln for ln in lines) or len(rows) < 8:
            engines[engine]["error"] = "stopped by the per-engine time limit"
    ordered = {k: engines[k] for k in ("ar", "dflash", "dflash_v1") if k in engines}
    ordered.update({k: v for k, v in engines.items() if k not in ordered})
    prefix = tree_engine_prefix(ordered)
    budgets = sorted(int(k.removeprefix(prefix)) for k in ordered if k.startswith(prefix))
    args.target = args.target or "SmolLM2-135M-Instruct"
    args.drafter = args.drafter or "unknown"
    note = (
        f"Collected from the engines' logs after the run was cut short (device: "
        f"{args.device_name}); rows missing from an engine were not measured."
    )
    summarize(ordered, args, budgets, [int(b) for b in args.batches.split(",")], time.time(), note)
    return 0


def weights_sha256(checkpoint: str) -> str | None:
    """sha256 of a checkpoint folder's ``model.safetensors`` (None when there is none)."""
    import hashlib

    path = os.path.join(checkpoint, "model.safetensors")
    if not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def compare_with_ar(engines: dict[str, dict]) -> dict[str, str]:
    """T = 0 outputs of every engine vs AR's, prompt by prompt."""
    from vllm_ddtree.demo import first_divergence

    reference = engines.get("ar", {}).get("outputs_t0", {})
    verdicts = {}
    for name, result in engines.items():
        if name == "ar":
            continue
        outputs = result.get("outputs_t0", {})
        mismatches = []
        for key, want in reference.items():
            for p, (got, ref) in enumerate(zip(outputs.get(key, []), want, strict=False)):
                where = first_divergence(got, ref)
                if where is not None:
                    mismatches.append(f"{key}[{p}]@{where}")
        compared = sum(len(v) for k, v in outputs.items() if k in reference)
        if not compared:
            verdicts[name] = "not compared (no output)"
        elif mismatches:
            verdicts[name] = f"differs: {mismatches[:8]} ({len(mismatches)} of {compared})"
        else:
            verdicts[name] = f"identical ({compared} sequences)"
    return verdicts


def summarize(engines, args, budgets, batches, started, note: str = "") -> list[str]:
    """Write bench_e2e.json/.md/.png; return the engines that failed or differ from AR."""
    import torch

    identical = compare_with_ar(engines)
    summary = {
        "commit": envs.commit() or "unknown",
        "gpu": (
            args.device_name
            if args.collect
            else torch.cuda.get_device_name()
            if torch.cuda.is_available()
            else "cpu"
        ),
        "note": note,
        "device_id": "" if args.collect else device_id(),
        "target_name": os.path.basename(os.path.normpath(args.target)),
        "drafter_name": os.path.basename(os.path.normpath(args.drafter)),
        # Which weights were measured (the drafter may sit in a scratch folder on the host).
        "drafter_sha256": weights_sha256(args.drafter),
        "budgets": budgets,
        "batches": batches,
        "repeats": args.repeats,
        "compile": args.compile,
        "tensor_parallel_size": args.tp,
        "max_tokens": args.max_tokens,
        "engines": {
            k: {kk: vv for kk, vv in v.items() if kk != "outputs_t0"} for k, v in engines.items()
        },
        "identical_to_ar": identical,
        "wall_seconds": time.time() - started,
    }
    summary["auto"] = auto_choice_rows(summary)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_e2e.json"), "w") as f:
        json.dump(summary, f, indent=1)
    write_report(summary, args.out)
    failed = [n for n, r in engines.items() if r.get("error")]
    failed += [n for n, v in identical.items() if not v.startswith("identical")]
    return failed


if __name__ == "__main__":
    sys.exit(main())
