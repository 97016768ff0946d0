"""KV commit after the tree walk: the Triton kernel against its PyTorch reference."""

import os

import pytest
import torch

from tests.interpreter import run_under_interpreter
from vllm_ddtree.ops.kv_commit import commit_accepted_kv_ref
from vllm_ddtree.tree import build_trees, follow_tree

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def make_batch(num_reqs=5, budget=24, depth=6, block_size=16, heads=2, head_size=32, seed=0):
    """Paged caches with distinct values per slot, verify slots, and walked trees."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, depth, 8, generator=gen) * 2
    tree = build_trees(logits, budget)
    # Targets mostly follow the most likely child, so paths are deep and often branch.
    target = torch.randint(0, 8, (num_reqs, budget + 1), generator=gen)
    for r in range(num_reqs):
        for i in range(budget + 1):
            children = ((tree.parents[r] == i) & tree.valid_mask()[r]).nonzero().flatten()
            if len(children) and torch.rand(1, generator=gen) < 0.8:
                pick = children[torch.randint(0, len(children), (1,), generator=gen)]
                target[r, i] = tree.token_ids[r, pick]
    accepted, num_accepted, _ = follow_tree(tree, target)
    contexts = torch.randint(0, 40, (num_reqs,), generator=gen)
    blocks_per_req = (contexts + budget + 1 + block_size - 1) // block_size
    perm = torch.randperm(int(blocks_per_req.sum()) + 2, generator=gen)
    verify_slots = torch.empty(num_reqs, budget + 1, dtype=torch.long)
    used = 0
    for r in range(num_reqs):
        table = perm[used : used + int(blocks_per_req[r])]
        used += int(blocks_per_req[r])
        positions = contexts[r] + torch.arange(budget + 1)
        verify_slots[r] = table[positions // block_size] * block_size + positions % block_size
    num_blocks = int(perm.numel())
    key_cache = torch.randn(num_blocks, block_size, heads, head_size, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, heads, head_size, generator=gen)
    return key_cache, value_cache, verify_slots, accepted, num_accepted


def test_reference_moves_the_accepted_path_to_contiguous_slots():
    key_cache, value_cache, slots, accepted, num_accepted = make_batch()
    before = key_cache.clone()
    commit_accepted_kv_ref(key_cache, value_cache, slots, accepted, num_accepted)
    bs = key_cache.shape[1]
    assert int(num_accepted.max()) >= 2  # the walk went deep somewhere
    for r in range(slots.shape[0]):
        for j in range(int(num_accepted[r]) + 1):
            src, dst = int(slots[r, int(accepted[r, j])]), int(slots[r, j])
            assert torch.equal(key_cache[dst // bs, dst % bs], before[src // bs, src % bs])


def test_reference_aliasing_path_reads_before_it_overwrites():
    key_cache = torch.arange(8.0).view(1, 8, 1, 1).expand(1, 8, 1, 16).contiguous()
    value_cache = key_cache.clone()
    slots = torch.arange(8).view(1, 8)
    accepted = torch.tensor([[0, 2, 3, 5]])
    commit_accepted_kv_ref(key_cache, value_cache, slots, accepted, torch.tensor([3]))
    assert key_cache[0, :4, 0, 0].tolist() == [0.0, 2.0, 3.0, 5.0]


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_reference(seed):
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.kv_commit import commit_accepted_kv

    device = "cuda" if ON_GPU else "cpu"
    key_cache, value_cache, slots, accepted, num_accepted = make_batch(seed=seed)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    commit_accepted_kv_ref(expected_k, expected_v, slots, accepted, num_accepted)
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    commit_accepted_kv(
        key_cache, value_cache, slots.to(device), accepted.to(device), num_accepted.to(device)
    )
    assert torch.equal(key_cache.cpu(), expected_k) and torch.equal(value_cache.cpu(), expected_v)


@pytest.mark.interpreter
def test_kernel_chain_paths_copy_nothing_and_aliasing_is_ordered():
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.kv_commit import commit_accepted_kv

    device = "cuda" if ON_GPU else "cpu"
    key_cache = torch.arange(8.0).view(1, 8, 1, 1).expand(1, 8, 2, 32).contiguous().to(device)
    value_cache = key_cache.clone() + 100
    slots = torch.arange(8, device=device).view(1, 8).repeat(2, 1)
    slots[1] = slots[1].flip(0)  # request 1 uses the same block backwards: irrelevant here
    accepted = torch.tensor([[0, 2, 3, 5], [0, 1, 2, -1]], device=device)
    num_accepted = torch.tensor([3, 2], device=device)
    commit_accepted_kv(key_cache, value_cache, slots[:1], accepted[:1], num_accepted[:1])
    assert key_cache[0, :4, 0, 0].tolist() == [0.0, 2.0, 3.0, 5.0]
    assert value_cache[0, :4, 1, 0].tolist() == [100.0, 102.0, 103.0, 105.0]
    snapshot = key_cache.clone()
    commit_accepted_kv(key_cache, value_cache, slots[1:], accepted[1:], num_accepted[1:])
    assert torch.equal(key_cache, snapshot)  # chain-shaped path: nothing moves


@pytest.mark.interpreter
def test_kernel_commits_every_layer_in_one_launch():
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.kv_commit import PagedKVLayers, commit_accepted_kv_layers

    device = "cuda" if ON_GPU else "cpu"
    key_cache, value_cache, slots, accepted, num_accepted = make_batch(seed=10)
    layers = [(key_cache + layer, value_cache - layer) for layer in range(3)]
    expected = []
    for k, v in layers:
        k, v = k.clone(), v.clone()
        commit_accepted_kv_ref(k, v, slots, accepted, num_accepted)
        expected.append((k, v))
    keys = [k.to(device) for k, _ in layers]
    values = [v.to(device) for _, v in layers]
    table = PagedKVLayers.of(keys, values)
    commit_accepted_kv_layers(table, slots.to(device), accepted.to(device), num_accepted.to(device))
    for (want_k, want_v), k, v in zip(expected, keys, values, strict=True):
        assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)


@pytest.mark.interpreter
def test_kernel_reads_node_slots_from_the_steps_slot_mapping():
    """``commit_accepted_kv_at`` (what the runners call): each request's tree rows start at its
    root row in the step's flat slot mapping, with rows of other requests (a prefill chunk)
    between them; the result equals the reference on the gathered table."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")
    from vllm_ddtree.ops.kv_commit import PagedKVLayers, commit_accepted_kv_at

    device = "cuda" if ON_GPU else "cpu"
    key_cache, value_cache, slots, accepted, num_accepted = make_batch(seed=11)
    num_reqs, width = slots.shape
    gap = 3  # rows of a request without a tree before each root
    first_row = torch.arange(num_reqs) * (width + gap) + gap
    slot_mapping = torch.full((num_reqs * (width + gap),), -7, dtype=torch.int32)
    for r in range(num_reqs):
        slot_mapping[first_row[r] : first_row[r] + width] = slots[r].int()
    want_k, want_v = key_cache.clone(), value_cache.clone()
    commit_accepted_kv_ref(want_k, want_v, slots, accepted, num_accepted)
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    commit_accepted_kv_at(
        PagedKVLayers.of([key_cache], [value_cache]),
        slot_mapping.to(device),
        first_row.to(device),
        accepted.to(device),
        num_accepted.to(device),
    )
    assert torch.equal(key_cache.cpu(), want_k) and torch.equal(value_cache.cpu(), want_v)


def test_layer_table_refuses_mixed_layouts():
    from vllm_ddtree.ops.kv_commit import PagedKVLayers

    a = torch.zeros(4, 16, 2, 32)
    with pytest.raises(ValueError, match="differ"):
        PagedKVLayers.of([a, torch.zeros(4, 16, 2, 64)], [a, a])
    with pytest.raises(ValueError, match="strides"):
        wide = torch.zeros(4, 16, 4, 32)[:, :, :2]
        PagedKVLayers.of([a, wide], [a, a])


@pytest.mark.interpreter
@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="already native or interpreted")
def test_kernels_under_interpreter():
    """This module's kernel tests, again, under Triton's interpreter."""
    run_under_interpreter(__file__, "kernel_", expected=6)
