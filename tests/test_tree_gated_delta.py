"""GatedDeltaNet recurrence over draft trees: Triton kernel vs the path-replay reference."""

import os

import pytest
import torch

from tests.interpreter import run_under_interpreter
from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta_ref
from vllm_ddtree.tree import build_trees

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def make_case(num_reqs=3, budget=12, depth=5, hk=2, hv=4, dk=16, dv=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tree = build_trees(torch.randn(num_reqs, depth, 6, generator=gen) * 2, budget)
    max_tokens = budget + 1
    parents = torch.full((num_reqs, max_tokens), -1, dtype=torch.long)
    parents[:, 1:] = tree.parents  # tree index t's parent; the root (t = 0) starts from state
    num_tokens = tree.num_nodes + 1
    q = torch.randn(num_reqs, max_tokens, hk, dk, generator=gen)
    k = torch.randn(num_reqs, max_tokens, hk, dk, generator=gen)
    v = torch.randn(num_reqs, max_tokens, hv, dv, generator=gen)
    g = -torch.rand(num_reqs, max_tokens, hv, generator=gen)  # log decay <= 0
    beta = torch.rand(num_reqs, max_tokens, hv, generator=gen)
    slots = num_reqs * (max_tokens + 1)
    pool = torch.randn(slots, hv, dk, dv, generator=gen) * 0.1
    initial_slots = torch.arange(num_reqs) * (max_tokens + 1)
    state_slots = initial_slots.unsqueeze(1) + 1 + torch.arange(max_tokens)
    return dict(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        parents=parents,
        num_tokens=num_tokens,
        state_pool=pool,
        initial_slots=initial_slots,
        state_slots=state_slots,
    )


def test_reference_chain_equals_plain_sequential_recurrence():
    """A chain-shaped tree is ordinary decoding: node t's state is the state after t tokens."""
    case = make_case(num_reqs=1, budget=6, depth=6)
    case["parents"][0] = torch.arange(-1, 6)
    case["num_tokens"] = torch.tensor([7])
    pool_tree = case["state_pool"].clone()
    out_tree = tree_gated_delta_ref(**{**case, "state_pool": pool_tree})
    # Sequential: carry h through tokens 0..6 and compare every output.
    h = case["state_pool"][0].double()
    for t in range(7):
        qn = case["q"][0, t].double().repeat_interleave(2, 0)
        kn = case["k"][0, t].double().repeat_interleave(2, 0)
        qn, kn = qn / qn.norm(dim=-1, keepdim=True), kn / kn.norm(dim=-1, keepdim=True)
        h = h * torch.exp(case["g"][0, t].double())[:, None, None]
        u = case["beta"][0, t].double()[:, None] * (
            case["v"][0, t].double() - torch.einsum("hkv,hk->hv", h, kn)
        )
        h = h + kn[:, :, None] * u[:, None, :]
        expected = torch.einsum("hkv,hk->hv", h, qn * 16**-0.5)
        assert torch.allclose(out_tree[0, t].double(), expected, atol=1e-5)


def test_reference_bf16_tree_path_rounds_as_token_by_token_decoding():
    """bfloat16 node states: a chain-shaped tree gives, at every node, exactly the state and
    output of decoding its tokens one per step with a bfloat16 state cache (each step reads the
    previous token's stored state), the target-alone decoding the tree path must equal."""
    case = make_case(num_reqs=1, budget=6, depth=6)
    case["parents"][0] = torch.arange(-1, 6)
    case["num_tokens"] = torch.tensor([7])
    pool = case["state_pool"].to(torch.bfloat16)
    tree_pool = pool.clone()
    out_tree = tree_gated_delta_ref(**{**case, "state_pool": tree_pool})
    step_pool = pool.clone()  # one token per step: a one-node tree from the last stored state
    previous = int(case["initial_slots"][0])
    for t in range(7):
        one = {name: case[name][:, t : t + 1] for name in ("q", "k", "v", "g", "beta")}
        slot = int(case["state_slots"][0, t])
        out = tree_gated_delta_ref(
            **one,
            parents=torch.tensor([[-1]]),
            num_tokens=torch.tensor([1]),
            state_pool=step_pool,
            initial_slots=torch.tensor([previous]),
            state_slots=torch.tensor([[slot]]),
        )
        assert torch.equal(out[0, 0], out_tree[0, t]), t
        assert torch.equal(step_pool[slot], tree_pool[slot]), t
        previous = slot
    # ...and differs from keeping the states in float32 (what bf16 states cost).
    float_pool = case["state_pool"].clone()
    out_float = tree_gated_delta_ref(**{**case, "state_pool": float_pool})
    assert not torch.equal(out_float[0, 6], out_tree[0, 6])


def test_reference_siblings_do_not_see_each_other():
    case = make_case(seed=3)
    out_a = tree_gated_delta_ref(**{**case, "state_pool": case["state_pool"].clone()})
    # Change the token of one depth-1 node: only it and its descendants may change.
    r, node = 0, int((case["parents"][0] == 0).nonzero()[0])
    changed = dict(case)
    changed["v"] = case["v"].clone()
    changed["v"][r, node] += 1.0
    out_b = tree_gated_delta_ref(**{**changed, "state_pool": case["state_pool"].clone()})
    descendants = {node}
    for t in range(node + 1, int(case["num_tokens"][r])):
        if int(case["parents"][r, t]) in descendants:
            descendants.add(t)
    for t in range(int(case["num_tokens"][r])):
        same = torch.allclose(out_a[r, t], out_b[r, t])
        assert same == (t not in descendants), t


# Launches (block_v, num_warps) the kernel tests run: one under the interpreter; on a GPU also
# the launch served (ops/tree_gated_delta.BLOCK_V, NUM_WARPS).
LAUNCHES = [(16, 4), "served"] if ON_GPU else [(16, 4)]


@pytest.mark.interpreter
@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("seed", range(2))
def test_kernel_matches_reference(seed, launch):
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops import tree_gated_delta as op

    block_v, num_warps = (op.BLOCK_V, op.NUM_WARPS) if launch == "served" else launch
    device = "cuda" if ON_GPU else "cpu"
    case = make_case(seed=seed)
    ref_pool = case["state_pool"].clone()
    ref = tree_gated_delta_ref(**{**case, "state_pool": ref_pool})
    gpu_case = {name: t.to(device) for name, t in case.items()}
    out = op.tree_gated_delta(**gpu_case, block_v=block_v, num_warps=num_warps)
    n = case["num_tokens"]
    for r in range(out.shape[0]):
        assert torch.allclose(out[r, : n[r]].cpu(), ref[r, : n[r]], atol=1e-4), r
    written = case["state_slots"][:, :].flatten()
    valid = (torch.arange(case["parents"].shape[1]).unsqueeze(0) < n.unsqueeze(1)).flatten()
    slots = written[valid]
    assert torch.allclose(gpu_case["state_pool"].cpu()[slots], ref_pool[slots], atol=1e-4)


def scratch_case(seed: int):
    """A case whose committed states live apart from the node states, as on a hybrid target:
    bf16 in vLLM's ``[slots, Hv, V, K]`` SSM layout (read transposed), while the pool is a
    float32 scratch of node states only."""
    case = make_case(seed=seed)
    num_reqs, max_tokens = case["parents"].shape
    gen = torch.Generator().manual_seed(100 + seed)
    hv, dk, dv = case["state_pool"].shape[1:]
    cache = (torch.randn(num_reqs + 3, hv, dv, dk, generator=gen) * 0.1).to(torch.bfloat16)
    case["initial_state"] = cache.transpose(-1, -2)  # [slots, Hv, K, V] view, no copy
    case["initial_slots"] = torch.tensor([3, 0, 5])[:num_reqs]
    case["state_pool"] = torch.zeros(num_reqs * max_tokens, hv, dk, dv)
    case["state_slots"] = torch.arange(num_reqs * max_tokens).view(num_reqs, max_tokens)
    return case


def on_device(case: dict, device: str) -> dict:
    return {name: t.to(device) for name, t in case.items()}


@pytest.mark.interpreter
def test_kernel_with_bf16_node_states_matches_the_rounding_reference():
    """A bfloat16 pool: the kernel rounds each node's state where the reference does (stored,
    then read back by the children); both read the committed states from a bf16 cache."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta

    device = "cuda" if ON_GPU else "cpu"
    case = scratch_case(1)
    case["state_pool"] = case["state_pool"].to(torch.bfloat16)
    ref_pool = case["state_pool"].clone()
    ref = tree_gated_delta_ref(**{**case, "state_pool": ref_pool})
    dev = on_device(case, device)
    dev["initial_state"] = case["initial_state"].to(device)
    out = tree_gated_delta(**dev, block_v=16)
    n = case["num_tokens"]
    valid = torch.arange(case["parents"].shape[1]).unsqueeze(0) < n.unsqueeze(1)
    # float32 kernel arithmetic against float64: a bf16 rounding may land one step apart.
    torch.testing.assert_close(out.cpu()[valid], ref[valid], atol=3e-2, rtol=3e-2)
    slots = case["state_slots"][valid]
    got, want = dev["state_pool"].cpu()[slots].float(), ref_pool[slots].float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert dev["state_pool"].dtype == torch.bfloat16


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_chain_in_one_launch_equals_one_token_per_launch(dtype):
    """A chain-shaped tree (every node's parent the node before, whose state the kernel keeps
    in registers) gives bit for bit the outputs and states of one launch per token, each
    starting from the state the launch before stored (read back from the pool): the state kept
    in registers is rounded to the pool's dtype as the stored one is."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta

    device = "cuda" if ON_GPU else "cpu"
    case = on_device(make_case(num_reqs=1, budget=6, depth=6, seed=4), device)
    steps = 7
    case["parents"][0] = torch.arange(-1, steps - 1, device=device)
    case["num_tokens"] = torch.tensor([steps], device=device)
    case["state_pool"] = case["state_pool"].to(dtype)
    one_pool = case["state_pool"].clone()
    out = tree_gated_delta(**case, block_v=16)
    slots = case["state_slots"][0]
    previous = case["initial_slots"]
    for t in range(steps):
        token = {name: case[name][:, t : t + 1] for name in ("q", "k", "v", "g", "beta")}
        one = tree_gated_delta(
            **token,
            parents=torch.tensor([[-1]], device=device),
            num_tokens=torch.tensor([1], device=device),
            state_pool=one_pool,
            initial_slots=previous,
            state_slots=slots[t : t + 1].unsqueeze(0),
            block_v=16,
        )
        assert torch.equal(out[:, t], one[:, 0]), t
        previous = slots[t : t + 1]
    assert torch.equal(case["state_pool"][slots], one_pool[slots])


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(2))
def test_kernel_reads_committed_states_from_their_own_tensor(seed):
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta

    device = "cuda" if ON_GPU else "cpu"
    case = scratch_case(seed)
    ref_pool = case["state_pool"].clone()
    ref = tree_gated_delta_ref(**{**case, "state_pool": ref_pool})
    dev = on_device(case, device)
    dev["initial_state"] = case["initial_state"].to(device)  # keeps the transposed strides
    assert not dev["initial_state"].is_contiguous()
    out = tree_gated_delta(**dev, block_v=16)
    n = case["num_tokens"]
    for r in range(out.shape[0]):
        assert torch.allclose(out[r, : n[r]].cpu(), ref[r, : n[r]], atol=1e-4), r
    valid = torch.arange(case["parents"].shape[1]).unsqueeze(0) < n.unsqueeze(1)
    slots = case["state_slots"][valid]
    assert torch.allclose(dev["state_pool"].cpu()[slots], ref_pool[slots], atol=1e-4)


