"""The hybrid tree path's bookkeeping on the CPU (PyTorch references in place of the kernels):
vLLM's speculative GDN calls routed to the trees, then the commit, give exactly the states and
outputs of decoding the accepted tokens one by one (what the target alone does)."""

import os

import pytest
import torch

from tests.interpreter import run_under_interpreter
from vllm_ddtree.envs import CHECK_INDICES
from vllm_ddtree.hybrid import gdn_layer
from vllm_ddtree.hybrid.gdn_layer import HybridTreeStep
from vllm_ddtree.ops.tree_causal_conv import tree_causal_conv1d_ref
from vllm_ddtree.ops.tree_gated_delta import gdn_gates_ref, tree_gated_delta_ref
from vllm_ddtree.tree import build_trees

HK, HV, DK, DV, WIDTH = 1, 2, 4, 4, 4
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CHANNELS = 2 * HK * DK + HV * DV


def split_qkv(y: torch.Tensor):
    """Conv output ``[n, C]`` -> q, k ``[1, n, Hk, K]`` and v ``[1, n, Hv, V]`` (vLLM's split)."""
    q, k, v = y.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return q.reshape(1, -1, HK, DK), k.reshape(1, -1, HK, DK), v.reshape(1, -1, HV, DV)


class Layer:
    """One GDN layer's weights and vLLM-layout caches (block 0 is vLLM's null block)."""

    def __init__(self, num_reqs: int, budget: int, gen: torch.Generator):
        blocks = 1 + num_reqs * (1 + budget)
        # vLLM's default conv layout is window-first [blocks, K - 1 + B, C]; the layer passes
        # the [blocks, C, K - 1 + B] view.
        self.conv_cache = torch.randn(blocks, WIDTH - 1 + budget, CHANNELS, generator=gen)
        self.ssm_cache = torch.randn(blocks, HV, DV, DK, generator=gen) * 0.3  # [Hv, V, K]
        self.weight = torch.randn(CHANNELS, WIDTH, generator=gen) * 0.5
        self.bias = torch.randn(CHANNELS, generator=gen) * 0.1
        self.A_log = torch.randn(HV, generator=gen) * 0.3
        self.dt_bias = torch.randn(HV, generator=gen) * 0.3

    def conv_view(self) -> torch.Tensor:
        return self.conv_cache.transpose(1, 2)


def chain_outputs(layer: Layer, window, state, x, a, b):
    """Decode ``x`` ``[n, C]`` token by token from the conv ``window`` ``[C, K - 1]`` and SSM
    ``state`` ``[Hv, K, V]``: outputs ``[n, Hv, V]``, final state, last ``K - 1`` inputs."""
    n = x.shape[0]
    chain = torch.arange(-1, n - 1).unsqueeze(0)
    y = tree_causal_conv1d_ref(
        x.unsqueeze(0),
        chain,
        torch.tensor([n]),
        window.unsqueeze(0),
        torch.tensor([0]),
        layer.weight,
        layer.bias,
        "silu",
    )[0]
    q, k, v = split_qkv(y)
    g, _ = gdn_gates_ref(layer.A_log, a, b, layer.dt_bias)
    beta = torch.sigmoid(b.float())
    pool = torch.zeros(n + 1, HV, DK, DV)
    pool[n] = state
    out = tree_gated_delta_ref(
        q,
        k,
        v,
        g.view(1, n, HV),
        beta.view(1, n, HV),
        chain,
        torch.tensor([n]),
        pool,
        torch.tensor([n]),
        torch.arange(n).unsqueeze(0),
    )[0]
    history = torch.cat([window, x.T.to(window.dtype)], dim=1)[:, -(WIDTH - 1) :]
    return out, pool[n - 1], history


