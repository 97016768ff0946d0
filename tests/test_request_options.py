"""A request's own DDTree options: their checked values, the
scheduler's cut of its draft tokens, and its tree statistics."""

from types import SimpleNamespace

import pytest

from vllm_ddtree.config import DDTreeConfigError
from vllm_ddtree.requests.options import (
    RequestStatsBook,
    RequestTreeStats,
    cap_request_budgets,
    check_request_options,
    request_tree_budget,
    wants_tree_stats,
)


def params(**extra):
    return SimpleNamespace(extra_args=extra or None)


@pytest.mark.parametrize(
    "extra, want",
    [
        ({}, None),
        ({"tree_budget": "auto"}, None),
        ({"tree_budget": 3}, 3),
        ({"tree_budget": 8}, None),
    ],
)
def test_a_request_budget_below_the_engines_caps_it(extra, want):
    assert request_tree_budget(params(**extra), engine_budget=8) == want


@pytest.mark.parametrize("value", [0, -1, 9, "4", 4.0, True, [4]])
def test_a_request_budget_outside_the_allowed_values_is_refused_naming_them(value):
    with pytest.raises(DDTreeConfigError) as refused:
        check_request_options(params(tree_budget=value), engine_budget=8)
    message = str(refused.value)
    assert "extra_args['tree_budget']" in message and "1..8" in message and "'auto'" in message


def test_tree_stats_are_asked_for_with_a_bool_as_the_openai_server_passes_it():
    """``vllm_xargs`` has no booleans: the server turns JSON ``true`` into 1."""
    assert wants_tree_stats(params()) is False
    for value, want in ((True, True), (1, True), ("true", True), (0, False), ("False", False)):
        assert wants_tree_stats(params(ddtree_stats=value)) is want
    for value in ("yes", 2, 1.0):
        with pytest.raises(DDTreeConfigError, match="ddtree_stats.*true or false"):
            check_request_options(params(ddtree_stats=value), engine_budget=8)


def test_the_openai_servers_xargs_arrive_as_allowed_values():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = CompletionRequest(
        model="m", prompt="x", vllm_xargs={"tree_budget": 16, "ddtree_stats": True}
    )
    extra = SimpleNamespace(extra_args=request.to_sampling_params(16, None).extra_args)
    assert request_tree_budget(extra, engine_budget=32) == 16
    assert wants_tree_stats(extra) is True


def test_the_scheduler_keeps_each_requests_first_draft_tokens_only():
    placeholders = [-1] * 8  # async scheduling shares one list among requests
    requests = [
        SimpleNamespace(sampling_params=params(tree_budget=3), spec_token_ids=placeholders),
        SimpleNamespace(sampling_params=params(tree_budget="auto"), spec_token_ids=placeholders),
        SimpleNamespace(sampling_params=None, spec_token_ids=placeholders),  # a pooling request
        SimpleNamespace(sampling_params=params(tree_budget=2), spec_token_ids=[7, 8, 9]),
        SimpleNamespace(sampling_params=params(tree_budget=5), spec_token_ids=[7, 8]),
    ]
    cap_request_budgets(requests)
    assert [len(r.spec_token_ids) for r in requests] == [3, 8, 8, 2, 2]
    assert requests[3].spec_token_ids == [7, 8]
    assert placeholders == [-1] * 8 and requests[1].spec_token_ids is placeholders


def test_request_stats_count_verify_steps_nodes_and_acceptance():
    stats = RequestTreeStats()
    stats.observe(8, 3)
    stats.observe(0, 0)  # a step without drafts is no verify step
    stats.observe(5, 1)
    assert (stats.verify_steps, stats.nodes, stats.max_nodes, stats.accepted) == (2, 13, 8, 4)
    assert stats.acceptance_length == pytest.approx(3.0)
    assert "2 verify steps, 13 tree nodes verified (at most 8 in a step)" in stats.describe()
    book = RequestStatsBook()
    book.observe("a", 4, 2)
    book.observe("a", 4, 4)
    book.observe("b", 2, 0)
    assert book.finish("a").accepted == 6
    assert book.finish("a") is None and len(book) == 1


def test_an_engine_serving_the_chain_takes_any_request_budget_from_1():
    """ "auto" chose vLLM's DFlash chain: a request's budget is any int >= 1 (it caps the
    chain's draft tokens)."""
    for value in (1, 64, "auto"):
        check_request_options(params(tree_budget=value), engine_budget=None)
    with pytest.raises(DDTreeConfigError, match=r"int >= 1 \(this engine serves the DFlash"):
        check_request_options(params(tree_budget=-5), engine_budget=None)
