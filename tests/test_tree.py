"""The tree algorithms against brute force and against their own invariants."""

import itertools
import math

import pytest
import torch

from vllm_ddtree.tree import (
    DDTreeBatch,
    ancestor_mask,
    build_trees,
    check_tree,
    follow_tree,
    summarize,
)


def brute_force_top_prefixes(logits: torch.Tensor, budget: int, top_k: int | None):
    """All prefixes of one request [L, V] with their scores, best `budget` first."""
    depth_limit, vocab = logits.shape
    cap = min(budget, vocab) if top_k is None else min(top_k, budget, vocab)
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    allowed = [torch.topk(log_probs[d], cap).indices.tolist() for d in range(depth_limit)]
    prefixes = []
    for depth in range(1, depth_limit + 1):
        for combo in itertools.product(*allowed[:depth]):
            score = sum(log_probs[d, t].item() for d, t in enumerate(combo))
            prefixes.append((score, combo))
    prefixes.sort(key=lambda p: (-p[0], len(p[1])))
    return prefixes[:budget]


def node_paths(tree: DDTreeBatch, r: int) -> list[tuple[int, ...]]:
    """The token path from the root to every real node of request r."""
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for i in range(int(tree.num_nodes[r])):
        parent = int(tree.parents[r, i])
        paths[i + 1] = paths[parent] + (int(tree.token_ids[r, i]),)
    return [paths[i + 1] for i in range(int(tree.num_nodes[r]))]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "depth_limit,vocab,budget,top_k",
    [
        (3, 5, 10, None),
        (4, 4, 17, 3),
        (2, 6, 40, None),
        (5, 3, 8, 2),
        (1, 7, 4, None),
        (3, 5, 200, None),
    ],
)
def test_build_trees_selects_the_brute_force_top_prefixes(seed, depth_limit, vocab, budget, top_k):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, depth_limit, vocab, generator=gen) * 2.0
    tree = build_trees(logits, budget, top_k)
    check_tree(tree)
    assert tree.token_ids.shape == (3, budget)
    for r in range(3):
        expected = brute_force_top_prefixes(logits[r], budget, top_k)
        assert int(tree.num_nodes[r]) == len(expected)
        got_paths = node_paths(tree, r)
        assert set(got_paths) == {p for _, p in expected}
        expected_scores = {p: s for s, p in expected}
        for i, path in enumerate(got_paths):
            assert math.isclose(float(tree.scores[r, i]), expected_scores[path], abs_tol=1e-4)
            assert int(tree.depths[r, i]) == len(path)


def test_scores_are_non_increasing_and_parents_precede_children():
    logits = torch.randn(4, 15, 64, generator=torch.Generator().manual_seed(1))
    tree = build_trees(logits, 64)
    check_tree(tree)
    assert torch.all(tree.scores[:, 1:] <= tree.scores[:, :-1])
    node_index = torch.arange(1, 65)
    assert torch.all(tree.parents < node_index)


def test_fewer_prefixes_than_budget_pads_the_rest():
    logits = torch.randn(2, 2, 3)
    tree = build_trees(logits, tree_budget=50)
    check_tree(tree)
    assert tree.num_nodes.tolist() == [3 + 9, 3 + 9]
    assert torch.all(tree.token_ids[:, 12:] == -1)
    assert torch.all(tree.parents[:, 12:] == 0)
    assert torch.all(tree.depths[:, 12:] == 0)


def test_zero_probability_tokens_are_never_drafted():
    logits = torch.full((1, 3, 6), float("-inf"))
    logits[0, :, 2] = 0.0
    logits[0, 1, 4] = -1.0
    tree = build_trees(logits, tree_budget=10)
    check_tree(tree)
    assert set(node_paths(tree, 0)) == {(2,), (2, 2), (2, 4), (2, 2, 2), (2, 4, 2)}


def test_certain_tokens_keep_the_tree_prefix_closed():
    # Probability-1 positions give children the same score as their parent.
    logits = torch.full((2, 4, 5), -1e9)
    logits[:, :, 1] = 0.0
    logits[1, 2, 3] = 0.0  # a 50/50 split at depth 3
    tree = build_trees(logits, tree_budget=6)
    check_tree(tree)
    assert node_paths(tree, 0)[:4] == [(1,), (1, 1), (1, 1, 1), (1, 1, 1, 1)]
    assert set(node_paths(tree, 1)[:4]) == {(1,), (1, 1), (1, 1, 1), (1, 1, 3)}