def tree_step(
    step,
    layer,
    table,
    num_accepted,
    gen,
    budget,
    depth,
    num_draft,
    graph_pad=0,
    publish=True,
    forward=None,
):
    """One verify forward of the layer through the step's dispatch targets. Row ``r`` has
    ``1 + num_draft[r]`` tokens (vLLM may schedule fewer drafts than the budget; the tree is
    then cut to its first ``num_draft[r]`` nodes, as the runner hooks do). Returns the trees and
    per-row views ``[R, 1 + B, ...]`` of the inputs and outputs (zeros past a row's end).

    ``graph_pad`` > 0 passes the arguments as vLLM 0.26.0's ``_forward_core`` does in a full
    CUDA graph padded by that many requests (and as many tokens): ``query_start_loc`` of the
    conv call and ``ssm_state_indices`` / ``num_accepted_tokens`` of the recurrence padded
    (null block 0, one accepted), the conv's state indices and the recurrence's ``cu_seqlens``
    for the real rows only. ``publish=False``: another layer of the step the last published
    trees belong to. ``forward(x=, a=, b=, query_start=)``, when given, runs the layer in
    place of the step's two calls and returns the core attention output ``[1, n, Hv, V]``
    (``tests/helpers/gdn_forward_core.py``: vLLM's own layer)."""
    num_reqs, tokens = table.shape
    trees = build_trees(torch.randn(num_reqs, depth, 3, generator=gen) * 2, budget)
    trees.num_nodes = torch.minimum(trees.num_nodes, num_draft)
    if publish:
        step.publish(trees.parents, trees.num_nodes, num_draft)
    lengths = 1 + num_draft
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(query_start[-1])
    x = torch.randn(total, CHANNELS, generator=gen)
    a = torch.randn(total, HV, generator=gen)
    b = torch.randn(total, HV, generator=gen)

    def per_row(flat):
        rows = flat.new_zeros((num_reqs, tokens, *flat.shape[1:]))
        for r in range(num_reqs):
            rows[r, : int(lengths[r])] = flat[int(query_start[r]) : int(query_start[r + 1])]
        return rows

    padded_start = torch.cat([query_start, query_start.new_full((graph_pad,), total)])
    padded_table = torch.cat([table, table.new_zeros((graph_pad, tokens))])
    padded_accepted = torch.cat([num_accepted, num_accepted.new_ones(graph_pad)])
    if forward is not None:
        assert graph_pad == 0
        out = forward(x=x, a=a, b=b, query_start=query_start)
        return trees, per_row(x), per_row(a), per_row(b), per_row(out[0])
    y = step.tree_conv(
        torch.cat([x, x.new_zeros((graph_pad, CHANNELS))]),
        layer.conv_view(),
        layer.weight,
        layer.bias,
        "silu",
        conv_state_indices=table[:, 0],
        num_accepted_tokens=padded_accepted,
        query_start_loc=padded_start,
        max_query_len=tokens,
        validate_data=False,
    )
    q, k, v = split_qkv(y)
    out, _ = step.tree_recurrence(  # as vLLM's GDN layer calls its own function
        A_log=layer.A_log,
        a=torch.cat([a, a.new_zeros((graph_pad, HV))]),
        b=torch.cat([b, b.new_zeros((graph_pad, HV))]),
        dt_bias=layer.dt_bias,
        q=q,
        k=k,
        v=v,
        initial_state=layer.ssm_cache,
        inplace_final_state=True,
        cu_seqlens=query_start,
        ssm_state_indices=padded_table,
        num_accepted_tokens=padded_accepted,
        use_qk_l2norm_in_kernel=True,
    )

    return trees, per_row(x), per_row(a), per_row(b), per_row(out[0])


def test_two_tree_steps_continue_exactly_where_decoding_the_accepted_tokens_would():
    check_two_tree_steps()


@pytest.mark.interpreter
def test_kernel_path_two_tree_steps_continue_exactly(monkeypatch):
    """The same two steps, and a graph-padded step, through the Triton kernels (the GPU route,
    here under Triton's interpreter) with vLLM's arguments: the conv call's state indices are
    column 0 of the ``[R, 1 + B]`` table, a strided view (a kernel that read them as contiguous
    gave every request after the first request 0's conv window on the H200)."""
    if not INTERPRETED:
        pytest.skip("runs in the interpreter subprocess")
    monkeypatch.setattr(gdn_layer, "use_triton", lambda device: True)
    check_two_tree_steps(atol=1e-4)
    check_graph_padding(2)


