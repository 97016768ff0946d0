"""Causal conv1d over draft trees: the Triton kernel against the path-built reference."""

import functools
import os

import pytest
import torch

from tests.interpreter import run_under_interpreter
from vllm_ddtree.ops.tree_causal_conv import conv_state_after_path, tree_causal_conv1d_ref
from vllm_ddtree.tree import build_trees

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def make_case(num_reqs=3, budget=14, depth=6, channels=40, width=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tree = build_trees(torch.randn(num_reqs, depth, 5, generator=gen) * 2, budget)
    parents = torch.full((num_reqs, budget + 1), -1, dtype=torch.long)
    parents[:, 1:] = tree.parents
    return dict(
        x=torch.randn(num_reqs, budget + 1, channels, generator=gen),
        parents=parents,
        num_tokens=tree.num_nodes + 1,
        conv_state=torch.randn(num_reqs + 2, channels, width - 1, generator=gen),
        state_index=torch.tensor([2, 0, 4])[:num_reqs],
        weight=torch.randn(channels, width, generator=gen),
        bias=torch.randn(channels, generator=gen),
    )


def test_reference_chain_equals_plain_causal_conv():
    case = make_case(num_reqs=1, budget=5, depth=5)
    case["parents"][0] = torch.arange(-1, 5)
    case["num_tokens"] = torch.tensor([6])
    out = tree_causal_conv1d_ref(**case, activation=None)
    history = case["conv_state"][2].T  # [3, C]
    sequence = torch.cat([history, case["x"][0]], 0)  # [3 + 6, C]
    for t in range(6):
        window = sequence[t : t + 4]
        expected = (window.T * case["weight"]).sum(-1) + case["bias"]
        assert torch.allclose(out[0, t], expected, atol=1e-5)


def shifted_windows(case, extra=5, seed=11):
    """``case``'s conv state widened to ``W - 1 + extra`` columns with each row's window moved
    to column ``num_accepted - 1`` (vLLM's speculative layout), and those counts."""
    gen = torch.Generator().manual_seed(seed)
    slots, channels, kept = case["conv_state"].shape
    num_accepted = torch.tensor([3, 1, 6], dtype=torch.int32)[: case["x"].shape[0]]
    wide = torch.randn(slots, channels, kept + extra, generator=gen)
    for r, slot in enumerate(case["state_index"].tolist()):
        first = int(num_accepted[r]) - 1
        wide[slot, :, first : first + kept] = case["conv_state"][slot]
    return {**case, "conv_state": wide}, num_accepted


def test_reference_reads_each_window_from_num_accepted_minus_one():
    """vLLM's speculative conv layout: the committed window of a request that accepted ``n``
    tokens last step starts at column ``n - 1``."""
    case = make_case()
    want = tree_causal_conv1d_ref(**case)
    shifted, num_accepted = shifted_windows(case)
    got = tree_causal_conv1d_ref(**shifted, num_accepted=num_accepted)
    assert torch.equal(got, want)


def test_state_after_path_keeps_the_last_inputs():
    state = torch.arange(6.0).view(2, 3)  # C = 2, W - 1 = 3
    x = torch.tensor([[10.0, 20.0], [11.0, 21.0], [12.0, 22.0]])
    new = conv_state_after_path(state, x, [0, 2], width=4)
    assert new.tolist() == [[2.0, 10.0, 12.0], [5.0, 20.0, 22.0]]


@pytest.mark.interpreter
@pytest.mark.parametrize("seed, block_t", [(0, 32), (1, 32), (2, 4)])
def test_kernel_matches_reference(seed, block_t):
    """``block_t`` 4: a row's 15 nodes in four chunks, the last one short, each chunk's
    windows reaching into the one before and into the committed history."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_causal_conv import tree_causal_conv1d

    device = "cuda" if ON_GPU else "cpu"
    case = make_case(seed=seed)
    ref = tree_causal_conv1d_ref(**case)
    on_device = {k: v.to(device) for k, v in case.items()}
    out = tree_causal_conv1d(**on_device, block_c=16, block_t=block_t)
    for r in range(out.shape[0]):
        n = int(case["num_tokens"][r])
        assert torch.allclose(out[r, :n].cpu(), ref[r, :n], atol=1e-4), r


@pytest.mark.interpreter
def test_kernel_reads_a_window_first_conv_state():
    """vLLM's default conv cache is ``[slots, W - 1, C]`` (channels contiguous), in bf16."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_causal_conv import tree_causal_conv1d

    device = "cuda" if ON_GPU else "cpu"
    case = make_case(seed=3)
    window_first = case["conv_state"].transpose(1, 2).contiguous().to(torch.bfloat16)
    case["conv_state"] = window_first.transpose(1, 2)  # [S, C, W - 1] view, window stride C
    ref = tree_causal_conv1d_ref(**case)
    on_device = {k: v.to(device) for k, v in case.items()}
    on_device["conv_state"] = window_first.to(device).transpose(1, 2)
    out = tree_causal_conv1d(**on_device, block_c=16)
    for r in range(out.shape[0]):
        n = int(case["num_tokens"][r])
        assert torch.allclose(out[r, :n].cpu(), ref[r, :n], atol=1e-4), r


@pytest.mark.interpreter
def test_kernel_reads_windows_at_num_accepted_and_keeps_their_columns():
    """Each row's window from column ``num_accepted - 1`` of its block, and that column kept
    for the commit (``saved_offset``)."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_causal_conv import tree_causal_conv1d_packed

    device = "cuda" if ON_GPU else "cpu"
    shifted, num_accepted = shifted_windows(make_case(seed=4))
    ref = tree_causal_conv1d_ref(**shifted, num_accepted=num_accepted)
    rows, width, channels = shifted["x"].shape
    on_device = {k: v.to(device) for k, v in shifted.items() if k != "x"}
    starts = torch.arange(rows + 1, device=device) * width
    offsets = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
    out = tree_causal_conv1d_packed(
        shifted["x"].to(device).reshape(rows * width, channels),
        starts,
        **on_device,
        num_accepted=num_accepted.to(device),
        saved_offset=offsets,
        block_c=16,
    ).view(rows, width, channels)
    for r in range(rows):
        n = int(shifted["num_tokens"][r])
        assert torch.allclose(out[r, :n].cpu(), ref[r, :n], atol=1e-4), r
    assert offsets[:rows].cpu().tolist() == (num_accepted - 1).tolist()


@pytest.mark.interpreter
def test_kernel_reads_state_indices_through_a_column_view():
    """vLLM passes column 0 of its ``[R, 1 + B]`` int32 state-index table (a strided view):
    each row reads its own request's block (the H200 hybrid grid once read request 0's blocks
    for every row but the first)."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_causal_conv import tree_causal_conv1d

    device = "cuda" if ON_GPU else "cpu"
    case = make_case(seed=5)
    table = torch.tensor([[2, 1, 3], [0, 3, 1], [4, 1, 2]], dtype=torch.int32)
    case["state_index"] = table[:, 0]
    assert case["state_index"].stride(0) == 3
    ref = tree_causal_conv1d_ref(**case)
    on_device = {k: v.to(device) for k, v in case.items()}
    on_device["state_index"] = table.to(device)[:, 0]
    out = tree_causal_conv1d(**on_device, block_c=16)
    for r in range(out.shape[0]):
        n = int(case["num_tokens"][r])
        assert torch.allclose(out[r, :n].cpu(), ref[r, :n], atol=1e-4), r


