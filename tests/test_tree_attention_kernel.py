"""The Triton tree-attention kernel against its PyTorch reference.

On a machine without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1,
set for this module by ``run_kernel_tests.py``-style re-exec below) on small shapes; on a GPU
the same tests run natively, plus a larger grid.
"""

import os

import pytest
import torch

from tests.interpreter import run_under_interpreter
from tree_attn_backend.ops.tree_attention import (
    pack_tree_mask,
    tree_attention_ref,
    unpack_tree_mask,
)
from tree_attn_backend.testing import random_case, relative_error

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_pack_and_unpack_round_trip():
    visible = torch.rand(3, 70, 70) > 0.5
    packed = pack_tree_mask(visible)
    assert packed.shape == (3, 70, 3) and packed.dtype == torch.int32
    assert torch.equal(unpack_tree_mask(packed, 70), visible)


def test_reference_tree_rows_equal_their_branch_as_a_causal_chain():
    """A tree node's output equals causal attention over context + its root-to-node path."""
    case = random_case([("tree", 21, 12)], 4, 2, 32, 16, torch.float32, "cpu", seed=3)
    out = tree_attention_ref(**case.kwargs())
    visible = unpack_tree_mask(case.tree_mask, 13)
    context_len = 21
    for node in range(13):
        path = torch.nonzero(visible[node]).flatten().tolist()  # ancestors + itself, in order
        kv = list(range(context_len)) + [context_len + j for j in path]
        blocks = case.block_table[0, torch.tensor(kv) // 16].long()
        keys = case.key_cache[blocks, torch.tensor(kv) % 16]
        values = case.value_cache[blocks, torch.tensor(kv) % 16]
        query = case.q[node].view(2, 2, 32)
        scores = torch.einsum("hgd,khd->hgk", query, keys) * case.scale
        expected = torch.einsum("hgk,khd->hgd", scores.softmax(-1), values).reshape(4, 32)
        assert torch.allclose(out[node], expected, atol=1e-5)


def kernel_cases():
    mixed = [("tree", 37, 20), ("causal", 5, 9), ("causal", 40, 1), ("tree", 16, 0), ("tree", 3, 7)]
    return [
        ("mixed-gqa2", mixed, 4, 2, 32, 16, None),
        ("mixed-mha", mixed, 2, 2, 64, 16, None),
        ("gqa4-blocks32", [("tree", 70, 33), ("causal", 0, 12)], 8, 2, 32, 32, None),
        ("window", [("tree", 50, 15), ("causal", 30, 6)], 4, 2, 32, 16, 24),
        ("window-deep-trees", [("tree", 300, 40), ("tree", 77, 25)], 4, 2, 32, 16, 37),
        ("gqa3-not-power-of-2", [("tree", 40, 20), ("causal", 9, 11)], 6, 2, 32, 16, None),
        ("gqa7", [("tree", 33, 9), ("causal", 0, 4)], 7, 1, 32, 16, None),
        ("empty-trees", [("tree", 9, 0), ("tree", 64, 0)], 4, 1, 64, 16, None),
        ("gqa4-head128", [("tree", 45, 20), ("causal", 7, 3)], 8, 2, 128, 16, None),
    ]


def wide_launch() -> dict:
    from tree_attn_backend.ops.tree_attention import WIDE_BLOCK_M, WIDE_BLOCK_N, WIDE_NUM_WARPS

    return dict(block_m=WIDE_BLOCK_M, block_n=WIDE_BLOCK_N, num_warps=WIDE_NUM_WARPS)


def run_kernel(case, window=None, **launch):
    from tree_attn_backend.ops.tree_attention import tree_attention

    out = torch.full_like(case.q, float("nan"))  # poisoned: every element must be written
    return tree_attention(
        **case.kwargs(), max_query_len=case.max_query_len, sliding_window=window, out=out, **launch
    )


@pytest.mark.interpreter
@pytest.mark.parametrize("name,requests,hq,hkv,d,bs,window", kernel_cases())
def test_kernel_matches_reference(name, requests, hq, hkv, d, bs, window):
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess (see test_kernels_under_interpreter)")
    device = "cuda" if ON_GPU else "cpu"
    for seed in range(2):
        case = random_case(requests, hq, hkv, d, bs, torch.float32, device, seed=seed)
        ref = tree_attention_ref(**case.kwargs(), sliding_window=window)
        tolerance = 1e-5  # float32 inputs: IEEE dots, interpreted or native
        # Narrow tiles expose window and tail edges; block_m 16 is the small block decode
        # batches take, wide_launch() the one a verify at head size 128 takes.
        for launch in (dict(block_n=16), dict(block_n=64), dict(block_m=16), wide_launch(), {}):
            out = run_kernel(case, window, **launch)
            assert relative_error(out, ref) < tolerance, (name, launch)


def test_launch_takes_wide_blocks_for_a_verify_and_small_ones_for_decode():
    from tree_attn_backend.ops.tree_attention import WIDE_BLOCK_M, choose_launch

    # Qwen3-8B's shape (GQA 4, head 128): a 17-token verify fills a wide block.
    assert choose_launch(4, 17, 128) == (WIDE_BLOCK_M, 32, 8)
    # One query token per request (plain decode) or a few: the small block holds its rows.
    assert choose_launch(4, 1, 128) == (16, 64, None)
    assert choose_launch(4, 4, 128) == (16, 64, None)
    # Head sizes not measured faster with wide blocks keep the small ones (SmolLM2's 64, 256).
    assert choose_launch(3, 65, 64) == (16, 64, None)
    assert choose_launch(6, 129, 256) == (16, 32, None)
    # A head group wider than 16 rows: one row per grouped head at least.
    assert choose_launch(32, 1, 128) == (32, 64, None)
    # The in-block pass after a merged context: 32-key tiles whatever the verify's width.
    assert choose_launch(4, 17, 128, merges_context=True) == (32, 32, 4)
    assert choose_launch(4, 65, 128, merges_context=True) == (32, 32, 4)
    assert choose_launch(4, 257, 128, merges_context=True) == (32, 32, 4)
    assert choose_launch(4, 1, 128, merges_context=True) == (16, 64, None)


def _launch_signature(case, **kwargs) -> tuple:
    """What Triton compiles ``tree_attention``'s launch on ``case`` for: its constexprs and
    how it specializes every other integer argument (equal to 1, a multiple of 16); the
    launch itself recorded, not run."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    import tree_attn_backend.ops.tree_attention as ops

    launched = []
    kernel = ops._tree_attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((args, kw))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "_tree_attention_kernel", Recorder())
        patch.setattr(ops, "_combine_kernel", Recorder())
        ops.tree_attention(**case.kwargs(), max_query_len=case.max_query_len, **kwargs)
    (args, constexprs), *_ = launched
    signature = []
    for param, value in zip(kernel.params, args, strict=False):
        if isinstance(value, int) and not param.do_not_specialize:
            specialized = native_specialize_impl(BaseBackend, value, False, True, True)
            signature.append((param.name, specialized))
    return tuple(signature), tuple(sorted(constexprs.items()))


def test_a_launch_compiles_once_for_every_token_count_of_its_kind():
    """Prefills of 65, 128 and 200 tokens merging their context, and their batches of two
    requests, launch one compiled kernel: no integer argument that follows the step's token
    count is specialized. A 128-token prefill in a budget-64 engine (its FULL graph captured
    at 65 tokens) compiled the kernel again during inference, its context's log-sum-exp
    stride (the token count) a multiple of 16 where the capture's was not."""
    from tree_attn_backend.ops.context_attention import context_attention_ref

    signatures = set()
    for lengths in ([65], [128], [200], [64, 64], [100, 29]):
        requests = [("causal", 0, n) for n in lengths]
        case = random_case(requests, 8, 2, 128, 16, torch.bfloat16, "cpu")
        context_out, context_lse = context_attention_ref(**case.context_kwargs())
        signatures.add(_launch_signature(case, context_out=context_out, context_lse=context_lse))
    assert len(signatures) == 1, signatures


@pytest.mark.interpreter
def test_kernel_half_precision_matches_reference():
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    device = "cuda" if ON_GPU else "cpu"
    case = random_case([("tree", 30, 10), ("causal", 4, 5)], 4, 2, 32, 16, torch.float16, device)
    ref = tree_attention_ref(**case.kwargs())
    assert relative_error(run_kernel(case), ref) < 5e-3


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "name,requests,hq,hkv,d,bs",  # a sliding window keeps the whole attention in the kernel
    [case[:-1] for case in kernel_cases() if case[-1] is None],
)
@pytest.mark.parametrize("empty_lse", [float("-inf"), float("inf")])
def test_kernel_merges_a_context_computed_elsewhere(name, requests, hq, hkv, d, bs, empty_lse):
    """Given each query token's attention over its committed context (output and log-sum-exp),
    the kernel reads only the request's own tokens and lands on the whole attention. An empty
    context's log-sum-exp is not finite (FlashAttention 2 writes +inf, 3 -inf) and its output
    is not read: it is poisoned here."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess (see test_kernels_under_interpreter)")
    from tree_attn_backend.ops.context_attention import context_attention_ref

    device = "cuda" if ON_GPU else "cpu"
    requests = [*requests, ("causal", 0, 3)]  # a prefill with no context at all
    case = random_case(requests, hq, hkv, d, bs, torch.float32, device, seed=5)
    ref = tree_attention_ref(**case.kwargs())
    context_lens = case.context_lens()
    context_out, context_lse = context_attention_ref(**case.context_kwargs(context_lens))
    empty = torch.repeat_interleave(
        context_lens == 0, case.query_start_loc[1:] - case.query_start_loc[:-1]
    )
    context_out[empty] = float("nan")
    context_lse[:, empty] = empty_lse
    # Narrow tiles not aligned to the context, and the launcher's own choice (each launch
    # compiles natively on a GPU, where this file ran past 120 s with four launches a case).
    for launch in (dict(block_n=16), {}):
        out = run_kernel(case, context_out=context_out, context_lse=context_lse, **launch)
        assert relative_error(out, ref) < 1e-5, (name, launch)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "launch",
    [
        dict(block_m=16, block_n=64, num_warps=4),
        dict(block_m=32, block_n=128, num_warps=4),
        dict(block_m=64, block_n=128, num_warps=8),
    ],
)
def test_kernel_merges_a_context_with_tiles_of_several_mask_words(launch):
    """Key tiles of 64 and 128 keys after a merged context read several mask words per query
    row: trees deeper than a tile (100 nodes: four words, the last one partly past the tree),
    one inside a tile (40 nodes) and a causal prefill beside them land on the reference."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess (see test_kernels_under_interpreter)")
    from tree_attn_backend.ops.context_attention import context_attention_ref

    device = "cuda" if ON_GPU else "cpu"
    requests = [("tree", 37, 100), ("tree", 64, 40), ("causal", 20, 70)]
    case = random_case(requests, 8, 2, 32, 16, torch.float32, device, seed=9)
    ref = tree_attention_ref(**case.kwargs())
    context_out, context_lse = context_attention_ref(**case.context_kwargs())
    out = run_kernel(case, context_out=context_out, context_lse=context_lse, **launch)
    assert relative_error(out, ref) < 1e-5, launch


