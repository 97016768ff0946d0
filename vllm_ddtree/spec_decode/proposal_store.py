"""Where DDTree proposals wait for their verify step: ``ProposalStore`` for the V2 runner
(``v2_hooks.py``), ``RequestTrees`` for the V1 runner (``v1_hooks.py``).

A proposal is good for one step: the request's next scheduled one. Any scheduled step takes it
(``take``), whether that step verifies it or not, so a request the drafter skipped (vLLM then
schedules zeros as drafts), a request padded into a speculative row without ever being drafted
for (``pad_spec_decode``: drafts of -1) and a request that reuses a finished one's slot verify
no tree, and decode plainly; a request the token budget left out of a step keeps its tree.

The drafter writes one tree per batch row inside its CUDA graph (``batch``); a request's next
step may come with other rows (requests joined, left or were not scheduled), so the trees are
looked up by vLLM's request-state index (``state``). Copying every proposal into ``state``
and selecting it back costs ~20 small launches per step on the host, the part of a small
model's step that the GPU waits for. Most steps need neither: when the next step has exactly
the proposal's rows, it verifies ``batch`` as it is, each tree cut to its scheduled nodes by
its node count alone (one launch; a per-batch-size schedule or a request's own budget
schedules fewer nodes than the drafter proposed: the first ``b`` nodes of a best-first tree
are the best-first tree of budget ``b``, and every reader of a tree reads only its first
``num_nodes`` slots). Otherwise the pending proposal is first copied into ``state`` (once,
lazily) and the step's trees are selected from there, cut to the scheduled nodes.

V2: Invariant: a request's latest proposal is in ``batch`` (while pending) or in ``state``. A
steady step consumes every pending row (same rows), so nothing pending is lost; every drafter
run, real or dummy, overwrites ``batch``, so ``flush`` comes first.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ddtree.tree import DDTreeBatch, empty_batch, select_trees

NO_OWNER = ""  # a request-state row whose proposal was taken (or never made)

TREE_FIELDS = ("token_ids", "parents", "depths", "scores", "num_nodes")


class ProposalStore:
    """Per-batch-row and per-request-state trees ``[rows, budget]`` of the last proposals."""

    def __init__(self, rows: int, tree_budget: int, depth: int, device: torch.device):
        self.tree_budget = tree_budget
        self.batch = empty_batch(rows, tree_budget, depth, device)  # written by the drafter
        self.state = empty_batch(rows, tree_budget, depth, device)
        self._pending_rows: np.ndarray | None = None  # request states of ``batch``'s rows
        self._pending_index: torch.Tensor | None = None  # the same, long [R] on the device
        # The request each state's untaken proposal was made for (host; NO_OWNER: none).
        self._owner = np.full(rows, NO_OWNER, dtype=object)

    def write_batch(self, trees: DDTreeBatch) -> None:
        """The drafter's trees ``[R, budget]`` into ``batch`` rows ``0..R-1`` (no host work
        beyond the launches; runs inside the drafter's CUDA graph)."""
        num_reqs = trees.token_ids.shape[0]
        for name in TREE_FIELDS:
            getattr(self.batch, name)[:num_reqs].copy_(getattr(trees, name))

    def proposed(self, rows: np.ndarray, index: torch.Tensor, req_ids: list[str]) -> None:
        """After a real drafter run: ``batch``'s first ``len(rows)`` rows now hold the trees of
        request states ``rows`` (host ints; ``index`` the same on the device, int [R]), made
        for requests ``req_ids``. The caller flushed before the run."""
        assert self._pending_rows is None, "flush() before the drafter overwrites the batch"
        self._owner[np.asarray(rows)] = np.array(list(req_ids), dtype=object)
        self._pending_rows = np.array(rows, dtype=np.int64)
        self._pending_index = index.to(torch.long, copy=True)  # one launch, a stable copy

    def flush(self) -> None:
        """Copy the pending proposal into ``state`` (before anything overwrites ``batch``)."""
        if self._pending_rows is None:
            return
        num_reqs = len(self._pending_rows)
        for name in TREE_FIELDS:
            source = getattr(self.batch, name)[:num_reqs]
            getattr(self.state, name).index_copy_(0, self._pending_index, source)
        self._pending_rows = self._pending_index = None

    def take(self, rows: np.ndarray, req_ids: list[str]) -> np.ndarray:
        """Every scheduled step, for all its requests (states ``rows``, ids ``req_ids``):
        bool ``[R]``, whether each has an untaken proposal made for it; they are taken."""
        rows = np.asarray(rows)
        has_tree = self._owner[rows] == np.array(list(req_ids), dtype=object)
        self._owner[rows] = NO_OWNER
        return has_tree.astype(bool)

    def step_trees(
        self,
        rows: np.ndarray,
        index: torch.Tensor,
        num_nodes_np: np.ndarray,
        num_nodes: torch.Tensor,
    ) -> DDTreeBatch:
        """The trees this step verifies, ``[R, budget]`` for request states ``rows`` (host;
        ``index`` the same on the device), each cut to ``num_nodes`` nodes (host and device
        long ``[R]``: its scheduled drafts if ``take`` found its proposal, else 0). Views of
        ``batch`` on a steady step (the proposal's rows; valid until the next drafter run; the
        slots past a cut tree's nodes keep the drafted ones), else a selection from
        ``state``."""
        pending = self._pending_rows
        steady = (
            pending is not None
            and len(pending) == len(rows)
            and bool(np.array_equal(pending, rows))
        )
        if steady:
            self._pending_rows = self._pending_index = None  # consumed
            num_reqs = len(rows)
            views = {name: getattr(self.batch, name)[:num_reqs] for name in TREE_FIELDS}
            if not bool((num_nodes_np == self.tree_budget).all()):
                views["num_nodes"] = torch.minimum(views["num_nodes"], num_nodes)
            return DDTreeBatch(**views, max_depth=self.batch.max_depth)
        self.flush()
        return select_trees(self.state, index.long(), num_nodes)


