"""Run one or more vLLM engines over the same token prompts (greedy) and print JSON.

Each engine runs in this process, one after the other (vLLM engines keep process-global
state, so tests start this script as a subprocess):

    python run_vllm_generate.py TARGET RUNS_JSON PROMPTS_JSON MAX_TOKENS

RUNS_JSON is a list of {"name": ..., "kwargs": {...}} with extra ``LLM(...)`` arguments
(e.g. ``speculative_config``, ``attention_backend``, ``dtype``; ``reasoning_config`` as a dict
of ``ReasoningConfig``). A run may add
``"oracle": {"from": RUN_NAME, "p_top": P}``: the DDTree test drafter then proposes the
continuations an earlier run produced (see ``vllm_ddtree.spec_decode.proposer``), and
``"sampling": {"temperature": T, "repeats": K, ...}``: the first prompt K times, seeds 0..K-1
(other keys, e.g. ``top_k``/``top_p``, go to ``SamplingParams``), and ``"params": {...}``: extra
``SamplingParams`` of a greedy run (e.g. ``min_tokens``, ``stop_token_ids``; ``structured_outputs``
as a dict of ``StructuredOutputsParams``), ``"prompt_params":
[{...}, ...]``: more of them per prompt (e.g. ``extra_args``), ``"env": {...}``: environment
variables set for that run only, and ``"phases": [n1, n2, ...]``: the prompts in consecutive
groups, each generated after the last in the same engine (the counters after each phase in
``"phase_metrics"``). An oracle's ``"skip_first": n`` leaves the first ``n`` prompts out of
its sequences (the drafter's logits are noise for them). ``"online_budget": {NAME: value}``
sets constants of ``vllm_ddtree.budget.online`` for that run (its refresh cadence).
Prints one line
``RESULT {name: {"tokens": [...], "logprobs": [...], "metrics": {...}, "ddtree": {...},
"backend": ...}}``.
"""

import gc
import json
import os
import sys

# vLLM's metrics a run reports: speculative decoding, DDTree's, prefix caching, preemptions.
REPORTED_METRICS = (
    "vllm:spec_decode",
    "vllm:ddtree",
    "vllm:prefix_cache",
    "vllm:num_preemptions",
)


# The packages of "auto"'s online modules: the plugin's, and vLLM's own where vLLM is patched
# with the upstream series (its engines import those; docs/upstream.md).
CADENCE_PACKAGES = ("vllm_ddtree.budget", "vllm.v1.spec_decode.ddtree.budget")


def cadence_modules() -> list[tuple]:
    """``(acceptance, online)`` modules of each package in ``CADENCE_PACKAGES`` importable
    here."""
    import importlib

    found = []
    for package in CADENCE_PACKAGES:
        try:
            modules = tuple(
                importlib.import_module(f"{package}.{name}") for name in ("acceptance", "online")
            )
        except ImportError:
            continue
        found.append(modules)
    return found


def spec_decode_metrics(llm) -> dict:
    """vLLM's spec-decode counters and DDTree's metrics now (a per-position counter as its
    vector of values)."""
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(REPORTED_METRICS):
            values = getattr(metric, "values", None)
            metrics[metric.name] = values if values is not None else getattr(metric, "value", None)
    return metrics