@pytest.mark.interpreter
@pytest.mark.skipif(INTERPRETED, reason="already interpreted")
def test_kernels_under_interpreter():
    """This module's kernel-path tests, under Triton's interpreter."""
    run_under_interpreter(__file__, "kernel_path", expected=1, strict_scalars=True)


def layer_table_step(num_reqs: int, budget: int, gen, max_rows: int = 4):
    """A random GDN layer, its ``[R, 1 + budget]`` state-block table (vLLM's speculative layout,
    blocks from 1) and a fresh ``HybridTreeStep`` for it."""
    tokens = budget + 1
    layer = Layer(num_reqs, budget, gen)
    table = (1 + torch.arange(num_reqs * tokens)).view(num_reqs, tokens).to(torch.int32)
    step = HybridTreeStep(max_rows=max_rows, tree_budget=tokens - 1, device=torch.device("cpu"))
    return layer, table, step


def check_two_tree_steps(atol: float = 1e-5) -> None:
    """Two tree steps of a layer through ``HybridTreeStep`` (its dispatch picks the kernels or
    the references), each followed by the commit, equal decoding the accepted tokens one by
    one: outputs, SSM states and conv windows."""
    gen = torch.Generator().manual_seed(0)
    num_reqs, budget, depth = 2, 6, 4
    layer, table, step = layer_table_step(num_reqs, budget, gen)
    # The committed state each request starts from (vLLM: block [r, num_accepted - 1] = 0).
    window = [layer.conv_view()[int(table[r, 0]), :, : WIDTH - 1].clone() for r in range(num_reqs)]
    state = [layer.ssm_cache[int(table[r, 0])].transpose(-1, -2).clone() for r in range(num_reqs)]
    num_accepted = torch.ones(num_reqs, dtype=torch.int32)
    # Step 1: full rows; step 2: request 1 gets 2 drafts fewer than the budget.
    for num_draft in (torch.tensor([budget, budget]), torch.tensor([budget, budget - 2])):
        trees, x, a, b, out = tree_step(
            step, layer, table, num_accepted, gen, budget, depth, num_draft
        )
        # Accept a path per request (the walk's output format): request 0 the path to its
        # last node (a side branch), the others the path to their deepest node.
        accepted = torch.full((num_reqs, depth + 1), -1, dtype=torch.long)
        taken = torch.zeros(num_reqs, dtype=torch.long)
        for r in range(num_reqs):
            count = int(trees.num_nodes[r])
            node = count if r == 0 else int(trees.depths[r, :count].argmax()) + 1
            path = [node]
            while path[-1] != 0:
                path.append(int(trees.parents[r, path[-1] - 1]))
            path.reverse()
            if r == 0:
                assert path != list(range(len(path))), "a branch, not the first-child chain"
            accepted[r, : len(path)] = torch.tensor(path)
            taken[r] = len(path) - 1
            rows = torch.tensor(path)
            want, want_state, want_window = chain_outputs(
                layer,
                window[r],
                state[r],
                x[r, rows],
                a[r, rows],
                b[r, rows],
            )
            torch.testing.assert_close(out[r, rows], want, atol=atol, rtol=atol)
            window[r], state[r] = want_window, want_state
        step.commit(accepted, taken, num_draft)
        num_accepted = (taken + 1).to(torch.int32)  # vLLM's count: accepted drafts + bonus
        for r in range(num_reqs):
            block = int(table[r, int(taken[r])])
            got_state = layer.ssm_cache[block].transpose(-1, -2)
            torch.testing.assert_close(got_state, state[r], atol=atol, rtol=atol)
            # vLLM reads the window from column num_accepted - 1 = taken.
            first = int(taken[r])
            got_window = layer.conv_view()[int(table[r, 0]), :, first : first + WIDTH - 1]
            torch.testing.assert_close(got_window, window[r])


