"""``ProposalStore`` (the V2 runner's proposals between steps): whatever rows each step comes
with, the trees it verifies are each request's latest proposal cut to its scheduled nodes,
whether taken from the drafter's rows as they are (steady steps) or selected from the
per-request copies."""

import numpy as np
import pytest
import torch

from vllm_ddtree.spec_decode.proposal_store import TREE_FIELDS, ProposalStore, RequestTrees
from vllm_ddtree.tree import DDTreeBatch, build_trees, empty_batch, select_trees

BUDGET, DEPTH, VOCAB, SLOTS = 5, 3, 30, 6


def request_ids(rows: list[int], generation: int = 0) -> list[str]:
    return [f"request-{state}-{generation}" for state in rows]


def step_trees(store: ProposalStore, rows: list[int], num_draft: list[int], ids=None):
    """A scheduled step as the V2 hooks run it: take the rows' proposals, then the trees cut
    to the scheduled nodes of the rows that had one."""
    has_tree = store.take(np.array(rows), ids or request_ids(rows))
    num_nodes = np.where(has_tree, np.array(num_draft), 0)
    return store.step_trees(
        np.array(rows), torch.tensor(rows, dtype=torch.int32), num_nodes, torch.tensor(num_nodes)
    )


def propose(store: ProposalStore, rows: list[int], gen: torch.Generator) -> dict:
    """One drafter run for request states ``rows`` as the V2 speculator does it (flush, write
    the batch rows, record them); returns each state's new tree (a copy)."""
    trees = build_trees(torch.randn(len(rows), DEPTH, VOCAB, generator=gen) * 3, BUDGET)
    store.flush()
    store.write_batch(trees)
    store.proposed(np.array(rows), torch.tensor(rows, dtype=torch.int32), request_ids(rows))
    return {
        state: {name: getattr(trees, name)[i].clone() for name in TREE_FIELDS}
        for i, state in enumerate(rows)
    }


def expected(latest: dict, rows: list[int], num_draft: list[int]) -> DDTreeBatch:
    """Each row's latest proposal, cut to its scheduled nodes (``select_trees`` over them);
    a request not proposed for yet (a prefill: no drafts) gets an empty tree."""
    empty = {name: getattr(empty_batch(1, BUDGET, DEPTH, "cpu"), name)[0] for name in TREE_FIELDS}
    stacked = DDTreeBatch(
        **{name: torch.stack([latest.get(s, empty)[name] for s in rows]) for name in TREE_FIELDS},
        max_depth=DEPTH,
    )
    return select_trees(stacked, torch.arange(len(rows)), torch.tensor(num_draft))