def packed_case(seed=7, graph_pad=2):
    """``make_case``'s trees with their tokens packed as vLLM passes them: row 1 two nodes
    short of its tree (vLLM scheduled fewer drafts), ``graph_pad`` padding tokens at the end
    (a CUDA graph's), and the save buffers one row larger than the batch."""
    case = make_case(seed=seed)
    rows, width, channels = case["x"].shape
    lengths = case["num_tokens"].clone()
    lengths[1] -= 2
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    x = torch.cat([case["x"][r, : int(lengths[r])] for r in range(rows)])
    x = torch.cat([x, torch.randn(graph_pad, channels)])
    packed = {k: v for k, v in case.items() if k != "x"}
    packed.update(x=x, query_start_loc=torch.cat([starts, starts.new_full((1,), x.shape[0])]))
    return packed, lengths


@pytest.mark.interpreter
@pytest.mark.parametrize("block_t", [32, 4])
def test_kernel_packed_rows_equal_the_reference_and_keep_the_inputs(block_t):
    """Tokens packed by ``query_start_loc`` (a short row, graph padding): outputs equal the
    packed reference (zeros past the rows), and the save buffers get each node's input and
    each row's state index; in one chunk of nodes and in several (``block_t`` 4)."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_causal_conv import (
        tree_causal_conv1d_packed,
        tree_causal_conv1d_packed_ref,
    )

    device = "cuda" if ON_GPU else "cpu"
    case, lengths = packed_case()
    rows, width = case["parents"].shape
    channels = case["x"].shape[1]
    saved = {}
    outs = []
    for name, fn, where in (
        ("ref", tree_causal_conv1d_packed_ref, "cpu"),
        ("kernel", functools.partial(tree_causal_conv1d_packed, block_t=block_t), device),
    ):
        inputs = torch.zeros(rows + 1, width, channels, device=where)
        index = torch.zeros(rows + 1, dtype=torch.int32, device=where)
        args = {k: v.to(where) for k, v in case.items()}
        outs.append(fn(**args, saved_inputs=inputs, saved_index=index).cpu())
        saved[name] = (inputs.cpu(), index.cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    total = int(lengths.sum())
    assert not outs[1][total:].any(), "graph padding gets zeros"
    for r in range(rows):
        n = int(lengths[r])
        first = int(case["query_start_loc"][r])
        for name in ("ref", "kernel"):
            inputs, index = saved[name]
            assert torch.equal(inputs[r, :n], case["x"][first : first + n]), (name, r)
            assert int(index[r]) == int(case["state_index"][r])


@pytest.mark.interpreter
@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="already native or interpreted")
def test_kernels_under_interpreter():
    """This module's kernel tests, again, under Triton's interpreter."""
    run_under_interpreter(__file__, "kernel_", expected=8)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the shape grid is too slow interpreted)")
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_on_gpu_real_conv_shapes_match_reference(budget):
    """A GDN layer's conv channels (q, k, v of 128-wide heads), width 4, trees of depth 15."""
    from vllm_ddtree.ops.tree_causal_conv import tree_causal_conv1d

    case = make_case(num_reqs=4, budget=budget, depth=15, channels=1024, width=4, seed=budget)
    case["state_index"] = torch.tensor([2, 0, 4, 5])
    case = {name: t.cuda() for name, t in case.items()}
    assert int(case["num_tokens"].max()) == budget + 1
    ref = tree_causal_conv1d_ref(**case)
    out = tree_causal_conv1d(**case)
    for r in range(out.shape[0]):
        n = int(case["num_tokens"][r])
        torch.testing.assert_close(out[r, :n], ref[r, :n], atol=1e-4, rtol=1e-4)
