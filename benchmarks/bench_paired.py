"""Paired speed on a GPU: the DFlash chain, DDTree and AR run by turns, ratios of adjacent runs.

``bench_e2e.py`` measures one engine after another, minutes apart; on a host-bound step (a
small target at small batches) the host's speed drifts within a run and moves whole engines
(benchmarks/results/README.md, 7de7dbb: one engine's phases all 1.5x slower). Here every engine
lives in its own process, all started at once and kept; each measurement (the same prompts,
temperature and batch) runs on every engine in turn, the order rotating per repeat, so each
ratio to the chain compares runs seconds apart. Reported per row: each engine's median tok/s
and acceptance length, and per engine the median (and range) of its per-repeat ratio to the
chain; what ``"tree_budget": "auto"`` serves at ``max_num_seqs`` = batch (the packaged profile
of DDTree's runner, or ``--cost-profile``) is marked. With ``--online-auto`` the marked engine is
"auto" itself, an engine of its own that moves its budget online (``budget/online.py``), held
against the chain and each row's fastest fixed budget.

Engines: ``ar``, ``dflash`` and DDTree on the V2 runner at every budget ``"auto"`` picks over
the batches, plus ``--budgets``, less ``--skip``. Rows as in bench_e2e.py: batch 1 per prompt
set (``--batch1-prompts`` each, one request at a time), larger batches on mixed prompts, at
every temperature. Writes bench_paired.json and bench_paired.md into --out after every row;
``python -m benchmarks fit-profile bench_paired.json --out profile.json`` fits a cost profile
from a run's T = 0 rows.

    python -m benchmarks paired --target DIR --drafter DIR --prompts prompts.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

from benchmarks.bench_e2e import (
    DATASETS,
    device_id,
    graph_sizes,
    replace_marked_block,
    timed_generate,
    weights_sha256,
)
from vllm_ddtree import envs

CHAIN = "dflash"
AUTO = "ddtree_v2_auto"  # the engine of "tree_budget": "auto" (``auto_job``)


def engine_jobs(
    drafter: str, depth: int, budgets: list[int], max_seqs: int, runner: str = "v2"
) -> list[dict]:
    """One job per engine (name, vLLM keyword arguments, CUDA-graph sizes, environment); DDTree
    on vLLM's ``runner`` ("v2": the plugin's choice for a dense target on one GPU)."""
    jobs = [
        {"name": "ar", "kwargs": {}, "width": 1, "drafter_width": 1, "env": {}},
        {
            "name": CHAIN,
            "kwargs": {
                "speculative_config": {
                    "method": "dflash",
                    "model": drafter,
                    "num_speculative_tokens": depth,
                }
            },
            "width": 1 + depth,
            "drafter_width": 1 + depth,
            "env": {},
        },
    ]
    for budget in budgets:
        jobs.append(
            {
                "name": engine_name(budget, runner),
                "kwargs": {
                    "speculative_config": {
                        "method": "ddtree",
                        "model": drafter,
                        "tree_budget": budget,
                    }
                },
                "width": 1 + budget,
                "drafter_width": 1 + depth,
                "env": {"VLLM_DDTREE_RUNNER": runner},
            }
        )
    for job in jobs:
        job["max_seqs"] = max_seqs
        job["cudagraph_capture_sizes"] = graph_sizes(job["width"], max_seqs, job["drafter_width"])
    return jobs


def without_engines(jobs: list[dict], skipped: list[str]) -> list[dict]:
    """``jobs`` less those named in ``skipped``; ValueError for a name that is not a job's or
    for the chain (every ratio is to it)."""
    names = [job["name"] for job in jobs]
    wrong = [name for name in skipped if name not in names or name == CHAIN]
    if wrong:
        raise ValueError(
            f"--skip: {wrong} cannot be left out; allowed: {[n for n in names if n != CHAIN]}"
        )
    return [job for job in jobs if job["name"] not in skipped]


def auto_job(drafter: str, depth: int, max_seqs: int, runner: str) -> dict:
    """An engine of DDTree ``"tree_budget": "auto"`` at ``max_num_seqs`` = ``max_seqs``, its
    CUDA graphs sized by the plugin (``cudagraph_capture_sizes`` None), its width the widest
    budget "auto" may serve. It starts alone, after the other engines: it times its graphs
    as it captures them."""
    from vllm_ddtree.budget.cost_model import load_profile

    widest = load_profile(runner=runner.upper()).measured_range()[1]
    return {
        "name": AUTO,
        "kwargs": {
            "speculative_config": {"method": "ddtree", "model": drafter, "tree_budget": "auto"}
        },
        "width": 1 + widest,
        "drafter_width": 1 + depth,
        "env": {"VLLM_DDTREE_RUNNER": runner},
        "max_seqs": max_seqs,
        "cudagraph_capture_sizes": None,
        "start_alone": True,
    }


def engine_args(job: dict, target: str, overrides: dict | None = None) -> dict:
    """``LLM(...)`` arguments of a job: bf16, CUDA graphs at the job's sizes, a fixed KV cache
    (no memory profiling, so engines can start side by side); ``overrides`` replace them (a
    None value removes the argument)."""
    width = max(job["width"], job["drafter_width"])
    args = {
        "model": target,
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "max_num_seqs": job["max_seqs"],
        "max_num_batched_tokens": max(8192, width * job["max_seqs"]),
        "gpu_memory_utilization": 0.04,
        "kv_cache_memory_bytes": 4 << 30,
        "seed": 0,
        "disable_log_stats": False,
        # None: the plugin's sizes (an "auto" engine's, ``auto_job``)
        "compilation_config": {"cudagraph_capture_sizes": job["cudagraph_capture_sizes"]}
        if job["cudagraph_capture_sizes"]
        else {},
        **job["kwargs"],
        **(overrides or {}),
    }
    return {k: v for k, v in args.items() if v is not None}


# The step-time measurements an engine worker runs on request: kind -> ``step_split``'s function.
SPLITS = {
    "step_split": "profiled_step_split",  # torch.profiler: phases, host and device
    "host_phases": "host_phase_split",  # the phases' own timers, unprofiled
    "host_profile": "host_profile",  # cProfile: Python functions and waits
}


def engine_worker(job: dict, args: dict, conn, engine_core_process: bool = True) -> None:
    """Child process: one ``LLM`` built from ``args`` (its engine core in a process of its own
    when ``engine_core_process``, vLLM's default and how ``vllm serve`` runs it, else in this
    process), then run the requests sent over ``conn`` until None; each answer: output token
    ids, seconds, drafts and accepted tokens (vLLM's spec-decode counters over the request)."""
    os.environ.update(job["env"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_core_process else "0"
    from vllm import LLM

    try:
        llm = LLM(**args)
    except BaseException as error:  # the parent raises it instead of waiting out its timeout
        conn.send({"error": f"{type(error).__name__}: {error}"})
        raise
    import torch

    config = llm.llm_engine.vllm_config
    conn.send(
        {
            "ready": True,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "runner": "V2" if config.use_v2_model_runner else "V1",
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
            "device_id": device_id(),
        }
    )
    while True:
        request = conn.recv()
        if request is None:
            return
        if isinstance(request[0], str):  # where the step's time goes (engine core in this process)
            from benchmarks import step_split
            from benchmarks.bench_e2e import metric_values

            kind, prompts, temperature, max_tokens = request
            measure = getattr(step_split, SPLITS[kind])
            conn.send(measure(llm, prompts, max_tokens, metric_values, temperature))
            continue
        prompts, temperature, one_at_a_time, max_tokens = request
        request_seconds: list[float] = []
        tokens, seconds, before, after = timed_generate(
            llm, prompts, temperature, one_at_a_time, max_tokens, request_seconds
        )
        drafts, accepted, draft_tokens = (
            after.get(key, 0) - before.get(key, 0)
            for key in (
                "vllm:spec_decode_num_drafts",
                "vllm:spec_decode_num_accepted_tokens",
                "vllm:spec_decode_num_draft_tokens",
            )
        )
        conn.send(
            {
                "tokens": tokens,
                "seconds": seconds,
                "drafts": drafts,
                "accepted": accepted,
                "draft_tokens": draft_tokens,  # tree nodes verified (DDTree)
                "request_seconds": request_seconds,  # one at a time: each request's
            }
        )


def start_groups(jobs: list[dict]) -> list[list[dict]]:
    """The order ``Engines`` starts ``jobs`` in: every job side by side, then each job marked
    ``"start_alone"`` on its own once the others are ready. An online "auto" engine times its
    CUDA graphs as it captures them (``vllm_ddtree/budget/step_costs.py``): beside other engines
    capturing theirs on the same GPU, its timings came out up to twice the graphs' cost."""
    together = [job for job in jobs if not job.get("start_alone")]
    alone = [[job] for job in jobs if job.get("start_alone")]
    return ([together] if together else []) + alone


class Engines:
    """Every job's engine in its own process, started side by side and kept until ``close``.

    ``run(name, prompts, temperature, one_at_a_time, max_tokens)`` sends one measurement to
    engine ``name`` and waits for its answer; ``ready[name]``: what the engine reported at
    start (runner, CUDA-graph mode, GPU). ``engine_core_process``: see ``engine_worker``."""

    def __init__(
        self,
        jobs: list[dict],
        target: str,
        overrides=None,
        timeout: float = 300,
        engine_core_process: bool = True,
    ):
        context = multiprocessing.get_context("spawn")
        self.workers = {}
        self.ready: dict[str, dict] = {}
        try:
            for group in start_groups(jobs):
                for job in group:
                    parent, child = context.Pipe()
                    args = engine_args(job, target, overrides)
                    process = context.Process(
                        target=engine_worker, args=(job, args, child, engine_core_process)
                    )
                    process.start()
                    child.close()  # the worker's end: EOF here once the worker is gone
                    self.workers[job["name"]] = (process, parent)
                deadline = time.time() + timeout
                for job in group:
                    process, conn = self.workers[job["name"]]
                    self.ready[job["name"]] = self._wait_ready(job["name"], process, conn, deadline)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _wait_ready(name: str, process, conn, deadline: float) -> dict:
        """The worker's ready message; an engine that failed to start (its error, or its exit
        code when it died without one) raises at once rather than at the deadline."""
        while not conn.poll(1.0):
            if not process.is_alive():
                raise RuntimeError(
                    f"bench_paired: engine {name} exited with code {process.exitcode} "
                    "before it was ready"
                )
            if time.time() > deadline:
                raise RuntimeError(f"bench_paired: engine {name} did not start in time")
        try:
            answer = conn.recv()
        except EOFError:
            raise RuntimeError(f"bench_paired: engine {name} exited before it was ready") from None
        if "error" in answer:
            raise RuntimeError(f"bench_paired: engine {name} did not start: {answer['error']}")
        return answer

    def run(self, name: str, prompts, temperature: float, one_at_a_time: bool, max_tokens: int):
        conn = self.workers[name][1]
        conn.send((prompts, temperature, one_at_a_time, max_tokens))
        return conn.recv()

    def split(
        self, name: str, prompts, temperature: float, max_tokens: int, kind: str = "step_split"
    ) -> dict:
        """``prompts`` submitted together on engine ``name`` (its core in its worker's
        process), measured by ``kind`` (``SPLITS``: torch.profiler's step split by default)."""
        conn = self.workers[name][1]
        conn.send((kind, prompts, temperature, max_tokens))
        return conn.recv()

    def close(self) -> None:
        for _, conn in self.workers.values():
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for process, _ in self.workers.values():
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def turn_order(names: list[str], repeat: int) -> list[str]:
    """The engines' order in repeat ``repeat``: rotated by one each repeat, so that no engine
    always runs first (or right after another)."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def measure_row(run, names: list[str], prompts, temperature: float, batch: int, repeats: int):
    """One row: an untimed run on every engine, then ``repeats`` rounds in ``turn_order``.
    ``run(name, prompts, temperature, one_at_a_time)`` -> the worker's answer. Returns
    ``{name: [answers of the timed rounds]}``."""
    for name in names:
        run(name, prompts, temperature, batch == 1)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in turn_order(names, repeat):
            runs[name].append(run(name, prompts, temperature, batch == 1))
    return runs


def summarize_row(runs: dict[str, list[dict]], chain: str = CHAIN) -> dict:
    """Medians per engine and each engine's per-round ratio to ``chain`` (tok/s of round ``r``
    over the chain's round ``r``): median, min and max."""
    engines = {}
    rates = {}
    for name, answers in runs.items():
        rates[name] = [sum(map(len, a["tokens"])) / a["seconds"] for a in answers]
        drafts = sum(a["drafts"] for a in answers)
        accepted = sum(a["accepted"] for a in answers)
        engines[name] = {
            "tok_per_s": statistics.median(rates[name]),
            "runs_tok_per_s": [round(r, 1) for r in rates[name]],
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        }
        if any(a.get("request_seconds") for a in answers):  # requests run one at a time
            engines[name]["runs_request_seconds"] = [
                [round(t, 4) for t in a.get("request_seconds", [])] for a in answers
            ]
    ratios = {}
    if chain in rates:
        ratios = {name: paired_ratio(own, rates[chain]) for name, own in rates.items()}
    return {"engines": engines, "over_chain": ratios}


def paired_ratio(own: list[float], other: list[float]) -> dict:
    """Median, min and max of the per-round ratios ``own[r] / other[r]``."""
    paired = [a / b for a, b in zip(own, other, strict=True)]
    return {"median": statistics.median(paired), "min": min(paired), "max": max(paired)}


def is_fixed_budget(name: str) -> bool:
    """A DDTree engine of one fixed budget (not ``AUTO``)."""
    return name.startswith("ddtree") and name != AUTO


def fastest_fixed(engines: dict, over_chain: dict, is_fixed=is_fixed_budget) -> str | None:
    """The engine ``is_fixed`` accepts with the highest median ratio to the chain."""
    trees = [n for n in engines if is_fixed(n) and n in over_chain]
    return max(trees, key=lambda name: over_chain[name]["median"]) if trees else None


def row_groups(prompt_sets: dict, batch: int, batch1_prompts: int) -> dict[str, list]:
    """The prompts of a row: per set at batch 1, else ``batch`` mixed round-robin."""
    if batch == 1:
        return {name: ps[:batch1_prompts] for name, ps in prompt_sets.items()}
    sets = list(prompt_sets.values())
    mixed = [sets[i % len(sets)][(i // len(sets)) % len(sets[i % len(sets)])] for i in range(batch)]
    return {"mixed": mixed}


def auto_budget(batch: int, runner: str = "v2", profile: str | None = None) -> int | None:
    """The budget ``"tree_budget": "auto"`` serves at ``max_num_seqs`` = ``batch`` with the
    cost profile at ``profile`` (default: the packaged one of ``runner``; None: the DFlash
    chain)."""
    from vllm_ddtree.budget.cost_model import choose_automatic

    return choose_automatic(batch, runner.upper(), path=profile)[0]


def engine_name(budget: int | None, runner: str = "v2") -> str:
    """``engine_jobs``' name of DDTree at ``budget`` on ``runner`` (None: the chain's)."""
    if budget is None:
        return CHAIN
    return f"{'ddtree_v2_b' if runner == 'v2' else 'ddtree_b'}{budget}"


def auto_engine(batch: int, runner: str = "v2", profile: str | None = None) -> str:
    """The engine name of ``auto_budget``."""
    return engine_name(auto_budget(batch, runner, profile), runner)


def ratio_text(ratio: dict | None, missing: str = "") -> str:
    """A per-round ratio summary as "median (min-max)"; ``missing`` when there is none."""
    if not ratio:
        return missing
    return f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"


def write_report(summary: dict, out: str) -> None:
    """bench_paired.json and bench_paired.md (one line per row and engine)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_paired.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = [
        "# Paired speed: engines by turns, ratios of adjacent runs",
        "",
        f"Commit {summary['commit']}, {summary['gpu']}, target {summary['target_name']}, "
        f"drafter {summary['drafter_name']}, engine core "
        f"{summary.get('engine_core', 'in process')}; {auto_source(summary)}; "
        f"{summary['repeats']} rounds per row "
        "after one untimed run, each round every engine once (order rotating). over chain: "
        "the median (min-max) of the per-round ratios of tok/s to the chain's round.",
        "",
    ]
    for temperature in sorted({r["temperature"] for r in summary["rows"]}):
        served = [
            (r, r["over_chain"].get(r["auto_serves"]))
            for r in summary["rows"]
            if r["temperature"] == temperature
        ]
        served = [(r, ratio) for r, ratio in served if ratio is not None]
        if served:
            row, worst = min(served, key=lambda item: item[1]["median"])
            lines.append(
                f'- T = {temperature:g}: `"auto"` over the chain, lowest median of a row: '
                f"{worst['median']:.2f} ({row['dataset']}, batch {row['batch']}, "
                f"{row['auto_serves']}) over {len(served)} rows"
            )
    lines += [
        "",
        "| dataset | batch | T | engine | tok/s | acceptance | over chain | auto |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["rows"]:
        for name, e in row["engines"].items():
            r = row["over_chain"].get(name)
            ratio = ratio_text(r)
            lines.append(
                f"| {row['dataset']} | {row['batch']} | {row['temperature']:g} | {name} | "
                f"{e['tok_per_s']:.0f} | {e['mean_acceptance_length']:.2f} | {ratio} | "
                f"{'auto' if name == row['auto_serves'] else ''} |"
            )
    if summary.get("online_auto"):
        lines += ["", '## DDTree "auto" against the fastest fixed budget', "", *auto_table(summary)]
    with open(os.path.join(out, "bench_paired.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def auto_source(summary: dict) -> str:
    """What the report's "auto" is: the online engine, or what the cost profile serves."""
    if summary.get("online_auto"):
        return f'"auto": the engine of "tree_budget": "auto" ({AUTO}), moving its budget online'
    return f'"auto" judged by the cost profile of {summary.get("cost_profile", "the package")}'


AUTO_COLUMNS = (
    '| chain tok/s | fastest fixed budget | "auto" tok/s (acceptance) | "auto" / chain '
    '| "auto" / fastest fixed |'
)


def auto_cells(row: dict, is_fixed=is_fixed_budget) -> str | None:
    """A row's ``AUTO_COLUMNS`` cells: the ``AUTO`` engine against the chain and against the
    row's fastest fixed budget (``fastest_fixed`` by ``is_fixed``; per-round ratios, by
    turns); None where no "auto" engine ran."""
    engines, over = row["engines"], row["over_chain"]
    if AUTO not in engines:
        return None
    auto, best = engines[AUTO], fastest_fixed(engines, over, is_fixed)
    versus = "-"
    if best:
        versus = ratio_text(paired_ratio(auto["runs_tok_per_s"], engines[best]["runs_tok_per_s"]))
    return (
        f" {engines[CHAIN]['tok_per_s']:.0f} | {'b' + best.rsplit('_b', 1)[-1] if best else '-'} "
        f"| {auto['tok_per_s']:.0f} ({auto['mean_acceptance_length']:.2f}) | "
        f"{ratio_text(over.get(AUTO), '-')} | {versus} |"
    )


def auto_table(summary: dict) -> list[str]:
    """Markdown lines: per row, ``auto_cells`` after its dataset, batch and temperature."""
    lines = ["| dataset | batch | T " + AUTO_COLUMNS, "| --- " * 8 + "|"]
    for row in summary["rows"]:
        cells = auto_cells(row)
        if cells is not None:
            lines.append(f"| {row['dataset']} | {row['batch']} | {row['temperature']:g} |" + cells)
    return lines


README_BEGIN = "<!-- bench_paired table: generated by benchmarks/bench_paired.py --readme -->"
README_END = "<!-- /bench_paired table -->"


def paired_table(sources: list[tuple[dict, str]]) -> str:
    """Markdown: per run (a ``bench_paired.json`` summary and the link to its full table) and
    row, AR, the chain and what ``"auto"`` served: tok/s (acceptance length) and the medians
    (min-max) of the per-round ratios to the chain."""
    runs = [(summary, link, link.rsplit("/", 2)[-2]) for summary, link in sources]  # its folder
    lines = []
    for summary, link, run in runs:
        lines.append(
            f"- [{run}]({link}): commit {str(summary['commit'])[:7]}, "
            f"{summary['gpu']}, {summary['repeats']} rounds per row, "
            f"{summary['max_tokens']} tokens per request"
        )
    lines += [
        "",
        '| run | prompts | batch | T | AR | DFlash chain | DDTree "auto" | "auto" / chain '
        "| AR / chain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def ratio(r: dict | None) -> str:
        return ratio_text(r, "-")

    def cell(engines: dict, name: str) -> str:
        e = engines.get(name)
        return f"{e['tok_per_s']:.0f} ({e['mean_acceptance_length']:.2f})" if e else "-"

    for summary, _, run in runs:
        for row in summary["rows"]:
            engines, over = row["engines"], row["over_chain"]
            auto = row["auto_serves"]
            lines.append(
                f"| {run} | {row['dataset']} | {row['batch']} | {row['temperature']:g} | "
                f"{cell(engines, 'ar')} | {cell(engines, CHAIN)} | "
                f"{cell(engines, auto)}, {'chain' if auto == CHAIN else auto.rsplit('_', 1)[-1]} | "
                f"{ratio(over.get(auto))} | {ratio(over.get('ar'))} |"
            )
    return "\n".join(lines)


def update_readme(readme: str, sources: list[str]) -> None:
    """Replace the block between ``README_BEGIN`` and ``README_END`` in ``readme`` with
    ``paired_table`` of the ``bench_paired.json`` files ``sources``."""
    tables = []
    for path in sources:
        with open(path) as f:
            summary = json.load(f)
        md = os.path.join(os.path.dirname(path), "bench_paired.md")
        tables.append((summary, os.path.relpath(md, os.path.dirname(os.path.abspath(readme)))))
    replace_marked_block(readme, README_BEGIN, README_END, paired_table(tables))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--prompts")
    parser.add_argument("--readme", help="rewrite this file's paired table from --readme-from")
    parser.add_argument(
        "--readme-from", default="", help="bench_paired.json files, comma-separated"
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--budgets", default="", help="DDTree budgets besides auto's choices")
    parser.add_argument(
        "--cost-profile",
        help='judge what "auto" serves by this cost profile (JSON of vllm_ddtree.budget.cost_model)'
        " instead of the packaged one of the runner",
    )
    parser.add_argument(
        "--skip", default="", help="engines left out, comma-separated (e.g. ar; not the chain)"
    )
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch1-prompts", type=int, default=2)
    parser.add_argument("--ddtree-runner", choices=("v1", "v2"), default="v2")
    parser.add_argument("--engine-args", help="JSON: LLM(...) arguments replacing the defaults")
    parser.add_argument("--start-timeout", type=int, default=300, help="seconds for engines")
    parser.add_argument(
        "--engine-core-in-process",
        action="store_true",
        help="run each engine's core in its worker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0,"
        " as runs before 2026-12-01 did) instead of vLLM's default, a process of its own",
    )
    parser.add_argument("--deadline", type=int, default=560, help="no row starts after this")
    parser.add_argument(
        "--online-auto",
        action="store_true",
        help='also run DDTree "tree_budget": "auto" as an engine of its own (V2 runner, '
        "max_num_seqs the largest batch, the plugin's CUDA graphs, started alone), which "
        'moves its budget online; rows mark it as "auto" instead of what the cost profile '
        "would serve",
    )
    args = parser.parse_args(argv)
    if args.online_auto and args.ddtree_runner != "v2":
        parser.error("--online-auto: an engine with CUDA graphs moves its budget on V2 only")
    if args.readme:
        update_readme(args.readme, [p for p in args.readme_from.split(",") if p])
        return 0
    if not (args.target and args.drafter and args.prompts):
        parser.error("--target, --drafter and --prompts are required to measure")
    started = time.time()

    from transformers import AutoTokenizer

    from benchmarks.train_dflash import chat_ids
    from vllm_ddtree.budget.cost_model import load_profile

    batches = [int(b) for b in args.batches.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    with open(os.path.join(args.drafter, "config.json")) as f:
        depth = json.load(f).get("block_size", 16) - 1
    # What "auto" serves per batch, decided once: its budgets start engines, its names mark rows.
    served = {b: auto_budget(b, args.ddtree_runner, args.cost_profile) for b in batches}
    chosen = set(served.values()) - {None}
    budgets = sorted(chosen | {int(b) for b in args.budgets.split(",") if b})
    jobs = engine_jobs(args.drafter, depth, budgets, max(batches), args.ddtree_runner)
    if args.online_auto:
        jobs.append(auto_job(args.drafter, depth, max(batches), args.ddtree_runner))
    try:
        jobs = without_engines(jobs, [name for name in args.skip.split(",") if name])
    except ValueError as error:
        parser.error(str(error))
    names = [job["name"] for job in jobs]

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    with open(args.prompts) as f:
        eval_sets = json.load(f)["eval"]
    prompt_sets = {
        name: [chat_ids(tokenizer, p)[-1024:] for p in eval_sets[name][: max(batches)]]
        for name in DATASETS
    }

    overrides = json.loads(args.engine_args) if args.engine_args else None
    engine_core_process = not args.engine_core_in_process
    engines = Engines(
        jobs,
        args.target,
        overrides,
        timeout=args.start_timeout,
        engine_core_process=engine_core_process,
    )

    def run(name, prompts, temperature, one_at_a_time):
        return engines.run(name, prompts, temperature, one_at_a_time, args.max_tokens)

    try:
        summary = {
            "commit": envs.commit() or "unknown",
            "gpu": engines.ready[CHAIN]["gpu"],
            "device_id": engines.ready[CHAIN]["device_id"],
            "target_name": os.path.basename(os.path.normpath(args.target)),
            "drafter_name": os.path.basename(os.path.normpath(args.drafter)),
            "drafter_sha256": weights_sha256(args.drafter),
            "depth": depth,
            "cost_profile": load_profile(args.cost_profile, args.ddtree_runner.upper()).source,
            "online_auto": args.online_auto,
            "repeats": args.repeats,
            "max_tokens": args.max_tokens,
            "engines": engines.ready,
            "engine_core": "own process" if engine_core_process else "in process",
            "engine_start_seconds": time.time() - started,
            "rows": [],
        }
        for temperature in temperatures:
            for batch in batches:
                groups = row_groups(prompt_sets, batch, args.batch1_prompts)
                for dataset, prompts in groups.items():
                    if time.time() - started > args.deadline:
                        print(f"deadline: skipped {dataset} batch {batch} T={temperature}")
                        continue
                    runs = measure_row(run, names, prompts, temperature, batch, args.repeats)
                    row = {"dataset": dataset, "batch": batch, "temperature": temperature}
                    row.update(summarize_row(runs))
                    row["profile_serves"] = engine_name(served[batch], args.ddtree_runner)
                    row["auto_serves"] = AUTO if args.online_auto else row["profile_serves"]
                    summary["rows"].append(row)
                    summary["wall_seconds"] = time.time() - started
                    write_report(summary, args.out)
                    auto = row["over_chain"].get(row["auto_serves"], {}).get("median")
                    key = [dataset, batch, temperature]
                    print(json.dumps({"row": key, "auto": auto, **row["over_chain"]}), flush=True)
    finally:
        engines.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
