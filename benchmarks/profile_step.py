"""Where a decode step's time goes: torch.profiler over one engine at batch 1 (GPU or CPU).

Runs one vLLM engine (in this process) per method given, generates ``--tokens`` tokens for one
prompt once untimed, once timed (wall time per target forward) and once under ``torch.profiler``,
and writes, per method: wall time per target forward with and without the profiler, the
``ddtree::*`` ranges (tree inputs, tree building, target tokens, walk, KV commit, drafter
context rows), the operators with the most CPU and device time, and the number of host
synchronisations (device-to-host copies, stream/device synchronise calls).

    python -m benchmarks.profile_step --target DIR --drafter DIR --out DIR \\
        [--methods ar,dflash_v1,ddtree_b64] [--tokens 128]
    python -m benchmarks.profile_step --target synthetic --out DIR   # SmolLM2 shapes, random
    python -m benchmarks.profile_step --target synthetic-tp --tp 2 --out DIR  # timing only
    python -m benchmarks.profile_step --target synthetic-hybrid --out DIR \
        --methods dflash,ddtree_b16,ddtree_b64,ddtree_b256   # GDN verify-step cost (V1 runner)

With ``--tp`` > 1 the model runs in worker processes: wall time per target forward only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.common import ROOT, module_command
from benchmarks.step_split import LAUNCH_EVENTS, SYNC_EVENTS
from vllm_ddtree import envs

# "graphs": full CUDA graphs of decode/verify batches, no torch.compile (engines start fast;
# vLLM's V1 runner then runs the DFlash drafter eagerly). "default": vLLM's defaults
# (torch.compile, FULL_AND_PIECEWISE: the V1 drafter gets piecewise graphs), what `vllm serve` does.
COMPILE_MODES = {"graphs": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, "default": None}


def synthetic_config(name: str):
    """The random targets' configs: ``synthetic`` has SmolLM2-135M's shapes (Llama, 30 layers,
    hidden 576, 9 heads); ``synthetic-tp`` is a Qwen3 with Qwen3-0.6B's layer shapes (28 layers,
    hidden 1024, 16 query / 8 KV heads of 128; SmolLM2's vocabulary) that shards over 2 or 4 GPUs
    (SmolLM2's 9 heads do not); ``synthetic-hybrid`` is a Qwen3-Next with large-model layer
    shapes in 8 layers (6 GDN, 2 attention): hidden 5120 (as in Qwen3.6-27B's DFlash drafter
    config), GatedDeltaNet 16 key / 48 value heads of 128 and attention 24 query / 4 KV heads of
    256 (Qwen3.5-style sizes, chosen here, not read from a checkpoint), small MoE feed-forwards
    (vLLM's Qwen3-Next needs MoE): the GDN tree verify's cost on realistic head shapes."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3NextConfig

    shared = dict(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    if name == "synthetic-hybrid":
        return Qwen3NextConfig(
            hidden_size=5120,
            num_hidden_layers=8,
            full_attention_interval=4,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            intermediate_size=4096,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=8,
            num_experts_per_tok=2,
            architectures=["Qwen3NextForCausalLM"],
            **{**shared, "tie_word_embeddings": False},
        )
    if name == "synthetic":
        return LlamaConfig(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            **shared,
        )
    return Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        **shared,
    )


def synthetic_pair(work: str, name: str = "synthetic") -> tuple[str, str]:
    """A random-weight target (``synthetic_config(name)``) and a 3-layer DFlash drafter for
    it, written once under ``work``: per-step costs without shipping real weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.demo import untrained_drafter_config
    from vllm_ddtree.dflash_drafter import random_drafter

    target = os.path.join(work, f"{name}-target")
    drafter = os.path.join(work, f"{name}-dflash")
    if not os.path.exists(os.path.join(target, "config.json")):
        config = synthetic_config(name)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(target)
        drafter_config = untrained_drafter_config(config)
        drafter_config.num_hidden_layers = 3
        random_drafter(drafter_config, seed=0).save_pretrained(drafter)
    return target, drafter


def engine_kwargs(method: str, drafter: str) -> tuple[dict, dict]:
    """``LLM`` arguments and environment for ``ar``, ``dflash``, ``ddtree_bN``; a ``_v1``
    suffix (``ar_v1``, ``dflash_v1``) runs vLLM's V1 model runner instead of V2."""
    env = {}
    if method.endswith("_v1"):
        env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
        method = method.removesuffix("_v1")
    if method == "ar":
        return {}, env
    if method == "dflash":
        spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
        return {"speculative_config": spec}, env
    if method.startswith("ddtree_b"):
        # ddtree_bN: the V1 runner; ddtree_bN_v2: the V2 runner (VLLM_DDTREE_RUNNER).
        v2 = method.endswith("_v2")
        budget = int(method.removeprefix("ddtree_b").removesuffix("_v2"))
        return {
            "speculative_config": {"method": "ddtree", "model": drafter, "tree_budget": budget}
        }, {"VLLM_DDTREE_RUNNER": "v2" if v2 else "v1"}
    raise SystemExit(
        f"unknown method {method!r}: ar, dflash, ddtree_bN (+ _v1 for ar, dflash; + _v2 for ddtree)"
    )


def is_hybrid(target: str) -> bool:
    """Whether the checkpoint at ``target`` is a GatedDeltaNet hybrid the tree path serves
    (``config.GDN_TREE_ARCHITECTURES``)."""
    from vllm_ddtree.config import GDN_TREE_ARCHITECTURES

    try:
        with open(os.path.join(target, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except OSError:
        return False
    return any(name in GDN_TREE_ARCHITECTURES for name in architectures)


def profile_method(args, method: str) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs, env = engine_kwargs(method, args.drafter)
    os.environ.update(env)
    if is_hybrid(args.target):
        from vllm_ddtree.config import HYBRID_ENGINE_ARGS

        # Every method with the settings the GDN tree path needs (same cache layout for all).
        kwargs.update(HYBRID_ENGINE_ARGS, additional_config={"gdn_prefill_backend": "triton"})
    cuda = torch.cuda.is_available()
    llm = LLM(
        model=args.target,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
        disable_log_stats=False,
        compilation_config=COMPILE_MODES[args.compile] if cuda else None,
        tensor_parallel_size=args.tp,
        # On the CPU backend this is the share of host memory each engine reserves.
        gpu_memory_utilization=0.92 if cuda else 0.3,
        enforce_eager=not cuda,  # a CPU run is a smoke test: no torch.compile
        **({"kv_cache_memory_bytes": args.kv_cache_bytes} if args.kv_cache_bytes else {}),
        **kwargs,
    )
    prompt = [TokensPrompt(prompt_token_ids=list(range(100, 164)))]

    def drafts_between(first, second):
        key = "vllm:spec_decode_num_drafts"
        return second.get(key, 0) - first.get(key, 0)

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    before = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    unprofiled_start = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    unprofiled_seconds = time.perf_counter() - unprofiled_start
    middle = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    if args.tp > 1:
        # The model runs in worker processes, which this process's profiler does not see.
        del llm
        steps = drafts_between(before, middle) or args.tokens
        return {
            "method": method,
            "tensor_parallel_size": args.tp,
            "target_forwards": steps,
            "compile": args.compile,
            "unprofiled_ms_per_target_forward": 1000 * unprofiled_seconds / steps,
            "unprofiled_tokens_per_s": args.tokens / unprofiled_seconds,
            "mean_acceptance_length": args.tokens / steps,
        }
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompt, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}

    steps = drafts_between(middle, after) or args.tokens
    unprofiled_steps = drafts_between(before, middle) or args.tokens
    events = prof.key_averages()
    device_key = "device_time_total" if cuda else "cpu_time_total"

    def row(e) -> dict:
        return {
            "name": e.key,
            "count": e.count,
            "cpu_ms": e.cpu_time_total / 1000,
            "device_ms": getattr(e, device_key, 0) / 1000,
        }

    ranges = [row(e) for e in events if e.key.startswith("ddtree::")]
    top_cpu = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[: args.top]
    top_device = sorted(events, key=lambda e: getattr(e, device_key, 0), reverse=True)[: args.top]
    syncs = {e.key: e.count for e in events if e.key in SYNC_EVENTS}
    launches = {e.key: e.count for e in events if e.key in LAUNCH_EVENTS}
    if args.trace:
        prof.export_chrome_trace(os.path.join(args.out, f"profile_{method}.trace.json"))
    del llm
    return {
        "method": method,
        "target_forwards": steps,
        "seconds": seconds,
        "compile": args.compile,
        "ms_per_target_forward": 1000 * seconds / steps,
        "unprofiled_ms_per_target_forward": 1000 * unprofiled_seconds / unprofiled_steps,
        "unprofiled_tokens_per_s": args.tokens / unprofiled_seconds,
        "ddtree_ranges_per_forward": [
            {**r, "cpu_ms": r["cpu_ms"] / steps, "device_ms": r["device_ms"] / steps}
            for r in ranges
        ],
        "host_syncs_per_forward": {k: v / steps for k, v in syncs.items()},
        "launches_per_forward": {k: v / steps for k, v in launches.items()},
        "top_cpu": [row(e) for e in top_cpu],
        "top_device": [row(e) for e in top_device],
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--target",
        required=True,
        help="a checkpoint, 'synthetic', 'synthetic-tp' or 'synthetic-hybrid'",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (no profiler)")
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        help="fixed KV cache size: vLLM then skips its memory-profiling forward (at TP = 2 the "
        "DDTree engines died in that forward, the oracle grid, which sets this, did not)",
    )
    parser.add_argument("--drafter", default="", help="(not with --target synthetic)")
    parser.add_argument("--work", default="/tmp/vllm-ddtree-profile")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--methods", default="ar,dflash_v1,ddtree_b64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace", action="store_true", help="also write Chrome traces")
    parser.add_argument("--compile", choices=sorted(COMPILE_MODES), default="graphs")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.makedirs(args.out, exist_ok=True)
    if args.target in ("synthetic", "synthetic-tp", "synthetic-hybrid"):
        args.target, args.drafter = synthetic_pair(args.work, args.target)
    if args.method:  # child: one engine per process
        result = profile_method(args, args.method)
        with open(os.path.join(args.out, f"profile_{args.method}.json"), "w") as f:
            json.dump(result, f, indent=1)
        return 0
    import subprocess

    summary = []
    for method in args.methods.split(","):
        command = [*module_command("profile_step"), "--method", method, "--target", args.target]
        command += ["--drafter", args.drafter, "--out", args.out, "--tokens", str(args.tokens)]
        command += ["--trace"] if args.trace else []
        command += ["--compile", args.compile, "--tp", str(args.tp)]
        subprocess.run(command, cwd=ROOT, check=False)
        path = os.path.join(args.out, f"profile_{method}.json")
        if not os.path.exists(path):
            summary.append({"method": method, "error": "no result (see the log)"})
            print(json.dumps(summary[-1]), flush=True)
            continue
        with open(path) as f:
            result = json.load(f)
        keys = (
            "ms_per_target_forward",
            "unprofiled_ms_per_target_forward",
            "unprofiled_tokens_per_s",
            "mean_acceptance_length",
            "ddtree_ranges_per_forward",
            "host_syncs_per_forward",
            "launches_per_forward",
        )
        summary.append({"method": method, **{k: result[k] for k in keys if k in result}})
        print(json.dumps(summary[-1]), flush=True)
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
        json.dump(
            {
                "commit": envs.commit() or "unknown",
                "tensor_parallel_size": args.tp,
                "target": os.path.basename(args.target.rstrip("/")),
                "methods": summary,
            },
            f,
            indent=1,
        )
    return 1 if any("error" in entry for entry in summary) else 0  # an engine that died


if __name__ == "__main__":
    sys.exit(main())