def generate(
    target: str,
    kwargs: dict,
    prompts: list[list[int]],
    max_tokens: int,
    sampling=None,
    params=None,
    prompt_params=None,
    phases=None,
) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = dict(
        model=target,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=4,
        seed=0,
        disable_log_stats=False,
    )
    if isinstance(kwargs.get("reasoning_config"), dict):
        from vllm.config.reasoning import ReasoningConfig

        kwargs = {**kwargs, "reasoning_config": ReasoningConfig(**kwargs["reasoning_config"])}
    llm = LLM(**{**args, **kwargs})
    if sampling:
        # The first prompt, `repeats` times, each request with its own seed.
        extra = {k: v for k, v in sampling.items() if k not in ("temperature", "repeats")}
        sampling_params = [
            SamplingParams(
                temperature=sampling["temperature"],
                seed=seed,
                max_tokens=max_tokens,
                ignore_eos=True,
                detokenize=False,
                **extra,
            )
            for seed in range(sampling["repeats"])
        ]
        prompts = [prompts[0]] * sampling["repeats"]
    else:
        per_prompt = prompt_params or [{}] * len(prompts)
        sampling_params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                detokenize=False,
                **{**(params or {}), **own},
            )
            for own in per_prompt
        ]
    for params_of_one in sampling_params:  # JSON {"regex": ...} -> vLLM's params object
        if isinstance(params_of_one.structured_outputs, dict):
            from vllm.sampling_params import StructuredOutputsParams

            params_of_one.structured_outputs = StructuredOutputsParams(
                **params_of_one.structured_outputs
            )
    outputs, phase_metrics, start = [], [], 0
    for count in phases or [len(prompts)]:  # one generate call per phase, one engine
        outputs += llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts[start : start + count]],
            sampling_params[start : start + count],
        )
        start += count
        phase_metrics.append(spec_decode_metrics(llm))
    metrics = phase_metrics[-1]
    config = llm.llm_engine.vllm_config
    ddtree = getattr(config.speculative_config, "ddtree_config", None)
    backend = config.attention_config.backend
    cache = config.cache_config
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        # Per prompt, per generated token: [[token id, logprob, rank], ...] (when asked for).
        "logprobs": [
            [
                sorted([t, lp.logprob, lp.rank] for t, lp in position.items())
                for position in o.outputs[0].logprobs
            ]
            if o.outputs[0].logprobs is not None
            else None
            for o in outputs
        ],
        # Per prompt, per prompt token after the first: its logprob (when asked for).
        "prompt_logprobs": [
            [
                position[token].logprob
                for token, position in zip(
                    o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True
                )
            ]
            if o.prompt_logprobs is not None
            else None
            for o in outputs
        ],
        # Per prompt: what the finished request carried in kv_transfer_params (DDTree's
        # per-request statistics when asked for).
        "kv_transfer_params": [o.kv_transfer_params for o in outputs],
        "metrics": metrics,
        "phase_metrics": phase_metrics,  # the counters after each phase
        "ddtree": ddtree.to_dict() if ddtree else None,
        "backend": backend.name if backend is not None else None,
        # The KV / state cache layout the engine ran with.
        "cache": {
            "block_size": cache.block_size,
            "mamba_block_size": cache.mamba_block_size,
            "mamba_cache_mode": cache.mamba_cache_mode,
        },
    }
    del llm
    gc.collect()
    return result


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    target, runs_json, prompts_json, max_tokens = sys.argv[1:5]
    prompts = json.loads(prompts_json)
    results = {}
    for run in json.loads(runs_json):
        oracle = run.get("oracle")
        if oracle:
            import tempfile

            sequences = [
                p + t for p, t in zip(prompts, results[oracle["from"]]["tokens"], strict=True)
            ][oracle.get("skip_first", 0) :]
            path = os.path.join(tempfile.mkdtemp(), "oracle.json")
            with open(path, "w") as f:
                spec = {"p_top": oracle.get("p_top", 1.0), "seed": 0, "sequences": sequences}
                if oracle.get("rank_model"):
                    spec["rank_model"] = oracle["rank_model"]
                json.dump(spec, f)
            os.environ["VLLM_DDTREE_TEST_ORACLE"] = path
        else:
            os.environ.pop("VLLM_DDTREE_TEST_ORACLE", None)
        run_env = run.get("env", {})
        saved_env = {key: os.environ.get(key) for key in run_env}
        os.environ.update(run_env)
        # The engine core runs in this process: an online "auto" engine's cadence, scaled
        # down so that a short run sees several refreshes (online_budget's constants), in
        # each copy of the modules the engine may use.
        cadence = run.get("online_budget", {})
        saved_cadence = []
        for acceptance, online_budget in cadence_modules() if cadence else ():
            # Each constant where it is defined: the controller's, or the workers' tracker's.
            for name, value in cadence.items():
                home = acceptance if hasattr(acceptance, name) else online_budget
                saved_cadence.append((home, name, getattr(home, name)))
                setattr(home, name, value)
        results[run["name"]] = generate(
            target,
            run["kwargs"],
            prompts,
            int(max_tokens),
            run.get("sampling"),
            run.get("params"),
            run.get("prompt_params"),
            run.get("phases"),
        )
        for home, name, value in saved_cadence:
            setattr(home, name, value)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    print("RESULT " + json.dumps(results))
