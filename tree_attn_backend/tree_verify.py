"""The per-step tree structure handed from the DDTree proposer to the TREE_ATTN builder.

The proposer builds the batch's trees; the attention metadata builder runs later in the same
step, in the same worker process. ``TreeVerifyBatch`` is what passes between them: which
requests verify a tree and the bit-packed ancestor mask of every query token. With nothing
published, every request is plain causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeVerifyBatch:
    """Tree structure of one step's batch.

    Attributes:
        is_tree: int32 ``[R]``: 1 where request ``r``'s query tokens are a tree (root first).
        tree_mask: int32 ``[T, W]``: bit ``j`` of row ``t`` says whether query token ``t`` sees
            token ``j`` of its own request's query (``pack_tree_mask`` layout).
    """

    is_tree: torch.Tensor
    tree_mask: torch.Tensor


_current: TreeVerifyBatch | None = None


def publish(batch: TreeVerifyBatch | None) -> None:
    """Set (or clear, with None) the tree structure of the step about to run."""
    global _current
    _current = batch


def current() -> TreeVerifyBatch | None:
    """The tree structure published for this step, if any."""
    return _current


@dataclass
class RecordedStep:
    """What the TREE_ATTN builder saw for the target in the current step."""

    slot_mapping: torch.Tensor  # int64 [T]: KV slot of every query token


_recorded: RecordedStep | None = None


def record_step(slot_mapping: torch.Tensor) -> None:
    """Called by the builder each step: remember the target's slot mapping (for KV commit)."""
    global _recorded
    _recorded = RecordedStep(slot_mapping=slot_mapping)


def last_step() -> RecordedStep | None:
    return _recorded
