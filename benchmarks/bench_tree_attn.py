"""TREE_ATTN on a GPU: correctness over a shape grid, then speed side by side.

Check phase: the Triton kernel against the float32 PyTorch reference on random mixed batches
(trees, prefills, decodes, empty trees), head sizes 64/128/256, bf16/fp16, GQA 1/4/8, KV block
sizes 16/32, sliding windows, contexts not multiples of the block size.

Speed phase (Qwen3-8B attention shape: 32 query heads, 8 KV heads, head size 128, bf16, KV block
16), for trees of 16/64/256/1024 nodes x contexts 1k/8k/32k x batch 1/8/32, each in one run:
  * tree:  this kernel, every request a random DDTree of that many nodes (+ root);
  * chain: vLLM's TRITON_ATTN kernel (unified_attention), causal, same number of query tokens
           per request - the floor a tree cannot beat;
  * sdpa:  the dense-mask verify the reference DDTree uses (torch SDPA, additive mask over
           contiguous K/V, GQA), also the float32 correctness reference for the speed grid;
  * bytes: the fewest bytes a pass must move (K/V of every request once, Q and O) over time,
           against the device-to-device copy bandwidth measured first.
Medians of triton.testing.do_bench. Writes JSON + a markdown table.

    python -m benchmarks.bench_tree_attn --out benchmarks/results [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from benchmarks.common import git_commit
from tree_attn_backend.ops.tree_attention import (
    tree_attention,
    tree_attention_ref,
    unpack_tree_mask,
)
from tree_attn_backend.testing import (
    AttentionCase,
    flash_context_path,
    random_case,
    relative_error,
)

BF16_TOLERANCE = 1e-2  # relative error for bf16/fp16 operands (float32 accumulation)


def median_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (GB/s)."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- check phase
def check_grid(quick: bool) -> list[dict]:
    rows = []
    shapes = [(32, 8, 128), (16, 16, 64), (8, 1, 256), (28, 4, 128)]
    batches = {
        "mixed": [
            ("tree", 1000, 63),
            ("causal", 17, 40),
            ("causal", 333, 1),
            ("tree", 50, 0),
            ("tree", 77, 255),
            ("causal", 0, 129),
        ],
        "trees": [("tree", 4097, 1024), ("tree", 123, 16), ("tree", 999, 256)],
    }
    for dtype in (torch.bfloat16, torch.float16):
        for hq, hkv, d in shapes:
            for block_size in (16, 32):
                for batch_name, requests in batches.items():
                    for window in (None, 300):
                        if quick and (block_size == 32 or window):
                            continue
                        case = random_case(
                            requests, hq, hkv, d, block_size, dtype, "cuda", seed=len(rows)
                        )
                        out = torch.full_like(case.q, float("nan"))
                        tree_attention(
                            **case.kwargs(),
                            max_query_len=case.max_query_len,
                            sliding_window=window,
                            out=out,
                        )
                        ref = tree_attention_ref(
                            **{
                                **case.kwargs(),
                                "q": case.q.float(),
                                "key_cache": case.key_cache.float(),
                                "value_cache": case.value_cache.float(),
                            },
                            sliding_window=window,
                        )
                        err = relative_error(out, ref)
                        rows.append(
                            dict(
                                dtype=str(dtype).removeprefix("torch."),
                                num_heads=hq,
                                num_kv_heads=hkv,
                                head_size=d,
                                block_size=block_size,
                                batch=batch_name,
                                sliding_window=window,
                                rel_error=err,
                                ok=bool(err < BF16_TOLERANCE),
                            )
                        )
    return rows


# ----------------------------------------------------------------------------- speed phase
def chain_case(case: AttentionCase) -> AttentionCase:
    """Same requests and query counts, every request causal (a DFlash-style chain)."""
    return AttentionCase(**{**case.__dict__, "is_tree": torch.zeros_like(case.is_tree)})


def make_chain_runner(case: AttentionCase):
    """vLLM's TRITON_ATTN kernel on the same paged cache, causal."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    out = torch.empty_like(case.q)
    num_seqs = case.seq_lens.shape[0]
    ones = torch.ones(1, dtype=torch.float32, device="cuda")
    descale = ones.expand(num_seqs, case.key_cache.shape[2])
    max_seq_len = int(case.seq_lens.max())

    def run():
        unified_attention(
            q=case.q,
            k=case.key_cache,
            v=case.value_cache,
            out=out,
            cu_seqlens_q=case.query_start_loc,
            max_seqlen_q=case.max_query_len,
            seqused_k=case.seq_lens,
            max_seqlen_k=max_seq_len,
            softmax_scale=case.scale,
            causal=True,
            window_size=(-1, -1),
            block_table=case.block_table,
            softcap=0,
            q_descale=None,
            k_descale=descale,
            v_descale=descale,
        )
        return out

    return run


