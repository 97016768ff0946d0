"""Request lifecycles as vLLM's scheduler drives them, DDTree against the target alone.

    python run_vllm_fuzz.py TARGET DRAFTER PLAN_JSON

PLAN_JSON: ``{"engine": {...LLM kwargs...}, "requests": [...], "runs": [...]}`` (or
``{"fuzz": {"seed": S, "num_requests": N, ...}, ...}``: ``benchmarks`` and tests build plans
with ``lifecycle_plan``). Each request: ``{"id", "prompt", "max_tokens", "arrive": step,
"abort": step | null, "temperature", "seed", "stop_token_ids"}``. Each run:
``{"name", "budget", "drafter": "oracle" | "random", "engine": {...}}``.

1. The target alone, one request at a time (``max_num_seqs=1``): the truth of every greedy
   request (its whole continuation also feeds the oracle drafter).
2. Each run: a DDTree engine driven step by step (``LLMEngine.step``); requests join at their
   ``arrive`` step, are aborted at their ``abort`` step; the scheduler preempts, chunks and
   prefix-caches as the engine settings make it. Every step checks its invariants
   (``VLLM_DDTREE_CHECK_STEPS=1``, ``vllm_ddtree/step_checks.py``).

Prints ``RESULT {json}``: per run, each request's tokens, whether it finished or was aborted,
the error that stopped the engine (if any), the KV blocks free at the end against the pool's
size, the preemption count and the acceptance counters; and the truth.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import tempfile
import traceback

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
    del llm
    gc.collect()
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
    result["drafts"] = _counter(llm, "vllm:spec_decode_num_drafts")
    result["accepted"] = _counter(llm, "vllm:spec_decode_num_accepted_tokens")
    del llm
    gc.collect()
    return result


def main() -> None:
    target, drafter, plan_json = sys.argv[1:4]
    plan = json.loads(plan_json)
    engine_kwargs = plan.get("engine", {})
    requests = plan.get("requests")
    if requests is None:
        requests = random_requests(**plan["fuzz"])
    truth = target_alone(target, engine_kwargs, requests)
    oracle = write_oracle(requests, truth)
    runs = {
        spec["name"]: run(target, drafter, engine_kwargs, spec, requests, oracle)
        for spec in plan["runs"]
    }
    print("RESULT " + json.dumps({"truth": truth, "requests": requests, "runs": runs}))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_DDTREE_CHECK_STEPS", "1")  # vllm_ddtree/step_checks.py
    main()
