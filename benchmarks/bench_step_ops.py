"""Host and device cost of each DDTree step operation on a GPU, without vLLM.

A small model's DDTree step is host-bound (the profile in
``benchmarks/results/2026-11-30_df6dc25_v2/profile/``): what a step operation costs is mostly the
host time of its launches. For each operation of the V2 tree step this times, on random inputs
of one pair's shapes (``--shape``: SmolLM2-135M and the project's drafter, or Qwen3-8B and
z-lab's DFlash drafter; ``SHAPES``; the drafter's depth 15):

* host: wall time per call of ``--calls`` calls issued back to back (no synchronisation in
  between), i.e. what the Python side and the launches cost;
* device: CUDA-event time per call over the same calls.

Operations: the drafter's logits (its mask rows times the output head) and the test oracle's
synthetic logits that replace them in scale-model runs, the tree build (``build_draft_trees``
at the engine's default per-depth cap; ``build_trees_torch_top_k``: the same with PyTorch's
top-k and vLLM's log-softmax gather in place of ``ops/top_candidates.py``), the step's trees
from the proposal store (steady step: the drafter's rows in place; other steps: flush +
select), the step inputs (positions + ancestor masks), the walk (``walk_and_emit``), the KV
commit over every layer (``commit_accepted_kv_at``) and the drafter-context rows
(``move_path_rows``).

    python -m benchmarks.bench_step_ops --out DIR [--batches 1,16] [--budgets 16,64] \
        [--shape qwen3-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.config import DEFAULT_TOP_K_CAP
from vllm_ddtree.ops.drafter_rows import move_path_rows
from vllm_ddtree.ops.kv_commit import PagedKVLayers, commit_accepted_kv_at
from vllm_ddtree.ops.tree_build import build_draft_trees, build_trees_triton
from vllm_ddtree.ops.tree_inputs import tree_step_inputs_triton
from vllm_ddtree.ops.tree_walk import walk_and_emit
from vllm_ddtree.spec_decode.proposal_store import ProposalStore
from vllm_ddtree.testing.synthetic_acceptance import (
    RankModel,
    RankRows,
    sample_ranks,
    synthetic_logits,
)

BLOCK, DEPTH = 16, 15  # KV block size; the drafter's depth


@dataclass(frozen=True)
class StepShapes:
    """The shapes a step's operations see: the target's vocabulary, hidden size, attention
    layers and KV heads x head dim, and the drafter's feature layers."""

    vocab: int
    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    features: int


SHAPES = {
    "smollm2": StepShapes(49152, 576, 30, 3, 64, 4),  # SmolLM2-135M + the project's drafter
    "qwen3-8b": StepShapes(151936, 4096, 36, 8, 128, 5),  # Qwen3-8B + z-lab's DFlash drafter
}