@pytest.mark.interpreter
def test_kernel_leaf_state_equals_replaying_its_path_as_a_chain():
    """The committed state after a step: replaying the accepted root-to-leaf path as a chain
    from the committed state gives the leaf's tree state (what the hybrid commit relies on)."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta

    device = "cuda" if ON_GPU else "cpu"
    case = scratch_case(0)
    tree = on_device(case, device)
    tree["initial_state"] = case["initial_state"].to(device)
    tree_gated_delta(**tree, block_v=16)
    r = 0
    leaf = int(case["num_tokens"][r]) - 1  # the last node: a deepest-ranked leaf
    path = [leaf]
    while int(case["parents"][r, path[-1]]) >= 0:
        path.append(int(case["parents"][r, path[-1]]))
    path.reverse()
    assert len(path) >= 2, "the case should accept a path, not only the root"
    chain = {name: case[name][r : r + 1, path] for name in ("q", "k", "v", "g", "beta")}
    steps = len(path)
    chain_pool = torch.zeros(steps, *case["state_pool"].shape[1:])
    tree_gated_delta(
        **on_device(chain, device),
        parents=torch.arange(-1, steps - 1).unsqueeze(0).to(device),
        num_tokens=torch.tensor([steps]).to(device),
        state_pool=(chain_pool := chain_pool.to(device)),
        initial_state=case["initial_state"].to(device),
        initial_slots=case["initial_slots"][r : r + 1].to(device),
        state_slots=torch.arange(steps).unsqueeze(0).to(device),
        block_v=16,
    )
    leaf_state = tree["state_pool"][int(case["state_slots"][r, leaf])]
    assert torch.allclose(chain_pool[steps - 1], leaf_state, atol=1e-5)


@pytest.mark.interpreter
def test_kernel_writes_into_a_vllm_layout_cache_through_a_block_table():
    """As in vLLM's speculative GDN path: node t's state goes to block ``table[r, t]`` of the
    float32 SSM cache ``[blocks, Hv, V, K]`` (read transposed), the table a slice of a wider
    int32 block table, the step's start in block ``table[r, accepted - 1]``."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta

    device = "cuda" if ON_GPU else "cpu"
    case = make_case(seed=5)
    num_reqs, max_tokens = case["parents"].shape
    hv, dk, dv = case["state_pool"].shape[1:]
    gen = torch.Generator().manual_seed(7)
    blocks = num_reqs * (max_tokens + 3) + 4
    cache = torch.randn(blocks, hv, dv, dk, generator=gen) * 0.1  # vLLM's [Hv, V, K]
    wide = torch.randperm(blocks - 1, generator=gen)[: num_reqs * (max_tokens + 3)] + 1
    table = wide.view(num_reqs, max_tokens + 3).to(torch.int32)[:, :max_tokens]  # strided rows
    accepted = torch.tensor([1, 3, 2])[:num_reqs]
    case["state_slots"] = table
    case["initial_slots"] = table.long().gather(1, (accepted - 1).unsqueeze(1)).squeeze(1)
    ref_cache = cache.transpose(-1, -2).clone()
    ref = tree_gated_delta_ref(**{**case, "state_pool": ref_cache})
    dev_cache = cache.to(device)
    dev = {k: v.to(device) for k, v in case.items() if k != "state_pool"}
    out = tree_gated_delta(**dev, state_pool=dev_cache.transpose(-1, -2), block_v=16)
    n = case["num_tokens"]
    for r in range(num_reqs):
        assert torch.allclose(out[r, : n[r]].cpu(), ref[r, : n[r]], atol=1e-4), r
    written = table.long()[torch.arange(max_tokens).unsqueeze(0) < n.unsqueeze(1)]
    got = dev_cache.transpose(-1, -2).cpu()[written]
    assert torch.allclose(got, ref_cache[written], atol=1e-4)


