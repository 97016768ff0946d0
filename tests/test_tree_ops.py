"""The one-launch tree walk and ancestor-mask kernels against their PyTorch references."""

import os

import pytest
import torch

from tests.interpreter import run_under_interpreter
from vllm_ddtree.ops.tree_mask import packed_ancestor_mask_ref
from vllm_ddtree.ops.tree_walk import follow_tree_ref
from vllm_ddtree.tree import build_trees, empty_batch

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"

# (requests, depth, vocab, budget): one mask word and several; padding (vocab too small for
# the budget); depth 1; budget 1.
CASES = [(3, 4, 5, 10), (2, 16, 6, 100), (4, 3, 2, 40), (2, 1, 9, 5), (3, 6, 4, 1)]


def walked_batch(num_reqs, depth, vocab, budget, seed):
    """Trees from random logits and target tokens that mostly follow a child (deep walks)."""
    gen = torch.Generator().manual_seed(seed)
    tree = build_trees(torch.randn(num_reqs, depth, vocab, generator=gen) * 2, budget)
    target = torch.randint(0, vocab, (num_reqs, budget + 1), generator=gen)
    valid = tree.valid_mask()
    for r in range(num_reqs):
        for i in range(budget + 1):
            children = ((tree.parents[r] == i) & valid[r]).nonzero().flatten()
            if len(children) and torch.rand(1, generator=gen) < 0.85:
                pick = children[torch.randint(0, len(children), (1,), generator=gen)]
                target[r, i] = tree.token_ids[r, pick]
    return tree, target


def needs_kernel():
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(2))
def test_kernel_walk_matches_reference(case, seed):
    needs_kernel()
    from vllm_ddtree.ops.tree_walk import follow_tree_triton

    tree, target = walked_batch(*case, seed=seed)
    expected = follow_tree_ref(tree, target)
    got = follow_tree_triton(tree.to(DEVICE), target.to(DEVICE))
    for name, want, have in zip(("accepted", "num_accepted", "bonus"), expected, got, strict=True):
        assert torch.equal(have.cpu(), want), name
    if case[3] > 1:
        assert int(expected[1].max()) >= 1  # the walk left the root somewhere


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_kernel_mask_matches_reference(case):
    needs_kernel()
    from vllm_ddtree.ops.tree_mask import packed_ancestor_mask_triton

    tree, _ = walked_batch(*case, seed=1)
    expected = packed_ancestor_mask_ref(tree)
    got = packed_ancestor_mask_triton(tree.to(DEVICE))
    assert got.dtype == torch.int32 and got.shape == expected.shape
    assert torch.equal(got.cpu(), expected)


@pytest.mark.interpreter
def test_kernel_empty_trees_see_only_themselves_and_walk_nowhere():
    needs_kernel()
    from vllm_ddtree.ops.tree_mask import packed_ancestor_mask_triton
    from vllm_ddtree.ops.tree_walk import follow_tree_triton

    tree = empty_batch(2, 40, 5, DEVICE)
    expected = packed_ancestor_mask_ref(tree.to("cpu"))
    assert torch.equal(packed_ancestor_mask_triton(tree).cpu(), expected)
    target = torch.arange(82, device=DEVICE).view(2, 41)
    accepted, num_accepted, bonus = follow_tree_triton(tree, target)
    assert accepted.cpu().tolist() == [[0, -1, -1, -1, -1, -1]] * 2
    assert num_accepted.cpu().tolist() == [0, 0] and bonus.cpu().tolist() == [0, 41]


@pytest.mark.interpreter
@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="already native or interpreted")
def test_kernels_under_interpreter():
    """This module's kernel tests, again, under Triton's interpreter."""
    run_under_interpreter(__file__, "kernel_", expected=2 * len(CASES) + len(CASES) + 1)