def vllm_align_copy(layer: Layer, table_row, src_block, dest_block, bias: int) -> None:
    """What vLLM's ``align`` postprocess does for one request whose accepted tokens reached a
    block boundary ``bias`` tokens past its root (``mamba_utils._copy_mamba_state_block``):
    the SSM state of speculative column ``bias`` and the conv window shifted by ``bias`` into
    the boundary's block."""
    layer.ssm_cache[dest_block] = layer.ssm_cache[int(table_row[bias])]
    conv = layer.conv_view()
    width = conv.shape[-1]
    conv[dest_block, :, : width - bias] = conv[src_block, :, bias:].clone()


@pytest.mark.parametrize("root_position, block_size", [(9, 16), (13, 16), (15, 16), (14, 4)])
def test_align_layout_gets_the_boundary_state_decoding_reaches(root_position, block_size):
    """Prefix caching (vLLM's ``align`` layout): after a tree step whose accepted path reaches
    a block boundary, vLLM copies the state of the boundary's token into the block ending
    there, reading it where its chain would have put it. With ``state_block_size`` the commit
    puts it there: the boundary block's SSM state and conv window equal decoding the path's
    tokens up to the boundary one by one, and the leaf's stay where the next step reads them.
    (Root at position 9: no boundary within reach; 13: at depth 2; 15: at the root itself; 14
    with blocks of 4: two boundaries, the last one taken, as vLLM does.)"""
    gen = torch.Generator().manual_seed(4)
    num_reqs, budget, depth = 1, 8, 6
    layer, table, _ = layer_table_step(num_reqs, budget, gen)
    from types import SimpleNamespace

    # vLLM's cache config in the align layout (read at the commit: vLLM fixes the block size
    # after the step is made).
    cache = SimpleNamespace(mamba_cache_mode="none", mamba_block_size=16)
    step = HybridTreeStep(
        max_rows=4, tree_budget=budget, device=torch.device("cpu"), cache_config=cache
    )
    cache.mamba_cache_mode, cache.mamba_block_size = "align", block_size
    window = layer.conv_view()[int(table[0, 0]), :, : WIDTH - 1].clone()
    state = layer.ssm_cache[int(table[0, 0])].transpose(-1, -2).clone()
    ones = torch.ones(num_reqs, dtype=torch.int32)
    num_draft = torch.tensor([budget])
    trees, x, a, b, _ = tree_step(step, layer, table, ones, gen, budget, depth, num_draft)
    paths = []
    for node in range(1, int(trees.num_nodes[0]) + 1):
        path = [node]
        while path[-1] != 0:
            path.append(int(trees.parents[0, path[-1] - 1]))
        paths.append(path[::-1])
    # The deepest path off the first child: every node of it lies in another column than its
    # depth (a node's index is at least its depth, and past node 1 more), so the boundary's
    # state has to be moved to where vLLM reads it.
    path = max((p for p in paths if p[1] != 1), key=len)
    taken = len(path) - 1
    assert taken >= 2
    accepted = torch.full((1, depth + 1), -1, dtype=torch.long)
    accepted[0, : len(path)] = torch.tensor(path)
    roots = torch.tensor([root_position])
    bias = int(gdn_layer.boundary_depths(roots, torch.tensor([taken]), block_size)[0])
    running = root_position + 1
    crossings = [
        d for d in range(taken + 1) if (running + d) % block_size == 0
    ]  # depths at whose token a block ends
    assert bias == (crossings[-1] if crossings else -1)
    step.commit(accepted, torch.tensor([taken]), num_draft, roots)
    rows = torch.tensor(path)
    if bias >= 0:
        dest = 1 + layer.ssm_cache.shape[0] - 1  # a block of its own, past the table
        layer.ssm_cache = torch.cat([layer.ssm_cache, layer.ssm_cache[:1].clone()])
        layer.conv_cache = torch.cat([layer.conv_cache, layer.conv_cache[:1].clone()])
        vllm_align_copy(layer, table[0], int(table[0, 0]), dest, bias)
        prefix = rows[: bias + 1]
        _, want_state, want_window = chain_outputs(
            layer, window, state, x[0, prefix], a[0, prefix], b[0, prefix]
        )
        torch.testing.assert_close(layer.ssm_cache[dest].transpose(-1, -2), want_state)
        torch.testing.assert_close(layer.conv_view()[dest, :, : WIDTH - 1], want_window)
    _, leaf_state, leaf_window = chain_outputs(
        layer, window, state, x[0, rows], a[0, rows], b[0, rows]
    )
    leaf_block = int(table[0, taken])
    torch.testing.assert_close(layer.ssm_cache[leaf_block].transpose(-1, -2), leaf_state)
    conv_block = layer.conv_view()[int(table[0, 0])]
    torch.testing.assert_close(conv_block[:, taken : taken + WIDTH - 1], leaf_window)


