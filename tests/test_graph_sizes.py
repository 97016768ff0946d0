"""CUDA-graph sizes for tree verifies (``vllm_ddtree.graph_sizes``) through vLLM 0.26.0's own
size rule and graph managers on stand-in configs (``tests/vllm_graphs.py``): no engine, no GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm_graphs import (  # noqa: E402
    vllm_default_sizes,
    vllm_v1_verify_modes,
    vllm_v2_verify_modes,
)
from vllm_ddtree.graph_sizes import (  # noqa: E402
    has_full_graph,
    largest_graph_for,
    schedule_within_graphs,
    verify_graph_sizes,
)


def test_the_largest_graph_holds_the_whole_verify_batch_up_to_the_cap():
    """vLLM's own rule (twice the batch of ``1 + budget`` tokens, at most 512) raised to the
    whole verify batch, rounded up to 16 tokens, capped at ``VERIFY_GRAPH_TOKENS``; the
    drafter's width where the tree is narrower than the drafter is deep."""
    assert largest_graph_for(16, 32, 15) == 528  # 16 x 33, past vLLM's 512
    assert largest_graph_for(1, 64, 15) == 130  # vLLM's own: 2 x 65
    assert largest_graph_for(64, 64, 15) == 2048  # 64 x 65, capped
    assert largest_graph_for(4, 4, 15) == 128  # the drafter's 16 tokens a request


def test_a_full_graph_is_a_size_between_one_batch_fewer_and_the_batch():
    sizes = [8, 16, 24, 32]
    assert has_full_graph(sizes, 9, 1) and has_full_graph(sizes, 9, 3)
    assert not has_full_graph(sizes, 9, 4)  # 36 tokens: past the largest
    assert not has_full_graph([8, 32], 9, 2)  # nothing in (9, 18]


def test_the_users_sizes_get_the_largest_budget_whose_verify_has_a_full_graph():
    """With the user's sizes, each batch size verifies its scheduled budget where a FULL graph
    holds it, else the largest smaller budget (of the schedule or "auto"'s candidates) that one
    holds, else none."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48]
    # Two trees of 32 (66 tokens) pass the largest graph: budget 16 (2 x 17) fits.
    assert schedule_within_graphs(None, 32, sizes, 2) == [(1, 1, 32), (2, 2, 16)]
    # A schedule's entries stand where they fit.
    schedule = [[1, 2, 16], [3, 4, 8]]
    assert schedule_within_graphs(schedule, 16, sizes, 4) == [(1, 2, 16), (3, 4, 8)]
    # Four trees of 8 (36 tokens) past a largest graph of 32, no smaller candidate: no drafts.
    assert schedule_within_graphs(None, 8, sizes[:7], 4) == [(1, 3, 8), (4, 4, 0)]


def test_vllms_default_sizes_leave_sixteen_trees_of_budget_32_without_a_full_graph():
    """What the plugin's sizing is for, on both runners' dispatch: with vLLM's own default
    sizes (at most 512 tokens) the verify of 16 trees of budget 32 (528 tokens) has no graph."""
    sizes = vllm_default_sizes(16, 32)
    for modes in (vllm_v2_verify_modes(sizes, 16, 33), vllm_v1_verify_modes(sizes, 16, 33)):
        assert modes[15] == "FULL" and modes[16] == "NONE", modes


@pytest.mark.parametrize("budget", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("max_num_seqs", [1, 4, 16, 64, 256])
def test_with_vllms_default_graph_sizes_every_verify_batch_of_a_wide_tree_has_a_full_graph(
    budget, max_num_seqs
):
    """An engine without chosen graph sizes gets vLLM's defaults (steps of 8, then 16 tokens):
    for a tree of budget 16 and up (verify width 17 and up) every uniform verify batch within
    the largest graph has a FULL graph in vLLM's V2 manager (its own ``dispatch``), unlike the
    bench's ladder of ea98718. Narrower trees (budgets 4 and 8) leave some batch sizes
    piecewise there, which the plugin's sizes fill (the test after this one)."""
    sizes = vllm_default_sizes(max_num_seqs=max_num_seqs, num_speculative_tokens=budget)
    modes = vllm_v2_verify_modes(sizes, max_num_seqs, 1 + budget)
    within = {b: mode for b, mode in modes.items() if b * (1 + budget) <= max(sizes)}
    assert within and set(within.values()) == {"FULL"}, within


@pytest.mark.parametrize(
    "max_num_seqs,budget", [(4, 4), (16, 4), (64, 4), (64, 8), (256, 8), (64, 16)]
)
def test_narrow_trees_get_a_full_graph_at_every_batch_size_on_v2(max_num_seqs, budget):
    """vLLM's default sizes step by 8 tokens, then 16: a verify width below 16 can fall between
    two sizes, and vLLM's V2 graph manager then has no FULL graph for that batch (budget 4 at
    3 requests; budget 8 from 30 requests up). The plugin adds ``requests x width`` for each
    such batch, so every uniform verify batch within the largest graph lands on a FULL graph
    (vLLM's own ``_init_candidates`` and ``dispatch``); widths of 17 and more add nothing."""
    width = 1 + budget
    defaults = vllm_default_sizes(max_num_seqs, budget, largest_graph_for(max_num_seqs, budget, 15))

    def holes(sizes):
        modes = vllm_v2_verify_modes(sizes, max_num_seqs, width)
        return [b for b, mode in modes.items() if mode != "FULL" and b * width <= max(sizes)]

    sizes = verify_graph_sizes(defaults, [width], max_num_seqs)
    assert holes(sizes) == []
    assert set(defaults) <= set(sizes) and max(sizes) == max(defaults)
    added = sorted(set(sizes) - set(defaults))
    assert all(size % width == 0 for size in added)
    if budget < 16 and max_num_seqs > 4:
        assert holes(defaults) and added  # what the added sizes are for
    if budget >= 16:
        assert added == []
