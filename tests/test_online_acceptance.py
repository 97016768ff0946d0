"""The acceptance every smaller budget would have had, from one verified tree
(vllm_ddtree/budget/acceptance.py), against trees built at those budgets and walked."""

import hashlib

import pytest
import torch

from vllm_ddtree.budget.acceptance import OnlineAcceptance, accepted_within_budgets
from vllm_ddtree.tree import build_trees, follow_tree

VOCAB, DEPTH = 5, 6


def target_token(path: tuple[int, ...], seed: int, vocab: int = VOCAB) -> int:
    """The target's token after ``path``: a function of the path alone, as at T = 0 (mostly
    token 0, which the drafters below favour, so paths run deep)."""
    digest = hashlib.sha256(repr((seed, path)).encode()).digest()
    return 0 if digest[0] < 150 else digest[1] % vocab


def target_tokens(tree, seed: int) -> torch.Tensor:
    """long ``[R, N + 1]``: ``target_token`` at every tree index (0: the root)."""
    num_reqs, width = tree.token_ids.shape
    out = torch.full((num_reqs, width + 1), -1, dtype=torch.long)
    for r in range(num_reqs):
        paths = {0: ()}
        for i in range(int(tree.num_nodes[r])):
            paths[i + 1] = paths[int(tree.parents[r, i])] + (int(tree.token_ids[r, i]),)
        for index, path in paths.items():
            out[r, index] = target_token(path, seed * 1000 + r)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_cut_tree_accepts_the_big_trees_path_nodes_within_its_budget(seed):
    """For budgets 1..48 of a tree verified at budget 48: the walk of a tree built at the
    smaller budget accepts exactly the big tree's accepted path nodes of index <= budget."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, DEPTH, VOCAB, generator=gen)
    logits[..., 0] += 2.0
    big = build_trees(logits, 48)
    accepted, num_accepted, _ = follow_tree(big, target_tokens(big, seed))
    budgets = list(range(1, 49))
    predicted = accepted_within_budgets(accepted, num_accepted, torch.tensor(budgets))
    assert int(num_accepted.max()) >= 3  # deep paths: the cut matters
    for c, budget in enumerate(budgets):
        small = build_trees(logits, budget)
        _, small_accepted, _ = follow_tree(small, target_tokens(small, seed))
        assert predicted[:, c].tolist() == small_accepted.tolist(), budget


def test_online_acceptance_learns_budgets_up_to_the_nodes_verified_and_decays():
    """A request with 8 verified nodes tells budgets 4 and 8, not 16; old steps fade."""
    tracker = OnlineAcceptance([4, 8, 16], half_life_steps=1.0, device=torch.device("cpu"))
    # Accepted tree indices 2, 5, 9 (root first): 1 within budget 4, 2 within 8, 3 within 16.
    accepted = torch.tensor([[0, 2, 5, 9, -1], [0, -1, -1, -1, -1]])
    num_accepted = torch.tensor([3, 0])
    tracker.observe(accepted, num_accepted, torch.tensor([8, 0]))
    assert tracker.snapshot() == {4: (2.0, 1.0), 8: (3.0, 1.0)}
    tracker.observe(accepted, num_accepted, torch.tensor([16, 0]))
    # Budget 8: (2 * 0.5 + 2) / (0.5 + 1) accepted per tree; budget 16 seen once.
    snapshot = tracker.snapshot()
    assert snapshot[8] == pytest.approx((1.0 + 3.0 / 1.5, 1.5))
    assert snapshot[16] == (4.0, 1.0)
    for _ in range(30):
        tracker.observe(accepted, torch.tensor([0, 0]), torch.tensor([16, 16]))
    assert tracker.snapshot()[8][0] == pytest.approx(1.0, abs=1e-6)


def test_a_snapshot_never_waits_for_the_device():
    """The engine core reads the acceptance between steps; a host read of the device's sums
    would wait for the device's whole queue (a bubble in vLLM's asynchronous schedule at every
    refresh; in the 8B scale model's split at one request, "auto"'s engine spent 0.21 ms a
    forward in ``tolist``, not among the fixed budgets' top functions,
    benchmarks/results/2026-12-03_8766111_scale-8b-splits/batch1-auto). So each step copies
    the sums to the host behind its work, and
    a snapshot reads the newest copy that finished: one step old while the newest is still
    queued. Failed before: the snapshot read the sums on the device, the newest always."""

    class PendingCopy:
        done = False

        def __init__(self):
            events.append(self)

        def record(self):
            pass

        def query(self):
            return self.done

    events: list[PendingCopy] = []
    tracker = OnlineAcceptance([4, 8], 1e9, torch.device("cpu"), copy_event=PendingCopy)
    accepted = torch.tensor([[0, 2, 5, -1]])
    assert tracker.snapshot() == {}  # nothing copied yet
    tracker.observe(accepted, torch.tensor([2]), torch.tensor([8]))
    events[-1].done = True
    assert tracker.snapshot() == {4: (2.0, 1.0), 8: (3.0, 1.0)}
    tracker.observe(accepted, torch.tensor([1]), torch.tensor([8]))  # its copy still queued
    assert tracker.snapshot() == {4: (2.0, 1.0), 8: (3.0, 1.0)}  # the last finished copy
    events[-1].done = True
    newest = tracker.snapshot()
    assert newest[4] == pytest.approx((2.0, 2.0)) and newest[8] == pytest.approx((2.5, 2.0))


def test_a_tree_searched_short_of_its_width_tells_only_the_budgets_within_its_nodes():
    """The step after "auto" widened the budget verifies a tree searched to the old width
    (``search_nodes``) in the new one: it counts for the budgets up to its nodes, not for
    the wider one it was scheduled at."""
    from types import SimpleNamespace

    from vllm_ddtree.ops.tree_build import build_draft_trees
    from vllm_ddtree.spec_decode.tree_step import TreeStep, observe_acceptance

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, DEPTH, VOCAB, generator=gen)
    logits[..., 0] += 2.0
    trees = build_draft_trees(logits, 16, None, torch.tensor([8]))  # searched to 8 of 16
    accepted, num_accepted, _ = follow_tree(trees, target_tokens(trees, 5))
    tracker = OnlineAcceptance([4, 8, 16], half_life_steps=1.0, device=torch.device("cpu"))
    step = TreeStep(
        trees=trees,
        root_row=torch.tensor([0, 17]),
        num_draft=torch.tensor([16, 16]),  # scheduled at the new width
        accepted=accepted,
        num_accepted=num_accepted,
    )
    observe_acceptance(SimpleNamespace(acceptance=tracker), step)
    assert sorted(tracker.snapshot()) == [4, 8]


def test_a_wide_budget_is_judged_on_the_trees_it_shares_with_the_narrower_ones():
    """A budget counts only the trees at least that wide: "auto" serves wide trees where few
    requests run, i.e. to a batch's last requests, which accept least (they finish last). A
    wide budget's tokens per step then comes from other requests than a narrow one's, and on
    the 8B scale model "auto"'s estimates of budgets 32 and 64 sat within 0.2 of budget 16's
    where fixed engines accepted 0.65 more with 32 (benchmarks/results/
    2026-12-04_0003f14_scale-8b-grid). So each budget is judged by its gain over the next
    narrower one on the same trees, applied to that one's estimate. Failed before: budget 8
    read 3.0 tokens per step, below budget 4's 3.5."""
    tracker = OnlineAcceptance([4, 8], half_life_steps=1e9, device=torch.device("cpu"))
    # Ten requests near their ends with trees of 8 nodes: 1 token within budget 4, 2 within 8.
    tail = torch.tensor([[0, 2, 5, -1, -1]]).repeat(10, 1)
    tracker.observe(tail, torch.full((10,), 2), torch.full((10,), 8))
    # Ten busy steps' requests with trees of 4 nodes, accepting 4 tokens each.
    busy = torch.tensor([[0, 1, 2, 3, 4]]).repeat(10, 1)
    tracker.observe(busy, torch.full((10,), 4), torch.full((10,), 4))
    snapshot = tracker.snapshot()
    assert snapshot[4] == pytest.approx((1.0 + 50 / 20, 20.0))
    # On the tail's trees budget 8 reached 3 tokens per step where budget 4 reached 2.
    assert snapshot[8] == pytest.approx((3.5 * 3.0 / 2.0, 10.0))