def packed_vllm_case(seed=9, graph_pad=2, **shape):
    """vLLM's speculative GDN call over ``make_case``'s trees: tokens packed by
    ``query_start_loc`` (row 1 two nodes short, ``graph_pad`` padding tokens), q/k/v views of
    one conv output ``[n, C]`` (token stride C), ``a``/``b`` views of one ``[n, 2 Hv]``
    projection, raw gates, the SSM cache ``[blocks, Hv, V, K]`` (seen ``[Hv, K, V]``) behind a
    strided int32 block table, rows starting from blocks ``[r, num_accepted - 1]``. ``shape``:
    ``make_case``'s tree and head sizes."""
    case = make_case(seed=seed, **shape)
    rows, width, hk, dk = case["q"].shape
    hv, dv = case["v"].shape[2:]
    gen = torch.Generator().manual_seed(seed)
    lengths = case["num_tokens"].clone()
    lengths[1] -= 2
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(starts[-1]) + graph_pad
    mixed = torch.randn(n, 2 * hk * dk + hv * dv, generator=gen)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    gates = torch.randn(n, 2 * hv, generator=gen)
    blocks = rows * (width + 3) + 4
    cache = torch.randn(blocks, hv, dv, dk, generator=gen) * 0.1
    wide = torch.randperm(blocks - 1, generator=gen)[: rows * (width + 3)] + 1
    table = wide.view(rows, width + 3).to(torch.int32)[:, :width]
    return dict(
        q=q.view(n, hk, dk),
        k=k.view(n, hk, dk),
        v=v.view(n, hv, dv),
        a=gates[:, :hv],
        b=gates[:, hv:],
        A_log=torch.randn(hv, generator=gen) * 0.3,
        dt_bias=torch.randn(hv, generator=gen) * 0.3,
        query_start_loc=torch.cat([starts, starts.new_full((1,), n)]).to(torch.int32),
        parents=case["parents"],
        num_tokens=case["num_tokens"],
        state_pool=cache.transpose(-1, -2),
        state_slots=table,
        num_accepted=torch.tensor([1, 3, 2], dtype=torch.int32),
    ), lengths