def timed(fn, calls: int) -> dict:
    """Host and device milliseconds per call of ``fn`` (after two warm-up calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    start_event.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    end_event.record()
    torch.cuda.synchronize()
    return {"host_ms": 1000 * host, "device_ms": start_event.elapsed_time(end_event) / calls}


def step_ops(
    batch: int, budget: int, calls: int, device: torch.device, shape: StepShapes = SHAPES["smollm2"]
) -> dict:
    """Every operation once per call at this batch size and budget."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(batch, DEPTH, shape.vocab, generator=gen) * 4).to(device, torch.bfloat16)
    cap = min(budget, DEFAULT_TOP_K_CAP)  # the engine's default per-depth cap
    trees = build_draft_trees(logits, budget, cap)
    rows_per_req = budget + 1
    total = batch * rows_per_req
    root = torch.arange(batch, device=device) * rows_per_req
    num_draft = torch.full((batch,), budget, device=device)
    positions = torch.arange(total, device=device) + 100
    # The target's token at every row: follow the first child twice, then stop.
    chosen = torch.zeros(total, dtype=torch.long, device=device)
    chosen[root] = trees.token_ids[:, 0]
    chosen[root + 1] = trees.token_ids[:, 1]
    num_blocks = batch * (rows_per_req + 512) // BLOCK + 1
    cache_shape = (2, num_blocks, BLOCK, shape.kv_heads, shape.head_dim)
    caches = [torch.zeros(cache_shape, device=device) for _ in range(shape.layers)]
    layers = PagedKVLayers.of([c[0] for c in caches], [c[1] for c in caches])
    slot_mapping = torch.arange(total, device=device) + 512
    hidden = [torch.randn(total, shape.hidden, device=device) for _ in range(shape.features)]
    input_ids = torch.zeros(total, dtype=torch.int32, device=device)
    accepted, num_accepted, _, _ = walk_and_emit(trees, chosen, root, num_draft, DEPTH + 2)

    store = ProposalStore(batch, budget, DEPTH, device)
    rows = np.arange(batch)
    index = torch.arange(batch, device=device, dtype=torch.int32)
    drafts_np = np.full(batch, budget)
    req_ids = [f"request-{row}" for row in rows]

    def steady():
        store.write_batch(trees)
        store.proposed(rows, index, req_ids)
        store.take(rows, req_ids)
        store.step_trees(rows, index, drafts_np, num_draft)

    def reordered():
        store.write_batch(trees)
        store.proposed(rows[::-1].copy(), index.flip(0), req_ids[::-1])
        store.take(rows, req_ids)
        store.step_trees(rows, index, drafts_np, num_draft)

    # The drafter's logits (its real cost, kept under the test oracle) and the oracle's
    # synthetic ones that replace them in scale-model runs (test switch, same for the chain).
    lm_head = torch.randn(shape.vocab, shape.hidden, device=device, dtype=torch.bfloat16)
    mask_rows = torch.randn(batch * DEPTH, shape.hidden, device=device, dtype=torch.bfloat16)
    ranks_model = RankRows.broadcast(RankModel(p_top=0.8, decay=0.97), batch, device)
    truth = torch.randint(0, shape.vocab, (batch, DEPTH), device=device)

    def oracle_logits():
        ranks = sample_ranks(ranks_model, batch, DEPTH, device=device)
        return synthetic_logits(ranks_model, truth, ranks, shape.vocab)

    ops = {
        "drafter_logits": lambda: mask_rows @ lm_head.T,
        "oracle_logits": oracle_logits,
        "build_trees": lambda: build_draft_trees(logits, budget, cap),
        "build_trees_torch_top_k": lambda: build_trees_triton(
            logits, budget, cap, fused_candidates=False
        ),
        "proposal_steady": steady,
        "proposal_flush_select": reordered,
        "step_inputs": lambda: tree_step_inputs_triton(
            trees, root, num_draft, num_draft + 1, positions, total
        ),
        "walk": lambda: walk_and_emit(trees, chosen, root, num_draft, DEPTH + 2),
        "kv_commit_all_layers": lambda: commit_accepted_kv_at(
            layers, slot_mapping, root, accepted, num_accepted
        ),
        "drafter_rows": lambda: move_path_rows(
            input_ids, positions, hidden, root, accepted, num_accepted, num_draft, budget
        ),
    }
    return {name: timed(fn, calls) for name, fn in ops.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_ops.py needs a CUDA GPU")
    device = torch.device("cuda")
    commit = (
        os.environ.get("VLLM_DDTREE_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    rows = []
    for batch in map(int, args.batches.split(",")):
        for budget in map(int, args.budgets.split(",")):
            costs = step_ops(batch, budget, args.calls, device, SHAPES[args.shape])
            for name, cost in costs.items():
                row = {"op": name, "batch": batch, "budget": budget, **cost}
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    summary = {
        "commit": commit,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "calls": args.calls,
        "shape": args.shape,
        "rows": rows,
    }
    with open(os.path.join(args.out, "bench_step_ops.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