def test_index_checks_pass_a_correct_step_and_name_a_bad_block(monkeypatch):
    """``VLLM_DDTREE_CHECK_INDICES=1`` (a debugging switch): the two exact steps pass its
    checks; a state-block index past the cache raises naming the layer and the block instead
    of reaching a gather, and so does a block buffer written over between the forward's GDN
    call and the commit (on the H200 something wrote floats there: the check names where)."""
    monkeypatch.setenv(CHECK_INDICES, "1")
    check_two_tree_steps()
    gen = torch.Generator().manual_seed(1)
    num_reqs, budget, depth = 2, 4, 3
    layer, table, step = layer_table_step(num_reqs, budget, gen)
    num_draft = torch.tensor([budget, budget])
    ones = torch.ones(num_reqs, dtype=torch.int32)
    tree_step(step, layer, table, ones, gen, budget, depth, num_draft)
    step.watch("nowhere")  # nothing wrote over the buffers
    (gdn_layer,) = step.layers.values()
    gdn_layer.ssm_blocks[1, 2] = layer.ssm_cache.shape[0] + 5
    with pytest.raises(
        RuntimeError,
        match=r"GDN layer 0's SSM state blocks were written over "
        r"in the walk \(step 1, rows \[1\]",
    ):
        step.watch("in the walk")
    accepted = torch.tensor([[0, 1, -1, -1], [0, 1, 2, -1]])
    with pytest.raises(RuntimeError, match="written over before the GDN commit"):
        step.commit(accepted, torch.tensor([1, 2]), num_draft)
    bad = table.clone()
    bad[1, 2] = layer.ssm_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match=r"SSM state block out of range .*\[1, 2\]"):
        tree_step(step, layer, bad, ones, gen, budget, depth, num_draft)
    with pytest.raises(RuntimeError, match="conv state block out of range"):
        tree_step(step, layer, table + 1000, ones, gen, budget, depth, num_draft)


def test_index_checks_name_a_gdn_layer_the_step_did_not_route(monkeypatch):
    """With the checks on, a step whose GDN layers ran eagerly but skipped one layer's tree
    call (its buffers still describe the previous step) raises before the commit reads them."""
    monkeypatch.setenv(CHECK_INDICES, "1")
    gen = torch.Generator().manual_seed(2)
    num_reqs, budget, depth = 2, 4, 3
    first, table, step = layer_table_step(num_reqs, budget, gen)
    second = Layer(num_reqs, budget, gen)
    num_draft = torch.tensor([budget, budget])
    ones = torch.ones(num_reqs, dtype=torch.int32)
    for layer, publish in ((first, True), (second, False)):
        tree_step(step, layer, table, ones, gen, budget, depth, num_draft, publish=publish)
    accepted = torch.tensor([[0, 1, -1, -1], [0, 1, 2, -1]])
    taken = torch.tensor([1, 2])
    step.commit(accepted, taken, num_draft)  # both layers called: passes
    tree_step(step, first, table, ones, gen, budget, depth, num_draft)  # the next step: one
    with pytest.raises(RuntimeError, match=r"GDN layers \[1\] did not run"):
        step.commit(accepted, taken, num_draft)


@pytest.mark.parametrize("graph_pad", [1, 3])
def test_a_graph_padded_batch_gives_the_unpadded_outputs_and_states(graph_pad):
    """In a full CUDA graph vLLM pads the recurrence's state-index table past the real rows
    while ``cu_seqlens`` covers the real rows only (the padded rows once made an out-of-range
    gather on the H200): the outputs and every cache block equal the unpadded call's."""
    check_graph_padding(graph_pad)


