"""Each depth's tree candidates on a GPU: the fused kernels against PyTorch's top-k.

The tree build starts from each drafted depth's most probable tokens and their
log-probabilities (``vllm_ddtree/ops/top_candidates.py``: two launches, one read of the
logits). This checks them against their reference (``torch.topk`` and the float32 log-softmax
of the row) at a drafter's logits shape, and times per call, as device ms:

* ``fused``: ``top_candidates_triton``;
* ``torch_top_k``: ``torch.topk`` alone, a lower bound of what the tree build took before
  (PyTorch's top-k, then vLLM's log-softmax gather at the chosen tokens);
* ``reference``: ``torch.topk`` and the float32 log-softmax of the whole row.

Each from CUDA-graph replays (the V2 drafter's graph holds the tree build) and from
back-to-back launches. Rows: requests x the drafter's depth (15), at the vocabulary given
(Qwen3's 151936 by default); logits in bf16 (a drafter's) and float32 (the scale models'
synthetic ones). Needs torch and Triton only.

    python -m benchmarks top-candidates --out DIR [--requests 1,16] [--cap 16] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.common import git_commit, timed_ms
from vllm_ddtree.ops.top_candidates import top_candidates_ref, top_candidates_triton

DEPTH = 15  # the drafter's depth: rows per request


def check(logits: torch.Tensor, cap: int) -> dict:
    """Whether the fused candidates are the reference's: each row's distinct tokens whose
    logits equal the reference's, in its order (tied logits may name other tokens: random
    bf16 logits tie), and log-probabilities within float32 rounding."""
    want_lp, want_tokens = top_candidates_ref(logits, cap)
    got_lp, got_tokens = top_candidates_triton(logits, cap)
    want_logits, got_logits = logits.gather(-1, want_tokens), logits.gather(-1, got_tokens)
    distinct = got_tokens.sort(dim=-1).values.diff(dim=-1).ne(0).all()
    finite = torch.isfinite(want_lp)
    gap = float((got_lp[finite] - want_lp[finite]).abs().max()) if finite.any() else 0.0
    return {
        "equal": bool(torch.equal(got_logits, want_logits)) and bool(distinct),
        "same_tokens": float(got_tokens.eq(want_tokens).double().mean()),
        "max_log_prob_gap": gap,
    }


def row(requests: int, vocab: int, cap: int, dtype: torch.dtype, calls: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(requests)
    logits = (torch.randn(requests, DEPTH, vocab, generator=gen) * 4).to("cuda", dtype)
    paths = {
        "fused": lambda: top_candidates_triton(logits, cap),
        "torch_top_k": lambda: torch.topk(logits, cap, dim=-1),
        "reference": lambda: top_candidates_ref(logits, cap),
    }
    out = {"requests": requests, "rows": requests * DEPTH, "dtype": str(dtype).split(".")[-1]}
    out.update(check(logits, cap))
    for name, fn in paths.items():
        out[f"{name}_graph_ms"] = timed_ms(fn, calls, graph=True)
        out[f"{name}_launch_ms"] = timed_ms(fn, calls, graph=False)
    return out


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| requests | rows | dtype | equal logits | fused ms (graph) | torch.topk ms (graph) "
        "| reference ms (graph) | fused ms (launches) | torch.topk ms (launches) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['requests']} | {r['rows']} | {r['dtype']} | {r['equal']} "
            f"| {r['fused_graph_ms']:.4f} | {r['torch_top_k_graph_ms']:.4f} "
            f"| {r['reference_graph_ms']:.4f} | {r['fused_launch_ms']:.4f} "
            f"| {r['torch_top_k_launch_ms']:.4f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", default="1,4,16,64")
    parser.add_argument("--cap", type=int, default=16, help="candidates per depth")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("top-candidates times CUDA kernels: it needs a GPU")
    rows = [
        row(int(requests), args.vocab, args.cap, dtype, args.calls)
        for dtype in (torch.bfloat16, torch.float32)
        for requests in args.requests.split(",")
    ]
    result = {
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "vocab": args.vocab,
        "cap": args.cap,
        "calls": args.calls,
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "top_candidates.json"), "w") as f:
        json.dump(result, f, indent=1)
    header = [
        f"# Tree candidates at vocabulary {args.vocab}, cap {args.cap}",
        "",
        f"Commit {result['commit']}, {result['gpu']}; device ms per call, {args.calls} calls.",
        "",
    ]
    text = "\n".join(header + table(rows)) + "\n"
    with open(os.path.join(args.out, "top_candidates.md"), "w") as f:
        f.write(text)
    print(text)
    if not all(r["equal"] for r in rows):
        raise SystemExit("the fused candidates differ from the reference's")


if __name__ == "__main__":
    main()