@pytest.mark.interpreter
def test_kernel_packed_vllm_call_equals_the_reference():
    """The packed launch (gates from ``a``/``b``, start blocks from ``num_accepted``, the
    blocks kept for the commit) against its reference: outputs (zeros past the rows), every
    node's stored state, the kept block table."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.tree_gated_delta import (
        tree_gated_delta_packed,
        tree_gated_delta_packed_ref,
    )

    device = "cuda" if ON_GPU else "cpu"
    case, lengths = packed_vllm_case()
    rows, width = case["parents"].shape
    results = []
    for fn, where in ((tree_gated_delta_packed_ref, "cpu"), (tree_gated_delta_packed, device)):
        cache = case["state_pool"].transpose(-1, -2).clone().to(where)
        args = {k: v.to(where) for k, v in case.items() if k != "state_pool"}
        saved = torch.zeros(rows + 1, width, dtype=torch.int32, device=where)
        out = fn(**args, state_pool=cache.transpose(-1, -2), saved_slots=saved)
        results.append((out.cpu(), cache.cpu(), saved.cpu()))
    (ref, ref_cache, ref_saved), (out, cache, saved) = results
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert not out[int(lengths.sum()) :].any(), "graph padding gets zeros"
    torch.testing.assert_close(cache, ref_cache, atol=1e-4, rtol=1e-4)
    assert torch.equal(saved, ref_saved) and torch.equal(saved[:rows], case["state_slots"])


def test_packed_reference_starts_each_row_from_its_accepted_block():
    """The packed reference reads row ``r``'s committed state from block ``[r, num_accepted -
    1]`` and writes node ``t``'s to ``[r, t]``: a one-node row's state is the one-token update
    of that block's."""
    from vllm_ddtree.ops.tree_gated_delta import gdn_gates_ref, tree_gated_delta_packed_ref

    case, _ = packed_vllm_case()
    case["num_tokens"] = torch.tensor([1, 1, 1])
    before = case["state_pool"].clone()
    tree_gated_delta_packed_ref(**case)
    g, beta = gdn_gates_ref(case["A_log"], case["a"], case["b"], case["dt_bias"])
    for r in range(3):
        table = case["state_slots"][r].long()
        start = before[int(table[int(case["num_accepted"][r]) - 1])]
        token = int(case["query_start_loc"][r])
        pool = start.unsqueeze(0).clone()
        tree_gated_delta_ref(
            *(t[token : token + 1].unsqueeze(0) for t in (case["q"], case["k"], case["v"])),
            g[token : token + 1].unsqueeze(0),
            beta[token : token + 1].unsqueeze(0),
            torch.tensor([[-1]]),
            torch.tensor([1]),
            pool,
            torch.tensor([0]),
            torch.tensor([[0]]),
        )
        torch.testing.assert_close(case["state_pool"][int(table[0])], pool[0])