def dense_inputs(case: AttentionCase):
    """Contiguous K/V and an additive mask per request, as the reference DDTree builds them."""
    block_size = case.key_cache.shape[1]
    starts = case.query_start_loc.tolist()
    seq_lens = case.seq_lens.tolist()
    batch = len(seq_lens)
    q_len = starts[1] - starts[0]
    max_seq = max(seq_lens)
    hkv, d = case.key_cache.shape[2], case.key_cache.shape[3]
    keys = torch.zeros(batch, hkv, max_seq, d, dtype=case.q.dtype, device=case.q.device)
    values = torch.zeros_like(keys)
    mask = torch.full(
        (batch, 1, q_len, max_seq), float("-inf"), dtype=case.q.dtype, device=case.q.device
    )
    for r in range(batch):
        idx = torch.arange(seq_lens[r], device=case.q.device)
        blocks = case.block_table[r, idx // block_size].long()
        keys[r, :, : seq_lens[r]] = case.key_cache[blocks, idx % block_size].transpose(0, 1)
        values[r, :, : seq_lens[r]] = case.value_cache[blocks, idx % block_size].transpose(0, 1)
        context = seq_lens[r] - q_len
        mask[r, 0, :, :context] = 0
        visible = unpack_tree_mask(case.tree_mask[starts[r] : starts[r + 1]], q_len)
        mask[r, 0, :, context : seq_lens[r]] = torch.where(visible, 0.0, float("-inf")).to(
            mask.dtype
        )
    query = case.q.view(batch, q_len, *case.q.shape[1:]).transpose(1, 2)
    return query, keys, values, mask


def sdpa(query, keys, values, mask, scale):
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def speed_grid(quick: bool, bandwidth_gbs: float) -> list[dict]:
    nodes_list = [16, 64, 256, 1024]
    contexts = [1024, 8192, 32768]
    batches = [1, 8, 32]
    if quick:
        nodes_list, contexts, batches = [16, 64], [1024, 8192], [1, 8]
    hq, hkv, d, block_size = 32, 8, 128, 16
    rows = []
    for nodes in nodes_list:
        for context in contexts:
            for batch in batches:
                case = random_case(
                    [("tree", context, nodes)] * batch,
                    hq,
                    hkv,
                    d,
                    block_size,
                    torch.bfloat16,
                    "cuda",
                    seed=nodes + context + batch,
                    vocab=256,
                )
                q_len = case.max_query_len
                row = dict(nodes=nodes, context=context, batch=batch, query_tokens=q_len * batch)
                out = torch.empty_like(case.q)

                def run_tree(case=case, out=out):
                    return tree_attention(
                        **case.kwargs(), max_query_len=case.max_query_len, out=out
                    )

                row["tree_ms"] = median_ms(run_tree)
                try:
                    run_chain = make_chain_runner(chain_case(case))
                    run_chain()
                    row["chain_ms"] = median_ms(run_chain)
                except Exception as exc:  # noqa: BLE001 - record why the baseline is missing
                    row["chain_ms"] = None
                    row["chain_error"] = f"{type(exc).__name__}: {exc}"[:300]
                query, keys, values, mask = dense_inputs(case)
                dense = (query, keys, values, mask, case.scale)
                try:
                    row["sdpa_ms"] = median_ms(lambda dense=dense: sdpa(*dense))
                except torch.OutOfMemoryError:
                    row["sdpa_ms"] = None  # the dense mask path does not fit
                try:
                    reference = sdpa(
                        query.float(), keys.float(), values.float(), mask.float(), case.scale
                    ).reshape(case.q.shape)
                except torch.OutOfMemoryError:
                    reference = tree_attention_ref(  # float32, one request at a time
                        **{
                            **case.kwargs(),
                            "q": case.q.float(),
                            "key_cache": case.key_cache.float(),
                            "value_cache": case.value_cache.float(),
                        }
                    )
                row["rel_error_vs_fp32"] = relative_error(run_tree(), reference)
                row["ok"] = bool(row["rel_error_vs_fp32"] < BF16_TOLERANCE)
                del dense, reference
                torch.cuda.empty_cache()
                kv_bytes = int(case.seq_lens.sum()) * hkv * d * 2 * 2
                qo_bytes = 2 * case.q.numel() * 2
                row["min_bytes"] = kv_bytes + qo_bytes
                row["tree_gbs"] = row["min_bytes"] / (row["tree_ms"] * 1e-3) / 1e9
                row["tree_fraction_of_copy_bw"] = row["tree_gbs"] / bandwidth_gbs
                if row["chain_ms"]:
                    row["tree_over_chain"] = row["tree_ms"] / row["chain_ms"]
                if row["sdpa_ms"]:
                    row["sdpa_over_tree"] = row["sdpa_ms"] / row["tree_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    return rows


# (block_m, block_n, num_warps); split-KV segments stay automatic.
TUNE_VARIANTS = [(64, 32, 4), (64, 64, 4), (32, 32, 4), (16, 32, 4), (16, 64, 4), (16, 32, 2)]


def tune(quick: bool) -> list[dict]:
    """Kernel launch variants on a few shapes (the speed grid uses the launcher's defaults)."""
    rows = []
    for nodes, context, batch in [(64, 8192, 1), (64, 8192, 8), (64, 8192, 32), (256, 1024, 8)]:
        case = random_case(
            [("tree", context, nodes)] * batch,
            32,
            8,
            128,
            16,
            torch.bfloat16,
            "cuda",
            seed=1,
            vocab=256,
        )
        out = torch.empty_like(case.q)
        for block_m, block_n, num_warps in TUNE_VARIANTS:
            launch = dict(block_m=block_m, block_n=block_n, num_warps=num_warps)
            try:
                ms = median_ms(
                    lambda case=case, out=out, launch=launch: tree_attention(
                        **case.kwargs(), max_query_len=case.max_query_len, out=out, **launch
                    )
                )
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                ms = None
                print(f"variant failed: {type(exc).__name__}: {exc}"[:200])
            row = dict(nodes=nodes, context=context, batch=batch, **launch, ms=ms)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# The verify widths of the scale grid (1 + budget query tokens per request at 1 to 16
# requests, short and long contexts) and the launch variants timed on them.
VERIFY_SHAPES = [
    (nodes, context, batch)
    for nodes in (16, 32, 64, 128)
    for batch in (1, 4, 16)
    for context in (384, 2048)
]
VERIFY_VARIANTS = [
    (block_m, block_n, num_warps)
    for block_m in (16, 64, 128)
    for block_n in (32, 64)
    for num_warps in (4, 8)
]
# The in-block pass after FlashAttention's context pass reads only the request's own query
# tokens' keys (17 to 129 at these shapes): wider key tiles, down to one tile per program, and
# narrower query blocks, for more programs on a batch of one request. Launches that spill
# registers on sm_90 at head size 128 (64 rows of 128-key tiles, 128 rows of 128) are left out
# (tests/helpers/compile_kernels.py reports a launch's registers and stack).
FLASH_VERIFY_VARIANTS = [
    (16, 32, 4),
    (16, 64, 4),
    (16, 128, 4),
    (32, 32, 4),
    (32, 64, 4),
    (32, 128, 4),
    (32, 128, 8),
    (64, 32, 4),
    (64, 64, 4),
    (64, 64, 8),
    (128, 32, 8),
    (128, 64, 8),
]
# Attention shapes of the targets served: (query heads, KV heads, head size).
ATTENTION_SHAPES = {
    "qwen3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
    "qwen3.6-27b": (24, 4, 256),
}


def median_graph_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph: the device's time, as in the engine's
    FULL graphs (no launch from Python in it)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def make_fa3_chain_runner(batch: int, context: int, shape: tuple[int, int, int], q_len=16):
    """vLLM's FlashAttention 3 (the chain's backend on Hopper), causal, ``q_len`` query tokens
    per request over ``context`` cached ones: what a DFlash chain's verify pays per layer."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    case = random_case([("causal", context, q_len)] * batch, *shape, 16, torch.bfloat16, "cuda")
    out = torch.empty_like(case.q)
    max_seq_len = int(case.seq_lens.max())

    def run():
        flash_attn_varlen_func(
            q=case.q,
            k=case.key_cache,
            v=case.value_cache,
            out=out,
            cu_seqlens_q=case.query_start_loc,
            max_seqlen_q=q_len,
            seqused_k=case.seq_lens,
            max_seqlen_k=max_seq_len,
            softmax_scale=case.scale,
            causal=True,
            block_table=case.block_table,
            fa_version=3,
        )
        return out

    return run


def make_flash_context_runner(case: AttentionCase, out: torch.Tensor, **launch):
    """TREE_ATTN's FlashAttention path (``VLLM_DDTREE_TREE_ATTN_CONTEXT=flash_attn``): vLLM's
    FlashAttention over the committed contexts, then the tree kernel over the in-block keys
    (with ``launch``: block_m, block_n, num_warps), merging."""
    from tree_attn_backend.ops.context_attention import flash_attention_version, split_bound

    version = flash_attention_version(case.q.shape[2], case.q.dtype, case.q.device)
    if version is None:
        raise RuntimeError("vLLM's FlashAttention does not serve this shape here")
    context_lens = case.context_lens()
    max_context_len = int(context_lens.max())
    splits = split_bound(32, case.q.shape[0], case.q.shape[1], case.q.shape[2])

    def run():
        return flash_context_path(
            case, context_lens, version, max_context_len, splits, out=out, **launch
        )[0]

    return run


def tune_verify(
    shape_name: str, graphs: bool, variants=VERIFY_VARIANTS, flash_variants: bool = False
) -> list[dict]:
    """Every launch variant on the verify shapes a served tree step has (``shape_name``'s
    attention shape), beside the launcher's default choice and FlashAttention 3's causal chain
    verify of 16 tokens per request over the same contexts. ``graphs``: timed from CUDA-graph
    replays (device time), else from launches. ``flash_variants``: the variants are the tree
    kernel's launches over the in-block keys after FlashAttention's context pass (the
    FlashAttention path), not over every key."""
    shape = ATTENTION_SHAPES[shape_name]
    timer = median_graph_ms if graphs else median_ms
    rows = []
    for nodes, context, batch in VERIFY_SHAPES:
        case = random_case(
            [("tree", context, nodes)] * batch,
            *shape,
            16,
            torch.bfloat16,
            "cuda",
            seed=nodes + batch,
            vocab=256,
        )
        out = torch.empty_like(case.q)
        row = dict(
            shape=shape_name,
            nodes=nodes,
            context=context,
            batch=batch,
            graphs=graphs,
            variants=[],
            variants_path="flash_context" if flash_variants else "tree_kernel",
        )
        default_out = tree_attention(**case.kwargs(), max_query_len=case.max_query_len).clone()
        row["default_ms"] = timer(
            lambda case=case, out=out: tree_attention(
                **case.kwargs(), max_query_len=case.max_query_len, out=out
            )
        )
        try:
            row["fa3_chain_ms"] = timer(make_fa3_chain_runner(batch, context, shape))
        except Exception as exc:  # noqa: BLE001 - record why the baseline is missing
            row["fa3_chain_ms"] = None
            print(f"FlashAttention 3 chain failed: {type(exc).__name__}: {exc}"[:200])
        row["flash_context_ms"] = row["flash_context_rel_error"] = None
        try:
            flash_out = torch.zeros_like(out)
            row["flash_context_ms"] = timer(make_flash_context_runner(case, flash_out))
            row["flash_context_rel_error"] = relative_error(flash_out, default_out)
        except Exception as exc:  # noqa: BLE001 - record why the row is missing
            print(f"FlashAttention context failed: {type(exc).__name__}: {exc}"[:200])
        for block_m, block_n, num_warps in variants:
            launch = dict(block_m=block_m, block_n=block_n, num_warps=num_warps)
            try:
                out.zero_()
                if flash_variants:
                    ms = timer(make_flash_context_runner(case, out, **launch))
                else:
                    ms = timer(
                        lambda case=case, out=out, launch=launch: tree_attention(
                            **case.kwargs(), max_query_len=case.max_query_len, out=out, **launch
                        )
                    )
                # The same attention as the default launch (float32 accumulation both).
                error = relative_error(out, default_out)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                ms = error = None
                print(f"variant failed: {type(exc).__name__}: {exc}"[:200])
            ok = error is not None and error < BF16_TOLERANCE
            row["variants"].append(dict(**launch, ms=ms if ok else None, rel_error=error))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def verify_markdown(rows: list[dict]) -> list[str]:
    """The verify-shape table: default, fastest variant, FlashAttention 3's chain."""
    lines = [
        "",
        "Verify shapes (queries: 1 + nodes per request); ms per layer, timed "
        + ("from CUDA-graph replays" if rows and rows[0].get("graphs") else "from launches")
        + "; default: the tree kernel over every key; fastest: the fastest launch variant "
        "(block_m, block_n, num_warps) of the tree kernel, or of its in-block pass on the "
        "FlashAttention path where marked fa context; fa context: vLLM's FlashAttention "
        "over the committed context, merged by the tree kernel over the in-block keys "
        "(relative error against default); fa3 chain: FlashAttention 3, causal, 16 tokens "
        "per request over the same context.",
        "",
        "| shape | nodes | context | batch | default ms | fastest ms | fastest variant "
        "| fa context ms (error) | fa3 chain ms | default / fa3 | fastest / fa3 "
        "| fa context / fa3 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        timed = [v for v in r["variants"] if v["ms"] is not None]
        best = min(timed, key=lambda v: v["ms"]) if timed else None
        path = "fa context: " if r.get("variants_path") == "flash_context" else ""
        fastest = (
            f"{best['ms']:.4f} | {path}{best['block_m']}, {best['block_n']}, {best['num_warps']}"
            if best
            else ("n/a | every variant failed" if r["variants"] else "n/a | not timed")
        )
        fa3 = r.get("fa3_chain_ms")
        flash = r.get("flash_context_ms")
        ratios = "n/a | n/a | n/a"
        if fa3:
            ratios = (
                f"{r['default_ms'] / fa3:.2f} | "
                + (f"{best['ms'] / fa3:.2f}" if best else "n/a")
                + (f" | {flash / fa3:.2f}" if flash else " | n/a")
            )
        flash_cell = f"{flash:.4f} ({r['flash_context_rel_error']:.1e})" if flash else "n/a"
        lines.append(
            f"| {r.get('shape', 'qwen3-8b')} | {r['nodes']} | {r['context']} | {r['batch']} | "
            f"{r['default_ms']:.4f} | {fastest} | {flash_cell} | "
            + (f"{fa3:.4f}" if fa3 else "n/a")
            + f" | {ratios} |"
        )
    return lines


def markdown(result: dict) -> str:
    lines = [
        "# TREE_ATTN kernel benchmark",
        "",
        f"- device: {result['device']}; torch {result['torch']}; triton {result['triton']}; "
        f"vLLM {result['vllm']}",
        f"- commit measured: `{result['commit']}`; generated by `benchmarks/bench_tree_attn.py`",
        f"- device-to-device copy bandwidth: {result['copy_bandwidth_gbs']:.0f} GB/s "
        "(read + write)",
        (
            f"- correctness grid: {sum(r['ok'] for r in result['checks'])}/"
            f"{len(result['checks'])} shapes within {BF16_TOLERANCE:g} relative error of the "
            f"float32 reference; worst {max(r['rel_error'] for r in result['checks']):.2e}"
            if result["checks"]
            else "- correctness grid: not run"
        ),
        "",
        "Qwen3-8B attention shape (32 q heads, 8 KV heads, head 128, bf16, KV block 16); "
        "times are medians in ms. tree/chain: this kernel over TRITON_ATTN's causal kernel at "
        "equal query tokens; sdpa/tree: dense-mask SDPA over this kernel.",
        "",
        "| nodes | context | batch | tree ms | chain ms | sdpa ms | tree/chain | sdpa/tree "
        "| GB/s | % copy BW | rel err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["speed"]:
        chain = f"{r['chain_ms']:.3f}" if r.get("chain_ms") else "n/a"
        ratio = f"{r['tree_over_chain']:.2f}" if r.get("tree_over_chain") else "n/a"
        sdpa_ms = f"{r['sdpa_ms']:.3f}" if r.get("sdpa_ms") else "OOM"
        sdpa_ratio = f"{r['sdpa_over_tree']:.1f}" if r.get("sdpa_over_tree") else "n/a"
        lines.append(
            f"| {r['nodes']} | {r['context']} | {r['batch']} | {r['tree_ms']:.3f} | {chain} | "
            f"{sdpa_ms} | {ratio} | {sdpa_ratio} | {r['tree_gbs']:.0f} | "
            f"{100 * r['tree_fraction_of_copy_bw']:.0f} | {r['rel_error_vs_fp32']:.1e} |"
        )
    if result.get("verify_tuning"):
        lines += verify_markdown(result["verify_tuning"])
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--tune", action="store_true", help="time launch variants first")
    parser.add_argument(
        "--tune-verify",
        default="",
        help="comma-separated attention shapes (" + ", ".join(ATTENTION_SHAPES) + "): time "
        "launch variants on the verify shapes of a served tree step, beside FlashAttention "
        "3's chain verify",
    )
    parser.add_argument(
        "--launch-timing",
        action="store_true",
        help="--tune-verify timed from launches (default: from CUDA-graph replays)",
    )
    parser.add_argument(
        "--verify-flash-variants",
        action="store_true",
        help="--tune-verify times the launch variants on the FlashAttention path (the tree "
        "kernel over the in-block keys after FlashAttention's context pass)",
    )
    parser.add_argument(
        "--verify-paths-only",
        action="store_true",
        help="--tune-verify times the backend's paths (the tree kernel's default launch, "
        "FlashAttention over the context) and the chain, not every launch variant",
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    os.makedirs(args.out, exist_ok=True)
    import triton

    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception as exc:  # noqa: BLE001
        vllm_version = f"unavailable ({type(exc).__name__})"
    t0 = time.time()
    result = dict(
        commit=git_commit(),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        vllm=vllm_version,
        python=platform.python_version(),
    )
    result["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
    result["tuning"] = tune(args.quick) if args.tune else []
    verify_variants = FLASH_VERIFY_VARIANTS if args.verify_flash_variants else VERIFY_VARIANTS
    if args.verify_paths_only:
        verify_variants = []
    result["verify_tuning"] = [
        row
        for shape_name in filter(None, args.tune_verify.split(","))
        for row in tune_verify(
            shape_name,
            graphs=not args.launch_timing,
            variants=verify_variants,
            flash_variants=args.verify_flash_variants,
        )
    ]
    result["checks"] = [] if args.skip_checks else check_grid(args.quick)
    print(
        f"checks: {sum(r['ok'] for r in result['checks'])}/{len(result['checks'])} ok", flush=True
    )
    speed = [] if args.skip_speed else speed_grid(args.quick, result["copy_bandwidth_gbs"])
    result["speed"] = speed
    result["seconds"] = time.time() - t0
    with open(os.path.join(args.out, "tree_attn.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = markdown(result)
    with open(os.path.join(args.out, "tree_attn.md"), "w") as f:
        f.write(table)
    print(table)
    failed = [r for r in result["checks"] + result["speed"] if not r["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