def test_top_k_caps_siblings_per_depth():
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(3))
    tree = build_trees(logits, tree_budget=100, top_k=2)
    check_tree(tree)
    for r in range(3):
        for parent in range(101):
            siblings = ((tree.parents[r] == parent) & tree.valid_mask()[r]).sum()
            assert siblings <= 2


def test_ancestor_mask_matches_parent_chains():
    logits = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(4))
    tree = build_trees(logits, tree_budget=30, top_k=3)
    mask = ancestor_mask(tree)
    assert mask.shape == (3, 31, 31) and mask.dtype == torch.bool
    for r in range(3):
        n = int(tree.num_nodes[r])
        for i in range(n + 1):
            expected = {i}
            j = i
            while j != 0:
                j = int(tree.parents[r, j - 1])
                expected.add(j)
            assert set(torch.nonzero(mask[r, i]).flatten().tolist()) == expected


def test_ancestor_mask_padding_sees_only_itself():
    tree = build_trees(torch.randn(1, 1, 3), tree_budget=5)
    mask = ancestor_mask(tree)
    for i in range(4, 6):
        assert mask[0, i].nonzero().flatten().tolist() == [i]
        assert mask[0, :, i].nonzero().flatten().tolist() == [i]


def sequential_walk(tree: DDTreeBatch, r: int, target_tokens: torch.Tensor):
    """The reference walk of one request, with a child map (paper, Sec. 1.5)."""
    children: dict[int, dict[int, int]] = {}
    for i in range(int(tree.num_nodes[r])):
        children.setdefault(int(tree.parents[r, i]), {})[int(tree.token_ids[r, i])] = i + 1
    current, path = 0, [0]
    while int(target_tokens[r, current]) in children.get(current, {}):
        current = children[current][int(target_tokens[r, current])]
        path.append(current)
    return path, int(target_tokens[r, current])


@pytest.mark.parametrize("seed", range(5))
def test_follow_tree_matches_a_sequential_walk(seed):
    gen = torch.Generator().manual_seed(seed)
    depth_limit, vocab, budget = 5, 4, 40
    logits = torch.randn(6, depth_limit, vocab, generator=gen)
    tree = build_trees(logits, budget)
    # Target tokens that often follow the tree: copy a random node's first child token.
    target = torch.randint(0, vocab, (6, budget + 1), generator=gen)
    accepted, num_accepted, bonus = follow_tree(tree, target)
    assert accepted.shape == (6, depth_limit + 1)
    for r in range(6):
        path, expected_bonus = sequential_walk(tree, r, target)
        assert accepted[r, : len(path)].tolist() == path
        assert torch.all(accepted[r, len(path) :] == -1)
        assert int(num_accepted[r]) == len(path) - 1
        assert int(bonus[r]) == expected_bonus


def test_follow_tree_accepts_the_whole_spine_when_the_target_agrees():
    logits = torch.randn(2, 6, 10, generator=torch.Generator().manual_seed(7))
    greedy = logits.argmax(-1)
    logits.scatter_add_(2, greedy.unsqueeze(2), torch.full((2, 6, 1), 4.0))  # a likely spine
    tree = build_trees(logits, tree_budget=20)  # the spine: rank-0 token at every depth
    target = torch.zeros(2, 21, dtype=torch.long)
    for r in range(2):
        # Node at depth d on the spine: the target picks the spine token of depth d + 1.
        for i in range(-1, 20):
            depth = 0 if i < 0 else int(tree.depths[r, i])
            target[r, i + 1] = greedy[r, depth] if depth < 6 else 3
    accepted, num_accepted, bonus = follow_tree(tree, target)
    assert num_accepted.tolist() == [6, 6]
    assert bonus.tolist() == [3, 3]


def test_follow_tree_with_no_match_returns_the_root_token():
    tree = build_trees(torch.randn(1, 3, 5), tree_budget=4)
    target = torch.full((1, 5), 99)
    accepted, num_accepted, bonus = follow_tree(tree, target)
    assert accepted[0].tolist() == [0, -1, -1, -1]
    assert num_accepted.tolist() == [0] and bonus.tolist() == [99]


def test_follow_tree_rejects_a_wrong_target_shape():
    tree = build_trees(torch.randn(1, 3, 5), tree_budget=4)
    with pytest.raises(ValueError, match=r"\[R, N \+ 1\]"):
        follow_tree(tree, torch.zeros(1, 4, dtype=torch.long))