@pytest.mark.interpreter
@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="already native or interpreted")
def test_kernels_under_interpreter():
    """This module's kernel tests, again, under Triton's interpreter."""
    run_under_interpreter(
        __file__,
        "kernel_matches or kernel_merges or half_precision or window_without or split_kv "
        "or lower_edge or capture_shaped",
        expected=14 + 14 + 3 + 1,
    )


@pytest.mark.interpreter
def test_kernel_window_without_positions_uses_kv_indices():
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    device = "cuda" if ON_GPU else "cpu"
    case = random_case([("causal", 40, 9), ("causal", 3, 1)], 4, 2, 32, 16, torch.float32, device)
    kwargs = {**case.kwargs(), "positions": None, "is_tree": None, "tree_mask": None}
    ref = tree_attention_ref(**kwargs, sliding_window=17)
    from tree_attn_backend.ops.tree_attention import tree_attention

    out = tree_attention(**kwargs, max_query_len=case.max_query_len, sliding_window=17)
    assert relative_error(out, ref) < (1e-5 if INTERPRETED else 5e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("segments", [2, 4])
def test_split_kv_segments_match_reference(segments):
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    device = "cuda" if ON_GPU else "cpu"
    requests = [("tree", 70, 12), ("causal", 0, 5), ("tree", 3, 0), ("causal", 100, 1)]
    case = random_case(requests, 4, 2, 32, 16, torch.float32, device, seed=segments)
    from tree_attn_backend.ops.tree_attention import tree_attention

    out = torch.full_like(case.q, float("nan"))
    tree_attention(
        **case.kwargs(), max_query_len=case.max_query_len, out=out, num_segments=segments
    )
    ref = tree_attention_ref(**case.kwargs())
    assert relative_error(out, ref) < (1e-5 if INTERPRETED else 5e-3)


@pytest.mark.interpreter
def test_window_lower_edge_uses_the_lowest_tree_position_in_a_block():
    """Tree positions are not monotonic in node order; every window offset is tried so that the
    lower edge falls inside a key tile for some of them."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    device = "cuda" if ON_GPU else "cpu"
    case = random_case([("tree", 200, 30)], 8, 1, 16, 16, torch.float32, device, seed=11)
    for window in range(20, 52):
        ref = tree_attention_ref(**case.kwargs(), sliding_window=window)
        out = run_kernel(case, window, block_n=16, num_segments=1)
        assert relative_error(out, ref) < 1e-5, window


FLASH_CASES = [
    # Qwen3-8B's attention shape, SmolLM2's (9 query heads over 3), Qwen3.6-27B's (head 256).
    ("qwen3-8b", 32, 8, 128),
    ("smollm2", 9, 3, 64),
    ("qwen3.6-27b", 24, 4, 256),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs vLLM's FlashAttention on a CUDA GPU")
@pytest.mark.parametrize("name,hq,hkv,d", FLASH_CASES)
def test_flash_attention_context_and_the_kernel_match_the_reference(name, hq, hkv, d):
    """vLLM's FlashAttention over the committed contexts, merged by the tree kernel over the
    in-block keys, equals the reference: in a mixed batch (trees, a prefill with no context,
    decodes), launched and replayed from a CUDA graph captured at other context lengths."""
    from tree_attn_backend.ops.context_attention import (
        context_attention_ref,
        flash_attention_version,
        split_bound,
    )
    from tree_attn_backend.testing import flash_context_path

    version = flash_attention_version(d, torch.bfloat16, torch.device("cuda"))
    assert version is not None, "vLLM's FlashAttention serves this shape on the GPU"
    requests = [("tree", 383, 64), ("causal", 0, 12), ("tree", 2000, 16), ("causal", 70, 1)]
    case = random_case(requests, hq, hkv, d, 16, torch.bfloat16, "cuda", seed=d, vocab=256)
    context_lens = case.context_lens()
    ref_out, ref_lse = context_attention_ref(**case.context_kwargs(context_lens))
    ref = tree_attention_ref(**case.kwargs())
    bf16_tolerance = 1e-2
    has_context = torch.repeat_interleave(context_lens > 0, case.query_start_loc.diff())

    def run(splits: int, max_context_len: int):
        return flash_context_path(case, context_lens, version, max_context_len, splits)

    out, context_out, context_lse = run(0, int(case.seq_lens.max()))
    assert relative_error(context_out[has_context], ref_out[has_context]) < bf16_tolerance
    assert torch.allclose(context_lse[:, has_context], ref_lse[:, has_context], atol=1e-2)
    assert relative_error(out, ref) < bf16_tolerance

    # A FULL graph is captured once, at other lengths, and replays with fresh ones. Its host
    # bound is the worst case, as vLLM's runners capture (max_seq_len = max_model_len).
    splits = split_bound(32, case.q.shape[0], hq, d)
    real_seq_lens, real_contexts = case.seq_lens.clone(), context_lens.clone()
    case.seq_lens.copy_(case.query_start_loc.diff())  # capture: every context empty
    context_lens.zero_()
    max_model_len = 4096
    run(splits, max_model_len)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run(splits, max_model_len)[0]
    case.seq_lens.copy_(real_seq_lens)
    context_lens.copy_(real_contexts)
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(graph_out, ref) < bf16_tolerance


@pytest.mark.interpreter
def test_kernel_merging_a_context_stays_inside_a_capture_shaped_batch():
    """vLLM captures CUDA graphs with made-up lengths; TREE_ATTN's builder sets every sequence
    to one token, shorter than its query (a negative context). With a context merged from
    elsewhere the kernel must read no key before the request's first block."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess (see test_kernels_under_interpreter)")
    device = "cuda" if ON_GPU else "cpu"
    case = random_case([("tree", 0, 16)] * 3, 8, 2, 128, 16, torch.float32, device, seed=2)
    case.seq_lens.fill_(1)  # as build_for_cudagraph_capture
    num_tokens, num_heads = case.q.shape[:2]
    # Poison what precedes each request's blocks: the column before each row names a block of
    # NaNs, one the requests do not use, so a read before a request's first key shows.
    unused = sorted(set(range(case.key_cache.shape[0])) - set(case.block_table.flatten().tolist()))
    case.key_cache[unused[0]] = float("nan")
    case.value_cache[unused[0]] = float("nan")
    widened = torch.full_like(case.block_table[:, :1], unused[0])
    case.block_table = torch.cat([widened, case.block_table], dim=1)[:, 1:]
    context_out = torch.zeros_like(case.q)
    context_lse = torch.full((num_heads, num_tokens), float("-inf"), device=device)
    out = run_kernel(case, context_out=context_out, context_lse=context_lse)
    assert not torch.isnan(out).any()
