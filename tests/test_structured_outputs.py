"""Structured outputs with trees: every tree row's grammar bitmask is the grammar after its own
node's path (vLLM's xgrammar grammar, a small raw vocabulary)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from vllm_ddtree.requests.structured_outputs import (  # noqa: E402
    REQUEST_PARENTS_ATTR,
    chain_parents,
    tree_grammar_bitmask,
)

VOCAB = ["a", "b", "c", "x", "y", "<think_end>", "<eos>"]
A, B, C, X, Y, END = range(6)
# After "a": "x" or "y"; after "b": "c"; after "x", "y" or "c": "a" or "b".
REGEX = "(a[xy]|bc)+"

# Best-first order, parents as tree indices (0 = root; node i is tree index i + 1).
#   1 a      2 b      3 c (refused at the root)
#   4 x <1   5 c <1 (refused after a)   6 c <2   7 x <2 (refused after b)
#   8 b <4   9 a <5 (under a refused node)   10 y <1
TREE_TOKENS = [A, B, C, X, C, C, X, B, A, Y]
TREE_PARENTS = [0, 0, 0, 1, 1, 2, 2, 4, 5, 1]


def new_grammar():
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[6])
    ctx = xgr.GrammarCompiler(info).compile_regex(REGEX)
    return XgrammarGrammar(vocab_size=len(VOCAB), matcher=xgr.GrammarMatcher(ctx), ctx=ctx)


def rows_along(path: list[int]) -> torch.Tensor | None:
    """The row a fresh grammar gives after ``path`` (None: it refuses the path)."""
    grammar = new_grammar()
    if path and not grammar.accept_tokens("reference", path):
        return None
    row = xgr.allocate_token_bitmask(1, len(VOCAB))
    grammar.fill_bitmask(row, 0)
    return row[0]


def path_to(index: int, tokens, parents) -> list[int]:
    path = []
    while index:
        path.append(tokens[index - 1])
        index = parents[index - 1]
    return path[::-1]


class StubManager:
    """What ``tree_grammar_bitmask`` reads of vLLM's ``StructuredOutputManager``; its
    ``_fill_bitmasks`` is vLLM's own."""

    def __init__(self, reasoner=None, rows: int = 32):
        from vllm.v1.structured_output import StructuredOutputManager

        self._grammar_bitmask = xgr.allocate_token_bitmask(rows, len(VOCAB))
        self._full_mask = torch.tensor(-1, dtype=torch.int32)
        self._fill = StructuredOutputManager._fill_bitmasks
        self.reasoner, self.enable_in_reasoning = reasoner, False
        self.vllm_config = None

    def _fill_bitmasks(self, batch):
        self._fill(self, batch)

    def should_fill_bitmask(self, request) -> bool:
        return request.reasoning_ended

    def _get_reasoner(self, request):
        return self.reasoner


def request_with(grammar, parents=None, reasoning_ended=True, history=()):
    request = SimpleNamespace(
        structured_output_request=SimpleNamespace(grammar=grammar),
        reasoning_ended=reasoning_ended,
        all_token_ids=list(history),
    )
    if parents is not None:
        setattr(request, REQUEST_PARENTS_ATTR, parents)
    return request


FULL = torch.full((1,), -1, dtype=torch.int32)


def test_each_tree_row_is_the_grammar_after_its_own_path():
    """Rows of a tree with refused nodes and a subtree under one: each reachable node's row is
    a fresh grammar's after the node's path, a refused node's (and its subtree's) allows every
    token, and the grammar is back where it started. Chain rows over the same drafts (vLLM's
    reading of drafts) differ."""
    grammar = new_grammar()
    request = request_with(grammar, TREE_PARENTS)
    manager = StubManager()
    rows = tree_grammar_bitmask(manager, {"r": request}, ["r"], {"r": TREE_TOKENS})
    assert rows.shape[0] == 1 + len(TREE_TOKENS)
    refused = {3, 5, 7, 9}
    for index in range(len(TREE_TOKENS) + 1):
        want = rows_along(path_to(index, TREE_TOKENS, TREE_PARENTS))
        if index in refused:
            assert want is None or index == 9
            assert (torch.from_numpy(rows[index]) == FULL).all(), index
        else:
            assert want is not None and torch.equal(torch.from_numpy(rows[index]), want), index
    assert grammar.num_processed_tokens == 0 and not grammar.is_terminated()
    assert grammar.validate_tokens([A, X]) == [A, X]  # still at the start

    chain = tree_grammar_bitmask(
        StubManager(), {"r": request_with(grammar)}, ["r"], {"r": TREE_TOKENS}
    )
    assert not (chain == rows).all()


def test_a_request_without_parents_reads_its_drafts_as_a_chain():
    grammar = new_grammar()
    drafts = [A, X, B, C]
    rows = tree_grammar_bitmask(StubManager(), {"r": request_with(grammar)}, ["r"], {"r": drafts})
    for i in range(len(drafts) + 1):
        assert torch.equal(torch.from_numpy(rows[i]), rows_along(drafts[:i]))
    assert chain_parents(3) == [0, 1, 2]


def test_rows_of_several_requests_follow_one_another():
    first, second = new_grammar(), new_grammar()
    second.accept_tokens("r2", [B])  # the second request has committed "b"
    requests = {
        "r1": request_with(first, [0, 1]),
        "r2": request_with(second, [0, 0]),
    }
    scheduled = {"r1": [A, Y], "r2": [C, A]}
    rows = tree_grammar_bitmask(StubManager(), requests, ["r1", "r2"], scheduled)
    assert rows.shape[0] == 3 + 3
    assert torch.equal(torch.from_numpy(rows[2]), rows_along([A, Y]))
    assert torch.equal(torch.from_numpy(rows[3]), rows_along([B]))
    assert torch.equal(torch.from_numpy(rows[4]), rows_along([B, C]))
    assert (torch.from_numpy(rows[5]) == FULL).all()  # "a" after "b": refused


class MarkerReasoner:
    """Reasoning ends at the token ``END``."""

    def is_reasoning_end_streaming(self, input_ids, delta_ids) -> bool:
        return END in delta_ids


def test_while_reasoning_a_path_is_constrained_after_its_end_marker():
    """A request still reasoning: rows stay unconstrained until the node's path holds the end
    marker; from the marker on, the grammar starts (the marker itself is not advanced)."""
    #   1 a   2 <think_end>   3 <think_end> <1   4 a <2   5 c <2 (refused)   6 x <4
    tokens = [A, END, END, A, C, X]
    parents = [0, 0, 1, 2, 2, 4]
    grammar = new_grammar()
    request = request_with(grammar, parents, reasoning_ended=False, history=[B, B])
    manager = StubManager(reasoner=MarkerReasoner())
    rows = tree_grammar_bitmask(manager, {"r": request}, ["r"], {"r": tokens})
    full = [0, 1, 5]
    for index in full:
        assert (torch.from_numpy(rows[index]) == FULL).all(), index
    assert torch.equal(torch.from_numpy(rows[2]), rows_along([]))
    assert torch.equal(torch.from_numpy(rows[3]), rows_along([]))
    assert torch.equal(torch.from_numpy(rows[4]), rows_along([A]))
    assert torch.equal(torch.from_numpy(rows[6]), rows_along([A, X]))
    assert grammar.num_processed_tokens == 0