# Each step: the request states of its rows and their scheduled drafts; a proposal follows.
SCHEDULES = {
    "steady": [([2, 5], [5, 5])] * 4,
    "reordered": [([2, 5], [5, 5]), ([5, 2], [5, 5]), ([5, 2], [5, 5])],
    "one_left_then_back": [
        ([1, 3, 4], [5, 5, 5]),
        ([1, 4], [5, 5]),
        ([1, 4], [5, 5]),
        ([1, 3, 4], [5, 5, 5]),
    ],
    "cut_tree": [([0, 2], [5, 5]), ([0, 2], [5, 3]), ([0, 2], [5, 5])],
    "prefill_between": [([0], [5]), ([0, 4], [5, 0]), ([0, 4], [5, 5])],
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_step_verifies_every_requests_latest_proposal(schedule):
    gen = torch.Generator().manual_seed(0)
    store = ProposalStore(SLOTS, BUDGET, DEPTH, torch.device("cpu"))
    steps = SCHEDULES[schedule]
    latest = propose(store, steps[0][0], gen)  # the proposal of the steps' first rows
    steady_steps = 0
    for rows, num_draft in steps:
        pending = store._pending_rows
        trees = step_trees(store, rows, num_draft)
        steady_steps += trees.token_ids.data_ptr() == store.batch.token_ids.data_ptr()
        want = expected(latest, rows, num_draft)
        assert torch.equal(trees.num_nodes, want.num_nodes), (schedule, rows)
        kept = want.valid_mask()  # a tree's slots past its nodes are read by nobody
        for name in TREE_FIELDS[:-1]:
            got, ref = getattr(trees, name), getattr(want, name)
            assert torch.equal(got[kept], ref[kept]), (schedule, rows, name)
        if pending is not None and list(pending) == rows:  # whole trees or cut ones
            assert trees.token_ids.data_ptr() == store.batch.token_ids.data_ptr()
        latest.update(propose(store, rows, gen))
    if schedule in ("steady", "cut_tree"):
        assert steady_steps == len(steps), "steady steps verify the drafter's rows in place"


def test_proposed_without_a_flush_is_refused():
    gen = torch.Generator().manual_seed(1)
    store = ProposalStore(SLOTS, BUDGET, DEPTH, torch.device("cpu"))
    propose(store, [0], gen)
    with pytest.raises(AssertionError, match="flush"):
        store.proposed(np.array([0]), torch.tensor([0]), request_ids([0]))


def test_a_proposal_is_verified_once_and_only_by_its_own_request():
    """A proposal is good for its request's next scheduled step: a second step without a new
    proposal (vLLM skipped the drafter) verifies no tree, nor does a new request in a finished
    one's state (a padded 1-token request), nor a step without drafts that took it."""
    gen = torch.Generator().manual_seed(2)
    store = ProposalStore(SLOTS, BUDGET, DEPTH, torch.device("cpu"))
    propose(store, [1, 2, 3], gen)
    assert int(step_trees(store, [1, 2], [BUDGET, BUDGET]).num_nodes.min()) == BUDGET
    assert step_trees(store, [1, 2], [BUDGET, BUDGET]).num_nodes.tolist() == [0, 0]
    reused = step_trees(store, [3], [BUDGET], ids=request_ids([3], generation=1))
    assert reused.num_nodes.tolist() == [0]
    propose(store, [4], gen)
    store.take(np.array([4]), request_ids([4]))  # a step that scheduled no drafts for it
    assert step_trees(store, [4], [BUDGET]).num_nodes.tolist() == [0]


def test_v1_request_trees_take_each_requests_own_latest_proposal():
    """V1 (``RequestTrees``): a request left out of a step keeps its proposal and verifies it
    beside the others' newer ones; a request never proposed for, or whose proposal was taken,
    verifies none."""
    gen = torch.Generator().manual_seed(3)
    store = RequestTrees(BUDGET, DEPTH)
    first = build_trees(torch.randn(3, DEPTH, VOCAB, generator=gen) * 3, BUDGET)
    store.proposed(["a", "b", "c"], first)
    taken = store.take(["a", "b"], np.array([BUDGET, BUDGET]))  # "c" left out
    assert taken.source.tolist() == [0, 1]
    second = build_trees(torch.randn(2, DEPTH, VOCAB, generator=gen) * 3, BUDGET)
    store.proposed(["a", "b"], second)
    taken = store.take(["b", "c", "d", "a"], np.array([BUDGET, 3, BUDGET, BUDGET]))
    trees = taken.trees(*tables(taken))
    want = {"b": (second, 1, BUDGET), "c": (first, 2, 3), "a": (second, 0, BUDGET)}
    for row, req_id in enumerate(["b", "c", "d", "a"]):
        if req_id not in want:
            assert int(trees.num_nodes[row]) == 0  # never proposed for
            continue
        source, source_row, nodes = want[req_id]
        assert int(trees.num_nodes[row]) == nodes
        assert torch.equal(trees.token_ids[row, :nodes], source.token_ids[source_row, :nodes])
        assert torch.equal(trees.parents[row, :nodes], source.parents[source_row, :nodes])
    again = store.take(["a", "b", "c"], np.array([BUDGET] * 3))
    assert again.num_nodes.tolist() == [0, 0, 0] and not again.sources


def test_v1_a_steady_step_verifies_the_proposal_in_place():
    gen = torch.Generator().manual_seed(4)
    store = RequestTrees(BUDGET, DEPTH)
    trees = build_trees(torch.randn(2, DEPTH, VOCAB, generator=gen) * 3, BUDGET)
    store.proposed(["a", "b"], trees)
    taken = store.take(["a", "b"], np.array([BUDGET, BUDGET]))
    assert taken.trees(*tables(taken)) is trees
    store.proposed(["a", "b"], trees)
    store.forget_all_but({"b"})  # "a" finished
    assert store.take(["a", "b"], np.array([BUDGET, BUDGET])).num_nodes.tolist() == [0, BUDGET]


def tables(taken) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(taken.source), torch.from_numpy(taken.num_nodes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tree_cut_in_place_verifies_as_its_cleaned_selection(seed):
    """The steady step's cut keeps the drafted nodes past each tree's cut: every reader of a
    step's trees (the verify's positions and ancestor rows, the walk, each row's path tokens)
    reads only a tree's first ``num_nodes`` slots, so it gives what the cleaned selection
    (``select_trees``) gives."""
    from vllm_ddtree.ops.path_tokens import row_path_tokens
    from vllm_ddtree.ops.tree_inputs import tree_step_inputs_ref
    from vllm_ddtree.ops.tree_walk import walk_and_emit_ref

    gen = torch.Generator().manual_seed(seed)
    budget, depth, num_reqs = 24, 5, 3
    trees = build_trees(torch.randn(num_reqs, depth, 9, generator=gen) * 2, budget)
    cut = torch.tensor([5, 0, 17])
    in_place = DDTreeBatch(
        **{name: getattr(trees, name) for name in TREE_FIELDS[:-1]},
        num_nodes=torch.minimum(trees.num_nodes, cut),
        max_depth=depth,
    )
    cleaned = select_trees(trees, torch.arange(num_reqs), cut)
    num_scheduled = 1 + cut
    query_start = torch.cumsum(num_scheduled, 0) - num_scheduled
    total = int(num_scheduled.sum())
    outputs = []
    for step_trees in (in_place, cleaned):
        positions = torch.arange(total) + 50
        mask = tree_step_inputs_ref(step_trees, query_start, cut, num_scheduled, positions, total)
        chosen = torch.randint(0, 9, (total,), generator=torch.Generator().manual_seed(seed))
        walked = walk_and_emit_ref(step_trees, chosen, query_start, cut, budget + 1)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(num_scheduled, 0)])
        paths = row_path_tokens(step_trees, cu, total, depth)
        outputs.append((positions, mask, *walked, *paths))
    for got, want in zip(*outputs, strict=True):
        assert torch.equal(got, want)