def test_summarize_reports_structure():
    logits = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(2))
    tree = build_trees(logits, tree_budget=12)
    info = summarize(tree, num_accepted=torch.tensor([3, 0]))
    assert [d["budget"] for d in info] == [12, 12]
    assert sum(info[0]["branching"]) == info[0]["nodes"] == 12
    assert info[0]["accepted"] == 3
    assert 1 <= info[0]["leaves"] <= 12
    assert info[0]["max_depth"] == len(info[0]["branching"])


@pytest.mark.parametrize(
    "field,index,value,message",
    [
        ("parents", 3, 5, "must be in 0..3"),
        ("depths", 2, 4, "depth 4 !="),
        ("token_ids", 1, -3, "must be >= 0"),
        ("scores", 5, 10.0, "non-increasing"),
    ],
)
def test_check_tree_names_the_inconsistent_node(field, index, value, message):
    tree = build_trees(torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(5)), 10)
    getattr(tree, field)[1, index] = value
    with pytest.raises(ValueError, match=f"request 1, node {index}.*{message}"):
        check_tree(tree)


def test_check_tree_rejects_duplicate_siblings_and_dirty_padding():
    tree = build_trees(torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(6)), 30)
    bad = DDTreeBatch(
        **{k: (v.clone() if torch.is_tensor(v) else v) for k, v in vars(tree).items()}
    )
    first_children = (bad.parents[0] == 0).nonzero().flatten()
    bad.token_ids[0, first_children[1]] = bad.token_ids[0, first_children[0]]
    with pytest.raises(ValueError, match="repeats a sibling"):
        check_tree(bad)
    tree.token_ids[0, 25] = 7
    with pytest.raises(ValueError, match="padding slot 25"):
        check_tree(tree)


def test_build_trees_rejects_bad_arguments():
    with pytest.raises(ValueError, match="budget"):
        build_trees(torch.randn(1, 2, 3), 0)
    with pytest.raises(ValueError, match="top_k"):
        build_trees(torch.randn(1, 2, 3), 4, top_k=0)
    with pytest.raises(ValueError, match=r"\[R, L, V\]"):
        build_trees(torch.randn(2, 3), 4)


def test_half_precision_logits_are_scored_in_float32():
    logits = torch.randn(2, 5, 30, generator=torch.Generator().manual_seed(8))
    full = build_trees(logits, 16)
    half = build_trees(logits.bfloat16(), 16)
    assert half.scores.dtype == torch.float32
    check_tree(half)
    assert torch.equal(full.depths > 0, half.depths > 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_cuda_matches_cpu():
    logits = torch.randn(8, 15, 1000, generator=torch.Generator().manual_seed(9))
    cpu_tree = build_trees(logits, 64, 16)
    gpu_tree = build_trees(logits.cuda(), 64, 16).to("cpu")
    assert torch.equal(cpu_tree.token_ids, gpu_tree.token_ids)
    assert torch.equal(cpu_tree.parents, gpu_tree.parents)


def test_select_trees_reorders_rows_and_cuts_them_to_a_prefix_of_nodes():
    """Rows picked by index (a request's tree follows it to its new batch row) and cut to the
    scheduled nodes: the first nodes in best-first order, which are still a tree."""
    from vllm_ddtree.tree import select_trees

    trees = build_trees(torch.randn(3, 4, 30, generator=torch.Generator().manual_seed(1)), 8)
    picked = select_trees(trees, torch.tensor([2, 0]), torch.tensor([8, 3]))
    assert torch.equal(picked.token_ids[0], trees.token_ids[2])
    assert picked.num_nodes.tolist() == [int(trees.num_nodes[2]), 3]
    assert torch.equal(picked.token_ids[1, :3], trees.token_ids[0, :3])
    assert (picked.token_ids[1, 3:] == -1).all() and (picked.parents[1, 3:] == 0).all()
    assert (picked.parents[1, :3] <= torch.arange(3)).all()  # parents come first: a tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_depth_candidates_are_the_log_softmax_top_k(dtype):
    """Each depth's candidates: the top-k of the log-softmax, found from the logits' own top-k
    and normalised at those tokens only."""
    from vllm_ddtree.tree import depth_candidates

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, 500, generator=gen) * 3).to(dtype)
    logits[0, 0, :7] = float("-inf")
    log_probs, tokens = depth_candidates(logits, 16, None)
    want = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(log_probs, want.gather(-1, tokens), rtol=0, atol=1e-5)
    assert torch.equal(torch.topk(want, 16, dim=-1).values, want.gather(-1, tokens))
    assert (log_probs[..., :-1] >= log_probs[..., 1:]).all()
    assert not torch.isin(tokens[0, 0], torch.arange(7)).any()
