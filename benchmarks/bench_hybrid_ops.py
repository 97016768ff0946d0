"""Device time of a GatedDeltaNet layer's tree operations at a hybrid target's shapes (GPU).

On the Qwen3.6-27B-shaped scale model a DDTree step of budget 32 took 63.8 ms where the DFlash
chain's took 47.8 and AR's 18.5 (``results/2026-12-05_882bf05_scale-27b-first-tree``). This
times, per GatedDeltaNet layer and for the model's number of them, what the tree path runs in
place of vLLM's speculative kernels, with the arguments the step passes: the tree recurrence
(``ops/tree_gated_delta.py``'s packed launch, gates computed in it, at each launch: blocks of
``--block-v`` V columns, ``--num-warps`` warps) and the tree conv (``ops/tree_causal_conv.py``),
on one request's best-first tree of each budget (``tree.build_trees`` on random drafter logits)
and on a chain of 16 tokens (what the chain verifies) through the same kernels; and vLLM's own
speculative recurrence (``fused_sigmoid_gating_delta_rule_update``, the chain's) on the 16
tokens where vLLM is importable, and its speculative conv update (``causal_conv1d_update``)
there too. Also the commit after the walk, for all the model's GDN layers
at once (``ops/gdn_commit.py``: the accepted leaf's state and the conv window), as served:
eager, by the PyTorch ops per layer and by the one-launch kernel. States are float32 in
vLLM's ``[slots, Hv, V, K]`` layout, as DDTree serves hybrids. A time is a CUDA-graph
replay's (what a verify in a FULL graph pays; the commit's: eager launches back to back, host
included), the median of ``--rounds`` timings of ``--replays`` calls each.

    python -m benchmarks hybrid-ops --model qwen3.6-27b --budgets 16,32,64,128 --out DIR

``--cpu`` runs the same cases through the PyTorch references on a ``--shrink``'ed model (the
plumbing only; its times say nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.common import git_commit, timed_ms
from vllm_ddtree.hybrid.gdn_state import GDNStateShapes
from vllm_ddtree.ops.gdn_commit import GDNStateLayers, commit_gdn_states, commit_gdn_states_ref
from vllm_ddtree.ops.tree_causal_conv import (
    tree_causal_conv1d_packed,
    tree_causal_conv1d_packed_ref,
)
from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta_packed, tree_gated_delta_packed_ref
from vllm_ddtree.testing.scale_models import SCALE_MODELS, ScaleModel, target_config
from vllm_ddtree.tree import build_trees

CHAIN_TOKENS = 16  # the DFlash chain's verify: the bonus token and 15 drafts
DRAFT_DEPTH = 15


def gdn_shapes(model: ScaleModel) -> GDNStateShapes:
    """The GatedDeltaNet shapes of ``model``'s target, read from its config as the plugin
    reads a served target's."""
    if not model.hybrid:
        raise ValueError(f"{model.name} has no GatedDeltaNet layers")
    return GDNStateShapes.from_hf_config(target_config(model)[0])


def random_tensor(gen: torch.Generator, device: torch.device, *shape, dtype=torch.bfloat16):
    """Standard normal values of ``shape`` from ``gen``, on ``device`` in ``dtype``."""
    return torch.randn(*shape, generator=gen).to(device, dtype)