class RequestTrees:
    """V1 runner: each request's untaken proposal, by request id (the drafter's trees stay on
    the device; a steady step verifies the last proposal's tensors as they are)."""

    def __init__(self, tree_budget: int, depth: int):
        self.tree_budget, self.depth = tree_budget, depth
        self._latest: dict[str, tuple[DDTreeBatch, int]] = {}  # request -> (trees, row)

    def proposed(self, req_ids: list[str], trees: DDTreeBatch) -> None:
        for row, req_id in enumerate(req_ids):
            self._latest[req_id] = (trees, row)

    def forget_all_but(self, live) -> None:
        """Drop the proposals of requests not in ``live`` (finished or aborted ones)."""
        for req_id in [r for r in self._latest if r not in live]:
            del self._latest[req_id]

    def take(self, req_ids: list[str], num_draft: np.ndarray | None = None) -> TakenTrees:
        """Every scheduled step, for all its requests (``num_draft``: their scheduled drafts,
        long ``[R]``; None: none): take their proposals (see the module docstring)."""
        entries = [self._latest.pop(req_id, None) for req_id in req_ids]
        if num_draft is None:
            num_draft = np.zeros(len(req_ids), dtype=np.int64)
        sources: list[DDTreeBatch] = []
        offsets: dict[int, int] = {}
        source = np.full(len(req_ids), -1, dtype=np.int64)
        for r, entry in enumerate(entries):
            if entry is None or num_draft[r] <= 0:
                continue
            trees, row = entry
            if id(trees) not in offsets:
                offsets[id(trees)] = sum(t.num_requests for t in sources)
                sources.append(trees)
            source[r] = offsets[id(trees)] + row
        num_nodes = np.where(source >= 0, num_draft, 0)
        return TakenTrees(sources, source, num_nodes, self.tree_budget, self.depth)


class TakenTrees:
    """The proposals one V1 step verifies: ``sources`` (the proposals they come from),
    ``source`` long ``[R]`` (each request's row in them, stacked; -1: no tree) and
    ``num_nodes`` long ``[R]`` (the nodes to verify: its scheduled drafts, or 0), host side."""

    def __init__(
        self,
        sources: list[DDTreeBatch],
        source: np.ndarray,
        num_nodes: np.ndarray,
        tree_budget: int,
        depth: int,
    ):
        self.sources, self.source, self.num_nodes = sources, source, num_nodes
        self.tree_budget, self.depth = tree_budget, depth

    def trees(self, source: torch.Tensor, num_nodes: torch.Tensor) -> DDTreeBatch:
        """``[R, budget]`` trees (``source``, ``num_nodes``: the same tables on the device)."""
        num_reqs, tree_budget = len(self.source), self.tree_budget
        if not self.sources:
            return empty_batch(num_reqs, tree_budget, self.depth, source.device)
        if len(self.sources) == 1:
            stacked = self.sources[0]
            steady = (
                stacked.num_requests == num_reqs
                and bool((self.source == np.arange(num_reqs)).all())
                and bool((self.num_nodes == tree_budget).all())
            )
            if steady:  # the last proposal's rows, each tree whole: nothing to move or cut
                return stacked
        else:  # a request left out of earlier steps came back: its older proposal too
            fields = {name: [getattr(t, name) for t in self.sources] for name in TREE_FIELDS}
            stacked = DDTreeBatch(
                **{name: torch.cat(parts) for name, parts in fields.items()},
                max_depth=self.sources[0].max_depth,
            )
        return select_trees(stacked, source.clamp(min=0), num_nodes)
