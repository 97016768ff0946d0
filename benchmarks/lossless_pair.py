"""DDTree on a real target/drafter pair in bf16: greedy output against the target alone.

The oracle grid (`lossless_gpu.py`) proves the tree path exact in float32. A real pair serves
in bf16, where the target's logits also depend on the attention kernel and on the shape of each
forward (1 token for AR, a 16-token chain, a 65-node tree), so near-ties can flip. This script
separates the two causes: DDTree (TREE_ATTN) is compared with the target alone through TREE_ATTN
(the same attention kernel) and with the target alone on vLLM's default backend, batch 1 and
16, and every divergence is reported with the target's float32 top-2 logit gap there (a gap near
zero is a bf16 tie, a large gap is a bug). With ``--dtype float32`` DDTree and the target alone
through TREE_ATTN should agree token for token (results ``lossless_pair_float32.json``).

    python -m benchmarks.lossless_pair --target DIR --drafter DIR --prompts prompts.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DATASETS = ("humaneval", "mtbench", "sharegpt")


def load_prompt_ids(target: str, prompts_path: str, per_dataset: int) -> list[list[int]]:
    """Chat-formatted token ids of the first ``per_dataset`` held-out prompts of each dataset."""
    from transformers import AutoTokenizer

    from benchmarks.train_dflash import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(target)
    with open(prompts_path) as f:
        prompts = json.load(f)["eval"]
    return [
        chat_ids(tokenizer, text)[-1024:]
        for name in DATASETS
        for text in prompts[name][:per_dataset]
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", required=True, help="benchmarks/prompts.py output")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work", default="/tmp/vllm-ddtree-pair")
    parser.add_argument("--per-dataset", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument(
        "--dtype", default="bfloat16", help="float32: the pair's exactness check (fewer ties)"
    )
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args()

    from benchmarks.common import git_commit
    from benchmarks.lossless_gpu import run_jobs
    from benchmarks.tree_attn_vllm_gpu import logit_gap
    from vllm_ddtree.demo import first_divergence

    started = time.time()
    os.makedirs(args.work, exist_ok=True)
    prompts = load_prompt_ids(args.target, args.prompts, args.per_dataset)
    base = {
        "target": args.target,
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "max_num_seqs": 16,
        "dtype": args.dtype,
        "one_at_a_time": True,
    }
    jobs = {
        "ar_tree_attn": {**base, "kwargs": {"attention_backend": "TREE_ATTN"}},
        "ar_default": {**base, "kwargs": {}},
    }
    budgets = [int(b) for b in args.budgets.split(",")]
    for budget in budgets:
        speculative = {"method": "ddtree", "model": args.drafter, "tree_budget": budget}
        jobs[f"ddtree_b{budget}"] = {**base, "kwargs": {"speculative_config": speculative}}
    results = run_jobs(jobs, args.work, args.parallel, 480)

    rows = []
    for name in [n for n in jobs if n.startswith("ddtree")]:
        result = results[name]
        for reference in ("ar_tree_attn", "ar_default"):
            want = results[reference]
            for key, batch in (("batched", 16), ("single", 1)):
                row = {"engine": name, "reference": reference, "batch": batch}
                if "error" in result or "error" in want:
                    rows.append({**row, "error": result.get("error") or want.get("error")})
                    continue
                divergences = []
                for p, (got, ref) in enumerate(zip(result[key], want[key], strict=True)):
                    where = first_divergence(got, ref)
                    if where is not None:
                        divergences.append({"prompt": p, "token": where})
                for d in divergences[:12]:
                    d["float32_logit_gap"] = logit_gap(
                        args.target, prompts[d["prompt"]], want[key][d["prompt"]][: d["token"]]
                    )
                rows.append(
                    {
                        **row,
                        "identical_prompts": len(prompts) - len(divergences),
                        "prompts": len(prompts),
                        "divergences": divergences,
                        "runner": result["runner"],
                        "reference_runner": want["runner"],
                    }
                )
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "divergences"}))
    # The references against each other: what the attention backend alone changes.
    backends = []
    if not any("error" in results[n] for n in ("ar_tree_attn", "ar_default")):
        for key, batch in (("batched", 16), ("single", 1)):
            pairs = zip(results["ar_tree_attn"][key], results["ar_default"][key], strict=True)
            differ = [p for p, (a, b) in enumerate(pairs) if first_divergence(a, b) is not None]
            backends.append({"batch": batch, "prompts_differing": differ})
    summary = {
        "commit": git_commit(),
        "target": os.path.basename(args.target.rstrip("/")),
        "drafter": os.path.basename(args.drafter.rstrip("/")),
        "dtype": args.dtype,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "runs": rows,
        "ar_tree_attn_vs_ar_default": backends,
        "wall_seconds": time.time() - started,
    }
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.dtype == "bfloat16" else f"_{args.dtype}"
    with open(os.path.join(args.out, f"lossless_pair{suffix}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({"ar_tree_attn_vs_ar_default": backends}))
    return 0 if rows and not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