def tree_parents(budget: int, seed: int = 0, vocab: int = 64) -> torch.Tensor:
    """The kernels' parents (``-1`` for the root, then each node's tree index) of one
    request's best-first tree of ``budget`` nodes, built from random drafter logits (sharp
    enough that the tree is deep as well as wide)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(1, DRAFT_DEPTH, vocab, generator=gen)
    trees = build_trees(logits, budget)
    count = int(trees.num_nodes[0])
    return torch.cat([torch.tensor([-1]), trees.parents[0, :count]])


def chain_parents(tokens: int = CHAIN_TOKENS) -> torch.Tensor:
    """A chain's parents: each token's is the one before it."""
    return torch.arange(-1, tokens - 1)


def layer_ops(shapes: GDNStateShapes, parents: torch.Tensor, device: torch.device) -> dict:
    """One GDN layer's tree ops over one request's tree (``parents``), on random inputs, as the
    step calls them (``HybridTreeStep.tree_conv`` / ``tree_recurrence``): the packed launches
    on vLLM's arguments, q/k/v views of the conv output, raw gates, the SSM cache behind a
    block table, the commit's buffers kept. ``{"recurrence": fn(block_v, num_warps), "conv":
    fn()}``: the Triton kernels on a GPU (``block_v`` and ``num_warps``, the recurrence's
    launch), the references elsewhere (the launch unused)."""
    gen = torch.Generator().manual_seed(1)
    tokens = parents.numel()
    hk, hv = shapes.num_k_heads, shapes.num_v_heads
    dk, dv = shapes.head_k_dim, shapes.head_v_dim

    def rand(*shape, dtype=torch.bfloat16):
        return random_tensor(gen, device, *shape, dtype=dtype)

    starts = torch.tensor([0, tokens], device=device, dtype=torch.int32)
    parents = parents.view(1, -1).to(device)
    num_tokens = torch.tensor([tokens], device=device)
    mixed = rand(tokens, shapes.conv_dim)  # the conv's output: q, k, v are views of it
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    gates = rand(tokens, 2 * hv)
    a_log, dt_bias = rand(hv, dtype=torch.float32), rand(hv, dtype=torch.float32)
    # vLLM's SSM cache [blocks, Hv, V, K], float32: one block per node, the committed one 0.
    ssm_cache = 0.1 * rand(tokens + 1, hv, dv, dk, dtype=torch.float32)
    table = torch.arange(1, tokens + 1, device=device, dtype=torch.int32).view(1, -1)
    num_accepted = torch.tensor([1], device=device, dtype=torch.int32)
    saved_slots = torch.zeros(2, tokens, dtype=torch.int32, device=device)
    recurrence_args = (
        q.view(tokens, hk, dk),
        k.view(tokens, hk, dk),
        v.view(tokens, hv, dv),
        gates[:, :hv],
        gates[:, hv:],
        a_log,
        dt_bias,
        starts,
        parents,
        num_tokens,
        ssm_cache.transpose(-1, -2),
        table,
        num_accepted,
    )
    x = rand(tokens, shapes.conv_dim)
    # vLLM's conv block: K - 1 + B columns, the window read from column num_accepted - 1.
    conv_state = rand(2, shapes.conv_dim, shapes.conv_kernel - 1 + tokens - 1)
    weight = rand(shapes.conv_dim, shapes.conv_kernel)
    conv_index = torch.tensor([1], device=device, dtype=torch.int32)
    saved_inputs = torch.zeros(2, tokens, shapes.conv_dim, dtype=x.dtype, device=device)
    saved_index = torch.zeros(2, dtype=torch.int32, device=device)
    saved_offset = torch.zeros(2, dtype=torch.int32, device=device)
    conv_args = (x, starts, parents, num_tokens, conv_state, conv_index, weight)
    saves = {
        "saved_inputs": saved_inputs,
        "saved_index": saved_index,
        "num_accepted": num_accepted,
        "saved_offset": saved_offset,
    }
    if device.type == "cuda":
        return {
            "recurrence": lambda block_v, num_warps: tree_gated_delta_packed(
                *recurrence_args, saved_slots=saved_slots, block_v=block_v, num_warps=num_warps
            ),
            "conv": lambda: tree_causal_conv1d_packed(*conv_args, **saves),
        }
    return {
        "recurrence": lambda block_v, num_warps: tree_gated_delta_packed_ref(
            *recurrence_args, saved_slots=saved_slots
        ),
        "conv": lambda: tree_causal_conv1d_packed_ref(*conv_args, **saves),
    }


def deepest_path(parents: torch.Tensor) -> list[int]:
    """Tree indices of the root-to-node path to the tree's deepest node, root first."""
    depth = [0] * parents.numel()
    for t in range(1, parents.numel()):
        depth[t] = depth[int(parents[t])] + 1
    path = [max(range(parents.numel()), key=depth.__getitem__)]
    while path[-1] != 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def model_commit(
    shapes: GDNStateShapes, parents: torch.Tensor, device: torch.device
) -> dict[str, Callable[[], None]]:
    """The commit of one request's walk down its tree's deepest path in every GDN layer of the
    model: ``{"PyTorch ops": fn, "one launch": fn}`` (the kernel on a GPU only). Each layer's
    SSM cache holds the null block and two others, the leaf's and the destination."""
    gen = torch.Generator().manual_seed(3)
    tokens = parents.numel()
    path = deepest_path(parents)
    taken = len(path) - 1
    hv, dv, dk = shapes.num_v_heads, shapes.head_v_dim, shapes.head_k_dim
    kept = shapes.conv_kernel - 1
    table = torch.ones(2, tokens, dtype=torch.int32)
    table[0, taken] = 2  # the destination; the leaf (and every other node) in block 1
    groups = ([], [], [], [], [], [])
    for _ in range(shapes.num_gdn_layers):
        groups[0].append(torch.zeros(3, hv, dv, dk, device=device))
        groups[1].append(table.to(device))
        window = random_tensor(gen, device, 3, kept + tokens - 1, shapes.conv_dim)
        groups[2].append(window.transpose(1, 2))  # vLLM's window-first layout, seen [C, K-1+B]
        groups[3].append(torch.ones(2, dtype=torch.int32, device=device))
        groups[4].append(random_tensor(gen, device, 2, tokens, shapes.conv_dim))
        groups[5].append(torch.zeros(2, dtype=torch.int32, device=device))
    layers = GDNStateLayers.of(*groups, window=kept)
    accepted = torch.tensor([path], device=device)
    num_accepted = torch.tensor([taken], device=device)
    num_draft = torch.tensor([tokens - 1], device=device)
    batch = (layers, accepted, num_accepted, num_draft)
    commits = {"PyTorch ops": functools.partial(commit_gdn_states_ref, *batch)}
    if device.type == "cuda":
        commits["one launch"] = functools.partial(commit_gdn_states, *batch)
    return commits