@pytest.mark.interpreter
@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="already native or interpreted")
def test_kernels_under_interpreter():
    """This module's kernel tests, again, under Triton's interpreter."""
    run_under_interpreter(__file__, "kernel_", expected=10)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the shape grid is too slow interpreted)")
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_on_gpu_real_head_shapes_match_reference(budget):
    """Qwen3.5-style GDN heads (K = V = 128, 2 value heads per key head), trees of depth 15."""
    from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta

    case = make_case(num_reqs=4, budget=budget, depth=15, hk=2, hv=4, dk=128, dv=128, seed=budget)
    case = {name: t.cuda() for name, t in case.items()}
    assert int(case["num_tokens"].max()) == budget + 1
    ref_pool = case["state_pool"].clone()
    ref = tree_gated_delta_ref(**{**case, "state_pool": ref_pool})
    out = tree_gated_delta(**case)
    n = case["num_tokens"]
    for r in range(out.shape[0]):
        torch.testing.assert_close(out[r, : n[r]], ref[r, : n[r]], atol=2e-3, rtol=1e-3)
    valid = torch.arange(case["parents"].shape[1], device="cuda").unsqueeze(0) < n.unsqueeze(1)
    slots = case["state_slots"][valid]
    torch.testing.assert_close(case["state_pool"][slots], ref_pool[slots], atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the shape grid is too slow interpreted)")
@pytest.mark.parametrize("budget", [32, 128])
def test_on_gpu_packed_vllm_call_at_the_27b_heads_matches_reference(budget):
    """The packed launch as the hybrid step makes it, at Qwen3.6-27B's GDN heads (16 key / 48
    value heads of 128), trees of depth 15, against its reference."""
    from vllm_ddtree.ops.tree_gated_delta import (
        tree_gated_delta_packed,
        tree_gated_delta_packed_ref,
    )

    shape = dict(budget=budget, depth=15, hk=16, hv=48, dk=128, dv=128)
    case, lengths = packed_vllm_case(seed=budget, **shape)
    rows, width = case["parents"].shape
    results = []
    for fn, where in ((tree_gated_delta_packed_ref, "cpu"), (tree_gated_delta_packed, "cuda")):
        cache = case["state_pool"].transpose(-1, -2).clone().to(where)
        args = {k: v.to(where) for k, v in case.items() if k != "state_pool"}
        out = fn(**args, state_pool=cache.transpose(-1, -2))
        results.append((out.cpu(), cache.cpu()))
    (ref, ref_cache), (out, cache) = results
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(cache, ref_cache, atol=2e-3, rtol=1e-3)