def check_graph_padding(graph_pad: int) -> None:
    """One tree step unpadded and padded by ``graph_pad`` requests as vLLM's full CUDA graph
    pads it: identical outputs and cache blocks."""
    num_reqs, budget, depth = 2, 5, 3
    results = []
    for pad in (0, graph_pad):
        gen = torch.Generator().manual_seed(3)
        layer, table, step = layer_table_step(num_reqs, budget, gen, max_rows=8)
        num_draft = torch.tensor([budget, budget - 1])
        accepted = torch.tensor([2, 1], dtype=torch.int32)
        *_, out = tree_step(step, layer, table, accepted, gen, budget, depth, num_draft, pad)
        results.append((out, layer.ssm_cache[1:].clone(), layer.conv_cache[1:].clone()))
    for unpadded, padded in zip(*results, strict=True):
        torch.testing.assert_close(padded, unpadded, atol=0, rtol=0)


def test_the_gdn_layers_speculative_rows_must_be_the_tree_rows():
    """vLLM's GDN metadata and the hooks each decide which requests verify drafts; a request
    in one set only is refused loudly (its tree would run through the GDN layers as a chain)."""
    import numpy as np

    from vllm_ddtree.spec_decode.v1_hooks import check_gdn_rows_are_tree_rows

    check_gdn_rows_are_tree_rows(np.array([8, -1, 5]), np.array([8, 0, 5]))
    with pytest.raises(RuntimeError, match=r"disagree .*batch rows \[1\]"):
        check_gdn_rows_are_tree_rows(np.array([8, -1, 5]), np.array([8, 8, 5]))
    with pytest.raises(RuntimeError, match=r"batch rows \[0, 2\]"):
        check_gdn_rows_are_tree_rows(np.array([-1, -1, 0]), np.array([8, 0, 0]))


class GDNLikeModule(torch.nn.Module):
    """What ``prepare_layers`` looks for: vLLM's GDN layer holds ``conv1d.weight`` ``[C, 1, K]``
    and ``A_log``."""

    def __init__(self, layer: Layer):
        super().__init__()
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(layer.weight.unsqueeze(1))
        self.A_log = torch.nn.Parameter(layer.A_log)


def test_layer_buffers_are_made_before_capture_and_the_calls_use_them(monkeypatch):
    """Buffers made inside a CUDA-graph capture come from the graph pool, where the piecewise
    graphs captured earlier keep their temporaries: on the H200 their replays wrote floats over
    a layer's block buffers between its GDN call and the commit (hybrid sampling with vLLM's
    default FULL_AND_PIECEWISE graphs). ``prepare_layers`` (run before vLLM captures) makes them
    for every GDN layer of the model, the layers' calls find those same buffers, and a layer
    first seen inside a capture is refused with a clear error instead."""
    gen = torch.Generator().manual_seed(3)
    num_reqs, budget, depth = 2, 4, 3
    layer, table, step = layer_table_step(num_reqs, budget, gen)
    model = torch.nn.Sequential(GDNLikeModule(layer), torch.nn.Linear(2, 2))
    assert step.prepare_layers(model) == 1
    (prepared,) = step.layers.values()
    assert prepared.inputs.shape == (step.max_rows + 1, budget + 1, CHANNELS)
    # The layer's calls pass the view of the same weight (vLLM: conv1d.weight.view(C, K)).
    layer.weight = model[0].conv1d.weight.data.view(CHANNELS, WIDTH)
    ones = torch.ones(num_reqs, dtype=torch.int32)
    num_draft = torch.tensor([budget, budget])
    tree_step(step, layer, table, ones, gen, budget, depth, num_draft)
    (used,) = step.layers.values()
    assert used is prepared and used.conv_blocks.data_ptr() == prepared.conv_blocks.data_ptr()
    assert used.conv_blocks[:num_reqs].tolist() == table[:, 0].tolist()
    monkeypatch.setattr(gdn_layer, "capturing", lambda: True)
    other = Layer(num_reqs, budget, gen)
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        tree_step(step, other, table, ones, gen, budget, depth, num_draft)