def vllm_chain_recurrence(
    shapes: GDNStateShapes, device: torch.device
) -> Callable[[], torch.Tensor] | None:
    """vLLM's speculative recurrence over one request's chain of ``CHAIN_TOKENS`` (what the
    DFlash chain's verify runs per GDN layer), or None where vLLM's kernel is not importable."""
    try:
        from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
            fused_sigmoid_gating_delta_rule_update,
        )
    except Exception:  # vLLM absent (e.g. a host without its bundle)
        return None
    gen = torch.Generator().manual_seed(2)
    n, hk, hv = CHAIN_TOKENS, shapes.num_k_heads, shapes.num_v_heads
    dk, dv = shapes.head_k_dim, shapes.head_v_dim

    def rand(*shape, dtype=torch.bfloat16):
        return random_tensor(gen, device, *shape, dtype=dtype)

    q, k, v = rand(1, n, hk, dk), rand(1, n, hk, dk), rand(1, n, hv, dv)
    a, b = rand(n, hv), rand(n, hv)
    a_log, dt_bias = rand(hv, dtype=torch.float32), rand(hv, dtype=torch.float32)
    state = 0.1 * rand(n + 1, hv, dv, dk, dtype=torch.float32)
    cu_seqlens = torch.tensor([0, n], device=device, dtype=torch.int32)
    # Blocks 1..n: vLLM's kernel skips a request whose start block is 0, its null block.
    indices = torch.arange(1, n + 1, device=device, dtype=torch.int32).view(1, -1)
    accepted = torch.tensor([1], device=device, dtype=torch.int32)

    def run():
        out, _ = fused_sigmoid_gating_delta_rule_update(
            A_log=a_log,
            a=a,
            b=b,
            dt_bias=dt_bias,
            q=q,
            k=k,
            v=v,
            initial_state=state,
            inplace_final_state=True,
            cu_seqlens=cu_seqlens,
            ssm_state_indices=indices,
            num_accepted_tokens=accepted,
            use_qk_l2norm_in_kernel=True,
        )
        return out

    return run


