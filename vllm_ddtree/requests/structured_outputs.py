"""Structured outputs with trees: each tree row's grammar bitmask comes from its own node's path.

vLLM's ``StructuredOutputManager`` fills a request's ``1 + k`` bitmask rows along its drafts as
one chain: row ``i`` holds the grammar's allowed tokens after drafts ``0 .. i - 1``, and the
scheduler first drops drafts from the first one the grammar refuses as a chain. A tree's drafts
are its nodes in best-first order (node ``i`` is tree row ``i + 1``), each with a parent (a
tree index, 0 = the root), so row ``i`` must be the grammar after the tokens on the path from
the root to tree index ``i``. The rows keep vLLM's layout; only their content follows the tree:

* the model runner hands the nodes' parents to the scheduler beside their tokens
  (``TREE_PARENTS_ATTR`` on vLLM's ``DraftTokenIds``; ``ParentsToHost`` copies them);
* the scheduler keeps a tree's nodes whole (no chain check) and the parents on the request
  (``keep_tree_drafts``);
* ``fill_tree_rows`` fills each request's rows by one walk of its tree: accept a node's token
  on the way down, roll it back on the way up. A node whose token its parent's row does not
  allow gets an unconstrained row, as does its subtree: the walk never reaches it, since the
  target's token at the parent's row is masked by that row.

Reasoning models keep vLLM's rule per path: rows stay unconstrained until the path holds the
reasoning parser's end marker, and the grammar starts after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

# The nodes' parents on vLLM's DraftTokenIds (worker -> scheduler): one list per request, the
# tree index of each node's parent (0 = the root), aligned with its draft tokens.
TREE_PARENTS_ATTR = "ddtree_tree_parents"
# A request's parents of its current drafts, kept by the scheduler for its grammar bitmask.
REQUEST_PARENTS_ATTR = "_ddtree_tree_parents"


def chain_parents(num_nodes: int) -> list[int]:
    """The parents of a chain of ``num_nodes`` drafts: node ``i`` hangs under tree index
    ``i``."""
    return list(range(num_nodes))


def allows(row: torch.Tensor, token: int) -> bool:
    """Whether a packed bitmask row (int32 words, bit ``t % 32`` of word ``t // 32``) allows
    ``token``."""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def fill_tree_rows(
    grammar,
    fill_row: Callable[[int, bool], None],
    read_row: Callable[[int], torch.Tensor],
    tokens: Sequence[int],
    parents: Sequence[int],
    constrained: bool,
    reasoning_ends: Callable[[list[int]], bool] | None = None,
) -> None:
    """Fill the ``1 + len(tokens)`` rows of one request's tree.

    Args:
        grammar: the request's ``StructuredOutputGrammar`` at the committed tokens; it is
            returned there (every token accepted on the walk is rolled back).
        fill_row: ``fill_row(i, constrained)`` fills row ``i`` from the grammar's state
            (``constrained``) or allows every token.
        read_row: row ``i`` as filled.
        tokens, parents: the nodes' tokens (-1: none) and parents' tree indices.
        constrained: whether the root row is constrained (vLLM's ``should_fill_bitmask``).
        reasoning_ends: for a request still reasoning, ``reasoning_ends(path)``: whether the
            last token of ``path`` (the node's tokens from the root) ends the reasoning.
    """
    num_nodes = len(tokens)
    children: list[list[int]] = [[] for _ in range(num_nodes + 1)]
    for node, parent in enumerate(parents[:num_nodes]):
        children[parent].append(node + 1)
    fill_row(0, constrained)

    def unconstrained(index: int) -> None:
        fill_row(index, False)
        for child in children[index]:
            unconstrained(child)

    def visit(index: int, parent_constrained: bool, path: list[int]) -> None:
        token = tokens[index - 1]
        if token < 0:
            unconstrained(index)
            return
        path = path + [token]
        here = parent_constrained
        advanced = False
        if not parent_constrained:
            # Still reasoning on this path: the grammar starts after the end marker.
            here = reasoning_ends is not None and reasoning_ends(path)
        elif not grammar.is_terminated():
            if not allows(read_row(parents[index - 1]), token) or not (
                grammar.accept_tokens("ddtree-tree-walk", [token])
            ):
                unconstrained(index)
                return
            advanced = True
        fill_row(index, here)
        for child in children[index]:
            visit(child, here, path)
        if advanced:
            grammar.rollback(1)

    for child in children[0]:
        visit(child, constrained, [])


def tree_grammar_bitmask(
    manager, requests: dict, structured_output_request_ids: list[str], scheduled: dict
) -> np.ndarray:
    """``StructuredOutputManager.grammar_bitmask`` for a DDTree engine: the rows of each
    request in ``structured_output_request_ids`` (``1 + its scheduled drafts``, vLLM's layout)
    by ``fill_tree_rows`` over the request's tree (a chain when it has no parents)."""
    if manager._grammar_bitmask is None:
        max_rows = manager.vllm_config.scheduler_config.max_num_seqs * (
            1 + manager.vllm_config.num_speculative_tokens
        )
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(max_rows)
    bitmask = manager._grammar_bitmask
    base = 0
    for req_id in structured_output_request_ids:
        request = requests[req_id]
        grammar = request.structured_output_request.grammar
        tokens = list(scheduled.get(req_id, ()))
        parents = getattr(request, REQUEST_PARENTS_ATTR, None)
        if parents is None or len(parents) < len(tokens):
            parents = chain_parents(len(tokens))
        constrained = manager.should_fill_bitmask(request)
        reasoning_ends = None
        reasoner = manager._get_reasoner(request)
        if not constrained and reasoner is not None and not manager.enable_in_reasoning:
            reasoning_ends = _reasoning_end_test(reasoner, list(request.all_token_ids))

        def fill_row(index, apply, base=base, grammar=grammar):
            manager._fill_bitmasks(((grammar, base + index, apply),))

        def read_row(index, base=base):
            return bitmask[base + index]

        fill_tree_rows(grammar, fill_row, read_row, tokens, parents, constrained, reasoning_ends)
        base += 1 + len(tokens)
    return bitmask[:base].numpy()


def _reasoning_end_test(reasoner, history: list[int]) -> Callable[[list[int]], bool]:
    """vLLM's in-window test, per path: does the path's last token end the reasoning?"""

    def reasoning_ends(path: list[int]) -> bool:
        return bool(reasoner.is_reasoning_end_streaming(history + path, path[-1:]))

    return reasoning_ends


def keep_tree_drafts(request, tokens: list[int], parents: list[int]) -> list[int]:
    """The scheduler takes a tree request's drafts: all its nodes (vLLM's check would cut
    them as a chain), its parents kept for its grammar bitmask. Returns the tokens."""
    setattr(request, REQUEST_PARENTS_ATTR, list(parents[: len(tokens)]))
    return tokens


class ParentsToHost:
    """Model runner side: the parents of the trees just proposed, copied to the host when vLLM
    copies their tokens (a non-blocking copy on vLLM's draft-copy stream on CUDA), handed over
    with them by ``take``."""

    def __init__(self):
        self._parents: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._event = None

    def start(self, parents: torch.Tensor, copy_stream=None) -> None:
        """Begin the copy of ``parents`` long ``[R, k]``."""
        if parents.device.type != "cuda":
            self._parents, self._event = parents, None
            return
        if (
            self._host is None
            or self._host.shape[0] < parents.shape[0]
            or (self._host.shape[1] < parents.shape[1])
        ):
            self._host = torch.empty(parents.shape, dtype=parents.dtype, pin_memory=True)
            self._event = torch.cuda.Event()
        rows, width = parents.shape
        stream = copy_stream or torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._host[:rows, :width].copy_(parents, non_blocking=True)
            self._event.record()
        self._parents = parents

    def take(self, num_reqs: int) -> list[list[int]] | None:
        """The parents of the last ``start`` for its first ``num_reqs`` requests (None: none)."""
        parents = self._parents
        if parents is None:
            return None
        if parents.device.type != "cuda":
            return parents[:num_reqs].tolist()
        self._event.synchronize()
        return self._host[:num_reqs, : parents.shape[1]].tolist()

    def clear(self) -> None:
        self._parents = None


def with_tree_parents(taken, parents_to_host: ParentsToHost):
    """vLLM's ``DraftTokenIds`` (``taken``; None: none) with the parents of the trees just
    proposed attached (``TREE_PARENTS_ATTR``), when they were copied for it."""
    if taken is None:
        return None
    parents = parents_to_host.take(len(taken.req_ids))
    if parents is not None:
        setattr(taken, TREE_PARENTS_ATTR, parents)
    return taken


def restore_tree_drafts(scheduler, draft_token_ids, drafts_of) -> None:
    """After vLLM's chain check of ``draft_token_ids``: each structured-output request whose
    drafts are a tree gets all its nodes back (``drafts_of(request, tokens)`` stores them) and
    its parents; a request whose drafts carry no parents loses any it had."""
    parents = getattr(draft_token_ids, TREE_PARENTS_ATTR, None)
    for row, (req_id, tokens) in enumerate(
        zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True)
    ):
        request = scheduler.requests.get(req_id)
        if request is None or request.is_finished() or request.is_prefill_chunk:
            continue
        if parents is None:
            if hasattr(request, REQUEST_PARENTS_ATTR):
                delattr(request, REQUEST_PARENTS_ATTR)
            continue
        if request.use_structured_output:
            drafts_of(request, keep_tree_drafts(request, list(tokens), parents[row]))


def after_update_draft_token_ids(scheduler, draft_token_ids) -> None:
    """At the end of the scheduler's ``update_draft_token_ids`` (synchronous scheduling) in a
    DDTree engine: the trees of structured-output requests kept whole."""

    def store(request, tokens):
        request.spec_token_ids = tokens

    restore_tree_drafts(scheduler, draft_token_ids, store)


def after_update_draft_token_ids_in_output(scheduler, draft_token_ids, scheduler_output) -> None:
    """At the end of the scheduler's ``update_draft_token_ids_in_output`` (asynchronous
    scheduling: the drafts of a step whose grammar bitmask waited for them) in a DDTree
    engine: the scheduled trees of structured-output requests kept whole."""
    scheduled = scheduler_output.scheduled_spec_decode_tokens
    invalid = scheduler_output.num_invalid_spec_tokens

    def store(request, tokens):
        req_id = request.request_id
        if scheduled.get(req_id):  # vLLM trimmed the list to the scheduled drafts
            scheduled[req_id] = tokens[: len(scheduled[req_id])]
            if invalid:
                invalid.pop(req_id, None)

    restore_tree_drafts(scheduler, draft_token_ids, store)
