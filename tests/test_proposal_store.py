"""``ProposalStore`` (the V2 runner's proposals between steps): whatever rows each step comes
with, the trees it verifies are each request's latest proposal cut to its scheduled nodes,
whether taken from the drafter's rows as they are (steady steps) or selected from the
per-request copies."""

import numpy as np
import pytest
import torch

from vllm_ddtree.proposal_store import TREE_FIELDS, ProposalStore
from vllm_ddtree.tree import DDTreeBatch, build_trees, empty_batch, select_trees

BUDGET, DEPTH, VOCAB, SLOTS = 5, 3, 30, 6


def propose(store: ProposalStore, rows: list[int], gen: torch.Generator) -> dict:
    """One drafter run for request states ``rows`` as the V2 speculator does it (flush, write
    the batch rows, record them); returns each state's new tree (a copy)."""
    trees = build_trees(torch.randn(len(rows), DEPTH, VOCAB, generator=gen) * 3, BUDGET)
    store.flush()
    store.write_batch(trees)
    store.proposed(np.array(rows), torch.tensor(rows, dtype=torch.int32))
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
        trees = store.step_trees(
            np.array(rows),
            torch.tensor(rows, dtype=torch.int32),
            np.array(num_draft),
            torch.tensor(num_draft),
        )
        steady_steps += trees.token_ids.data_ptr() == store.batch.token_ids.data_ptr()
        want = expected(latest, rows, num_draft)
        for name in TREE_FIELDS:
            got, ref = getattr(trees, name), getattr(want, name)
            drafted = torch.tensor(num_draft) > 0  # rows without drafts verify no tree
            assert torch.equal(got[drafted], ref[drafted]), (schedule, rows, name)
        if pending is not None and list(pending) == rows and set(num_draft) == {BUDGET}:
            assert trees.token_ids.data_ptr() == store.batch.token_ids.data_ptr()
        latest.update(propose(store, rows, gen))
    if schedule == "steady":
        assert steady_steps == len(steps), "steady steps verify the drafter's rows in place"


def test_proposed_without_a_flush_is_refused():
    gen = torch.Generator().manual_seed(1)
    store = ProposalStore(SLOTS, BUDGET, DEPTH, torch.device("cpu"))
    propose(store, [0], gen)
    with pytest.raises(AssertionError, match="flush"):
        store.proposed(np.array([0]), torch.tensor([0]))