def vllm_chain_conv(shapes: GDNStateShapes, device: torch.device) -> Callable[[], torch.Tensor]:
    """vLLM's speculative conv update over one request's chain of ``CHAIN_TOKENS`` (what the
    DFlash chain's verify runs per GDN layer before the recurrence), as its GDN layer calls
    it: the packed tokens, the window-first conv cache seen ``[blocks, C, K - 1 + drafts]``,
    the request's block, ``num_accepted_tokens`` and ``query_start_loc``."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    gen = torch.Generator().manual_seed(3)
    n, channels, width = CHAIN_TOKENS, shapes.conv_dim, shapes.conv_kernel
    x = random_tensor(gen, device, n, channels)
    cache = random_tensor(gen, device, 2, width - 1 + CHAIN_TOKENS - 1, channels)
    weight = random_tensor(gen, device, channels, width)
    block = torch.tensor([1], device=device, dtype=torch.int32)
    accepted = torch.tensor([1], device=device, dtype=torch.int32)
    query_start_loc = torch.tensor([0, n], device=device, dtype=torch.int32)

    def run():
        return causal_conv1d_update(
            x,
            cache.transpose(-1, -2),
            weight,
            None,
            "silu",
            conv_state_indices=block,
            num_accepted_tokens=accepted,
            query_start_loc=query_start_loc,
            max_query_len=n,
            validate_data=False,
        )

    return run


def time_ms(fn: Callable[[], object], device: torch.device, replays: int, rounds: int) -> float:
    """Milliseconds per call of ``fn``: on a GPU, ``replays`` replays of a CUDA graph of one
    call (``common.timed_ms``, the median of ``rounds``); elsewhere wall time."""
    if device.type == "cuda":
        return timed_ms(fn, replays, graph=True, rounds=rounds)
    fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(replays):
            fn()
        samples.append(1e3 * (time.perf_counter() - start) / replays)
    return statistics.median(samples)


def measure(
    shapes: GDNStateShapes,
    budgets: list[int],
    launches: list[tuple[int, int]],
    device: torch.device,
    replays: int,
    rounds: int,
) -> list[dict]:
    """Rows ``{case, tokens, op, block_v, num_warps, layer_ms, model_ms}``: the chain of 16 and
    a tree of each budget, each op per layer and times the model's GDN layers; the recurrence
    at each of ``launches`` (``(block_v, num_warps)``)."""
    cases = [("chain", chain_parents())] + [(f"b{b}", tree_parents(b)) for b in budgets]
    rows = []

    def record(case: str, tokens: int, op: str, launch: tuple | None, layer_ms: float):
        block_v, num_warps = launch or (None, None)
        row = {
            "case": case,
            "tokens": tokens,
            "op": op,
            "block_v": block_v,
            "num_warps": num_warps,
            "layer_ms": layer_ms,
            "model_ms": layer_ms * shapes.num_gdn_layers,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    def add(case: str, tokens: int, op: str, launch: tuple | None, fn: Callable[[], object]):
        record(case, tokens, op, launch, time_ms(fn, device, replays, rounds))

    def add_model(case: str, tokens: int, op: str, fn: Callable[[], object]):
        """An op over every GDN layer at once, timed eagerly (launches and host included)."""
        if device.type == "cuda":
            ms = timed_ms(fn, replays, graph=False, rounds=rounds)
        else:
            ms = time_ms(fn, device, replays, rounds)
        record(case, tokens, op, None, ms / shapes.num_gdn_layers)

    for case, parents in cases:
        ops = layer_ops(shapes, parents, device)
        for launch in launches:
            recurrence = functools.partial(ops["recurrence"], *launch)
            add(case, parents.numel(), "tree recurrence", launch, recurrence)
        add(case, parents.numel(), "tree conv", None, ops["conv"])
        if case != "chain":
            for how, commit in model_commit(shapes, parents, device).items():
                add_model(case, parents.numel(), f"commit, {how} (eager)", commit)
    chain = vllm_chain_recurrence(shapes, device) if device.type == "cuda" else None
    if chain is not None:
        add("chain", CHAIN_TOKENS, "vLLM recurrence", None, chain)
        add("chain", CHAIN_TOKENS, "vLLM conv", None, vllm_chain_conv(shapes, device))
    return rows


def markdown(summary: dict) -> str:
    """The report: one line per case and op, per layer and for the model's GDN layers."""
    timing = (
        "wall time of the PyTorch references" if summary["gpu"] == "cpu" else "CUDA-graph replays"
    )
    lines = [
        f"# GatedDeltaNet tree ops at {summary['model']}'s shapes",
        "",
        f"Commit {summary['commit']}, {summary['gpu']}; {summary['layers']} GatedDeltaNet "
        f"layers; one request; float32 states; {timing} (median of {summary['rounds']} "
        f"timings of {summary['replays']} calls).",
        "",
        "| case | tokens | op | block_v / warps | ms per layer | ms per step (all GDN layers) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["rows"]:
        launch = f"{row['block_v']} / {row['num_warps']}" if row["block_v"] else "-"
        lines.append(
            f"| {row['case']} | {row['tokens']} | {row['op']} | {launch} | "
            f"{row['layer_ms']:.4f} | {row['model_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3.6-27b", choices=sorted(SCALE_MODELS))
    parser.add_argument("--budgets", default="16,32,64,128")
    parser.add_argument("--block-v", default="8,16,32,64", help="the recurrence's launch blocks")
    parser.add_argument("--num-warps", default="2,4", help="the recurrence's warps per program")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="the references on a shrunk model")
    parser.add_argument("--shrink", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    model = SCALE_MODELS[args.model]
    if args.cpu:
        model, device = model.shrunk(args.shrink), torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        parser.error("no CUDA GPU: pass --cpu for the references on a shrunk model")
    shapes = gdn_shapes(model)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    launches = [
        (int(b), int(w))
        for b in args.block_v.split(",")
        if b
        for w in args.num_warps.split(",")
        if w
    ]
    rows = measure(shapes, budgets, launches, device, args.replays, args.rounds)
    summary = {
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": model.name,
        "layers": shapes.num_gdn_layers,
        "replays": args.replays,
        "rounds": args.rounds,
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hybrid_ops.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, "hybrid_ops.md"), "w") as f:
        f.write(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
