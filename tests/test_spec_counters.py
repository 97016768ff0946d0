"""The scheduler's speculative-decoding counters of a DDTree engine (metrics/spec_counters.py,
through the plugin's wrapper), against stand-ins for vLLM's scheduler."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_ddtree.compat.metrics_hooks import _wrap_make_spec_decoding_stats  # noqa: E402
from vllm_ddtree.config import DDTreeConfig  # noqa: E402


def ddtree_scheduler():
    speculative_config = SimpleNamespace(
        ddtree_config=DDTreeConfig(tree_budget=8, tree_top_k=8, depth=15)
    )
    return SimpleNamespace(
        vllm_config=SimpleNamespace(speculative_config=speculative_config), log_stats=True
    )


def vllms(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
          num_invalid_spec_tokens, request_id):  # fmt: skip
    raise AssertionError("a DDTree engine counts its trees itself")


def test_a_request_whose_drafts_were_all_invalid_keeps_the_others_counts():
    make = _wrap_make_spec_decoding_stats(vllms)
    scheduler = ddtree_scheduler()
    stats = make(scheduler, None, 8, 3, None, "a")
    assert stats.num_drafts == 1 and stats.num_accepted_tokens == 3
    invalid = {"b": 8}  # request b's 8 drafts were all invalid (a grammar refused them)
    after = make(scheduler, stats, 8, 0, invalid, "b")
    assert after is stats and stats.num_drafts == 1 and stats.num_draft_tokens == 8
    assert make(scheduler, None, 8, 0, invalid, "b") is None  # nothing counted yet
