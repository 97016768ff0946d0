"""Request options with trees on a GPU: greedy output and logprobs equal to the target alone's.

The oracle grid's tiny random Qwen3 target (float32, sharp logits) with a word-level tokenizer
(w0..w1015), one batch of 16 prompts, each prompt with its own request options
(``OPTION_MIX``): presence / frequency / repetition penalties, ``allowed_token_ids``,
``bad_words`` (a three-token and a one-token word the target says without them),
``logprobs``, a regex grammar whose allowed next token depends on the previous one, and a mix.
The target alone answers them first; the test oracle drafter then drafts that answer (deep,
branching acceptance), and every DDTree engine (budgets x modes) must give the same tokens and
logprobs (within ``--tolerance``). Runs on the model runner DDTree chooses (V2 for this dense
target) unless ``--runner`` says otherwise. Writes JSON; exits non-zero on any difference.

    python -m benchmarks lossless-options --out OUT [--budgets 8,64] [--modes eager,graphs]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks.lossless_gpu import MAX_MODEL_LEN, run_jobs

# Word tokens spelled raw: after a token starting "w1" comes one starting "w3", after one
# starting "w2" one starting "w4", then either again (each node's mask follows its own parent).
PATH_REGEX = "((w1[0-9]*w3[0-9]*)|(w2[0-9]*w4[0-9]*))+"
WORDS = 1024


def option_mix(plain_outputs: list[list[int]]) -> list[dict]:
    """Per prompt, its request options (``bad_words`` from what the target says without
    them, so that they bite)."""
    mix = []
    for p, said in enumerate(plain_outputs):
        kind = p % 8
        if kind == 0:
            own = {}
        elif kind == 1:
            own = {"presence_penalty": 1.5, "frequency_penalty": 1.5}
        elif kind == 2:
            own = {"repetition_penalty": 1.6}
        elif kind == 3:
            own = {"allowed_token_ids": list(range(1, WORDS - 16, 3))}
        elif kind == 4:
            own = {"bad_words": [f"w{said[3]} w{said[4]} w{said[5]}", f"w{said[9]}"]}
        elif kind == 5:
            own = {"logprobs": 3}
        elif kind == 6:
            own = {"structured_outputs": {"regex": PATH_REGEX}}
        else:
            own = {"logprobs": 2, "repetition_penalty": 1.3, "presence_penalty": 0.4}
        mix.append(own)
    return mix


def logprob_gap(got: list[dict] | None, want: list[dict] | None) -> float | None:
    """The largest logprob difference over the same token ids and ranks (inf when the ids
    or ranks differ; None when neither has logprobs)."""
    if got is None and want is None:
        return None
    if got is None or want is None or len(got) != len(want):
        return float("inf")
    gap = 0.0
    for a, b in zip(got, want, strict=True):
        if a.keys() != b.keys() or any(a[k][1] != b[k][1] for k in a):
            return float("inf")
        gap = max(gap, max(abs(a[k][0] - b[k][0]) for k in a))
    return gap


def markdown(summary: dict) -> str:
    """The run as a table: per engine, whether every prompt's tokens and logprobs equal the
    target alone's, and per option whether it changed the target alone's answer."""
    lines = [
        f"Commit {summary['commit']}, {summary['gpu']}; logprob tolerance "
        f"{summary['logprob_tolerance']}, largest logprob difference seen "
        f"{summary['max_logprob_gap']}.",
        "",
        "| engine | runner | CUDA graphs | tokens checked | acceptance length | identical |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["runs"]:
        if "error" in row:
            lines.append(f"| {row['engine']} | | | | | error: {row['error'][:200]} |")
            continue
        lines.append(
            f"| {row['engine']} | {row['runner']} | {row['cudagraph_mode']} | "
            f"{row['tokens_checked']} | {row['mean_acceptance_length']:.2f} | "
            f"{'yes' if row['identical'] else 'no'} |"
        )
    lines += ["", "| prompt's options | change the target alone's answer |", "| --- | --- |"]
    for options, bites in summary["options_change_the_answer"].items():
        shown = options if len(options) < 120 else options[:117] + "..."
        shown = shown.replace("|", "\\|")  # a regex's alternation inside a table cell
        lines.append(f"| `{shown}` | {'yes' if bites else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work", default="/tmp/vllm-ddtree-options")
    parser.add_argument("--budgets", default="8,64")
    parser.add_argument("--modes", default="eager,graphs")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--runner", choices=("auto", "v1", "v2"), default="auto")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="logprobs, absolute: float32 logits of the verify's GEMM shapes and the target "
        "alone's part at about 1e-4 on an H200 (a logprob from a wrong row parts at about 1)",
    )
    parser.add_argument("--deadline", type=float, default=480, help="seconds for the grid")
    parser.add_argument(
        "--report", metavar="JSON", help="only print the markdown table of a run's JSON"
    )
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            print(markdown(json.load(f)), end="")
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Float32 Triton dots in IEEE precision in every engine: logprobs compare across kernel
    # shapes (the verify's and the target alone's).
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if args.runner != "auto":
        os.environ["VLLM_DDTREE_RUNNER"] = args.runner
    import torch

    from benchmarks.common import git_commit
    from benchmarks.serve_check import make_tokenizer
    from vllm_ddtree.demo import first_divergence
    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

    started = time.time()
    deadline = started + args.deadline
    os.makedirs(args.work, exist_ok=True)
    spec = TinyQwen3Spec(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=WORDS,
    )
    target = make_tiny_qwen3(os.path.join(args.work, "target"), spec)
    make_tokenizer(target, spec.vocab_size)
    drafter = make_tiny_dflash(os.path.join(args.work, "drafter"), spec)
    prompts = [[(7 * p + 3 * i) % 1000 + 1 for i in range(8 + 3 * p % 40)] for p in range(16)]
    base = {
        "target": target,
        "prompts": prompts,
        "max_tokens": args.max_tokens,
        "max_num_seqs": 16,
        "tokenizer": True,
    }
    reference_kwargs = {"attention_backend": "TREE_ATTN", "enforce_eager": False}
    plain = run_jobs({"plain": {**base, "kwargs": reference_kwargs}}, args.work, 1, 400, deadline)
    if "error" in plain["plain"]:
        print(plain["plain"]["error"])
        return 1
    mix = option_mix(plain["plain"]["batched"])
    options = {**base, "prompt_params": mix}
    reference = run_jobs(
        {"reference": {**options, "kwargs": reference_kwargs}}, args.work, 1, 400, deadline
    )["reference"]
    if "error" in reference:
        print(reference["error"])
        return 1
    oracle_path = os.path.join(tempfile.mkdtemp(), "oracle.json")
    sequences = [p + t for p, t in zip(prompts, reference["batched"], strict=True)]
    with open(oracle_path, "w") as f:
        json.dump({"p_top": 0.7, "seed": 0, "sequences": sequences}, f)
    all_modes = {"eager": {"enforce_eager": True}, "graphs": {"enforce_eager": False}}
    jobs = {}
    for budget in (int(b) for b in args.budgets.split(",")):
        for mode in args.modes.split(","):
            speculative = {"method": "ddtree", "model": drafter, "tree_budget": budget}
            kwargs = {"speculative_config": speculative, **all_modes[mode]}
            jobs[f"b{budget}_{mode}"] = {**options, "kwargs": kwargs, "oracle": oracle_path}
    results = run_jobs(jobs, args.work, 4, 400, deadline)

    bites = {  # each option changes the target alone's answer (the checks are not vacuous)
        json.dumps(mix[p]): reference["batched"][p] != plain["plain"]["batched"][p]
        for p in range(len(prompts))
        if mix[p] and "logprobs" not in mix[p]
    }
    rows = []
    for name, result in results.items():
        row = {"engine": name, "identical": False}
        if "error" in result:
            rows.append({**row, "error": result["error"]})
            continue
        metrics = result["metrics"]
        drafts = metrics.get("vllm:spec_decode_num_drafts") or 0
        accepted = metrics.get("vllm:spec_decode_num_accepted_tokens") or 0
        per_prompt = []
        for p, own in enumerate(mix):
            got, want = result["batched"][p], reference["batched"][p]
            gap = logprob_gap(result["logprobs"][p], reference["logprobs"][p])
            per_prompt.append(
                {
                    "options": sorted(own),
                    "first_divergence": first_divergence(got, want),
                    "logprob_gap": gap,
                }
            )
        identical = all(
            r["first_divergence"] is None
            and (r["logprob_gap"] is None or r["logprob_gap"] <= args.tolerance)
            for r in per_prompt
        )
        rows.append(
            {
                **row,
                "identical": identical,
                "runner": result["runner"],
                "cudagraph_mode": result["cudagraph_mode"],
                "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
                "tokens_checked": sum(map(len, result["batched"])),
                "prompts": per_prompt,
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "prompts"}))
    summary = {
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "target": {**spec.__dict__, "max_model_len": MAX_MODEL_LEN},
        "drafter": "test oracle, p_top 0.7, drafting the target alone's answer with options",
        "reference": "target alone, TREE_ATTN, CUDA graphs, the same batch of 16",
        "triton_f32_dots": os.environ.get("TRITON_F32_DEFAULT"),
        "logprob_tolerance": args.tolerance,
        "options": mix,
        "options_change_the_answer": bites,
        "max_logprob_gap": max(
            (
                p["logprob_gap"]
                for r in rows
                for p in r.get("prompts", [])
                if p["logprob_gap"] is not None
            ),
            default=None,
        ),
        "runs": rows,
        "seconds": time.time() - started,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lossless_options.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, "lossless_options.md"), "w") as f:
        f.write(markdown(summary))
    passed = bool(rows) and all(r["identical"] for r in rows) and all(bites.values())
    print(json.dumps({"passed": passed, "options_change_the_answer": bites}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
