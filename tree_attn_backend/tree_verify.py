"""What the TREE_ATTN metadata builder reads each step: the trees' structure, from whoever
drafts them.

The DDTree step builds the batch's trees; vLLM's attention metadata builders run later in the
same step, in the same worker process. A builder is handed a ``TreeVerifySource`` (the DDTree
step state, ``bind_tree_source``); each ``build`` reads its ``TreeVerifyBatch`` (None: every
request plain causal) and reports the step's KV slot mapping back to it. A builder with no
source is plain causal attention.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

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


class TreeVerifySource(Protocol):
    """What a TREE_ATTN builder is handed: the step's trees, and where its slots go."""

    def published_trees(self) -> TreeVerifyBatch | None:
        """The tree structure of the step being built (None: no request verifies a tree)."""

    def record_slot_mapping(self, slot_mapping: torch.Tensor) -> None:
        """The KV slot of every query token of the step the builder just built (int64 [T])."""


def bind_tree_source(attn_groups: Iterable, source: TreeVerifySource | None) -> int:
    """Hand ``source`` to every TREE_ATTN metadata builder among vLLM's attention groups
    (``runner.attn_groups``: a list per KV-cache group); returns how many builders it reached."""
    reached = 0
    for groups in attn_groups:
        for group in groups:
            for builder in getattr(group, "metadata_builders", ()):
                if hasattr(builder, "tree_source"):  # TREE_ATTN's builder reads one
                    builder.tree_source = source
                    reached += 1
    return reached
