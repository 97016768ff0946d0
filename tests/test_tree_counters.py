"""vLLM's speculative-decoding counters by tree depth (``metrics/spec_counters.py``): the
statistics one verified tree adds, the per-position counters an engine has, and the log line's
mean tree nodes verified."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_ddtree.config import DDTREE_ATTR, DDTreeConfig  # noqa: E402
from vllm_ddtree.metrics.spec_counters import (  # noqa: E402
    accepted_positions,
    observe_tree_step,
    tree_logging_class,
)

DDTREE = DDTreeConfig(tree_budget=32, tree_top_k=8, depth=15)


def test_a_tree_counts_its_accepted_depths_not_its_nodes():
    """A budget-32 tree reaches 15 depths at most: 15 positions, where vLLM's would be 32; a
    path of 3 counts at the first 3 depths, the tree's 32 nodes as draft tokens."""
    stats = observe_tree_step(None, DDTREE, 32, 3)
    assert len(stats.num_accepted_tokens_per_pos) == 15
    assert stats.num_accepted_tokens_per_pos[:4] == [1, 1, 1, 0]
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 32, 3)
    again = observe_tree_step(stats, DDTREE, 4, 4)  # a tree cut to 4 nodes (a schedule)
    assert again is stats and stats.num_accepted_tokens_per_pos[:5] == [2, 2, 2, 1, 0]
    assert stats.num_draft_tokens_per_pos[:5] == [2, 2, 2, 2, 1]
    # A tree whose drafts were all invalid (a grammar refused them) counts nothing.
    assert observe_tree_step(stats, DDTREE, 0, 0) is stats and stats.num_drafts == 2
    assert observe_tree_step(None, DDTREE, 0, 0) is None


def test_an_engine_has_one_acceptance_counter_per_depth_its_trees_reach():
    chain = SimpleNamespace(num_speculative_tokens=15)
    assert accepted_positions(chain) == 15  # vLLM's: one per speculative token
    tree = SimpleNamespace(num_speculative_tokens=32)
    setattr(tree, DDTREE_ATTR, DDTREE)
    assert accepted_positions(tree) == 15
    narrow = SimpleNamespace(num_speculative_tokens=4)
    setattr(narrow, DDTREE_ATTR, DDTreeConfig(tree_budget=4, tree_top_k=4, depth=15))
    assert accepted_positions(narrow) == 4


def test_the_log_line_says_the_mean_tree_nodes_verified():
    logging = tree_logging_class()()
    logging.observe(
        SimpleNamespace(
            num_drafts=4,
            num_draft_tokens=64,
            num_accepted_tokens=12,
            num_accepted_tokens_per_pos=[4, 4, 3, 1],
        )
    )
    lines = []
    logging.log(log_fn=lambda message, *args: lines.append(message % args))
    assert len(lines) == 1 and lines[0].startswith("SpecDecoding metrics")
    assert lines[0].endswith("Mean tree nodes verified: 16.0"), lines[0]