def test_auto_serves_the_wider_budget_its_shared_trees_show_faster():
    """The decision the estimates feed (``cost_model.choose_live_schedule``): budget 32 served
    only to low-accepting requests at their ends, budget 16 to the rest. On the trees both
    saw, 32 gave 4/3 of 16's tokens a step (3 + 1 against 2 + 1), for a step 7% longer
    here: one request gets 32."""
    from tests.test_cost_model import profile
    from vllm_ddtree.budget.cost_model import choose_live_schedule

    tracker = OnlineAcceptance([8, 16, 32], half_life_steps=1e9, device=torch.device("cpu"))
    # 20 trees of 32 nodes accepting tree indices 2, 12, 20: 1 within 8, 2 within 16, 3 in 32.
    tail = torch.tensor([[0, 2, 12, 20, -1, -1, -1]]).repeat(20, 1)
    tracker.observe(tail, torch.full((20,), 3), torch.full((20,), 32))
    # 60 trees of 16 nodes accepting 1, 2, 3, 5, 9, 14: 4 within 8, 6 within 16.
    busy = torch.tensor([[0, 1, 2, 3, 5, 9, 14]]).repeat(60, 1)
    tracker.observe(busy, torch.full((60,), 6), torch.full((60,), 16))
    live = tracker.snapshot()
    assert live[32][0] == pytest.approx(live[16][0] * 4 / 3)
    schedule, _ = choose_live_schedule(profile(2.0), live, [8, 16, 32], 1, 2048, 16.0)
    assert schedule == [(1, 1, 32)]
