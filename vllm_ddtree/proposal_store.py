"""Where the V2 runner's DDTree proposals wait for their verify step (``runner_v2.py``).

The drafter writes one tree per batch row inside its CUDA graph (``batch``); a request's next
step may come with other rows (requests joined, left or were not scheduled), so the trees are
looked up by vLLM's request-state index (``state``). Copying every proposal into ``state``
and selecting it back costs ~20 small launches per step on the host, the part of a small
model's step that the GPU waits for. Most steps need neither: when the next step has exactly
the proposal's rows, each with its whole tree scheduled, it verifies ``batch`` as it is.
Otherwise the pending proposal is first copied into ``state`` (once, lazily) and the step's
trees are selected from there, cut to the scheduled nodes.

Invariant: a request's latest proposal is in ``batch`` (while pending) or in ``state``. A
steady step consumes every pending row (same rows), so nothing pending is lost; every drafter
run, real or dummy, overwrites ``batch``, so ``flush`` comes first.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ddtree.tree import DDTreeBatch, empty_batch, select_trees

TREE_FIELDS = ("token_ids", "parents", "depths", "scores", "num_nodes")


class ProposalStore:
    """Per-batch-row and per-request-state trees ``[rows, budget]`` of the last proposals."""

    def __init__(self, rows: int, budget: int, depth: int, device: torch.device):
        self.budget = budget
        self.batch = empty_batch(rows, budget, depth, device)  # written by the drafter
        self.state = empty_batch(rows, budget, depth, device)
        self._pending_rows: np.ndarray | None = None  # request states of ``batch``'s rows
        self._pending_index: torch.Tensor | None = None  # the same, long [R] on the device

    def write_batch(self, trees: DDTreeBatch) -> None:
        """The drafter's trees ``[R, budget]`` into ``batch`` rows ``0..R-1`` (no host work
        beyond the launches; runs inside the drafter's CUDA graph)."""
        num_reqs = trees.token_ids.shape[0]
        for name in TREE_FIELDS:
            getattr(self.batch, name)[:num_reqs].copy_(getattr(trees, name))

    def proposed(self, rows: np.ndarray, index: torch.Tensor) -> None:
        """After a real drafter run: ``batch``'s first ``len(rows)`` rows now hold the trees of
        request states ``rows`` (host ints; ``index`` the same on the device, int [R]). The
        caller flushed before the run."""
        assert self._pending_rows is None, "flush() before the drafter overwrites the batch"
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

    def step_trees(
        self,
        rows: np.ndarray,
        index: torch.Tensor,
        num_draft_np: np.ndarray,
        num_draft: torch.Tensor,
    ) -> DDTreeBatch:
        """The trees this step verifies, ``[R, budget]`` for request states ``rows`` (host;
        ``index`` the same on the device), each cut to its ``num_draft`` scheduled nodes (host
        and device long ``[R]``). Views of ``batch`` on a steady step (valid until the next
        drafter run), else a selection from ``state``."""
        pending = self._pending_rows
        steady = (
            pending is not None
            and len(pending) == len(rows)
            and bool(np.array_equal(pending, rows))
            and bool((num_draft_np == self.budget).all())
        )
        if steady:
            self._pending_rows = self._pending_index = None  # consumed
            num_reqs = len(rows)
            return DDTreeBatch(
                **{name: getattr(self.batch, name)[:num_reqs] for name in TREE_FIELDS},
                max_depth=self.batch.max_depth,
            )
        self.flush()
        return select_trees(self.state, index.long(), num_draft)
