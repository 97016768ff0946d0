"""Each verified row's path tokens: what a tree row's logits continue after the root.

A tree step's logits rows are, per request, its root then its nodes in tree order (row
``cu_num_logits[r] + i`` is tree index ``i``). Target-alone decoding reaches node ``i``'s row
after the request's outputs (the root's token the last of them) and the tokens of the path
from the root's child down to node ``i`` itself: the row's path tokens. The request-level
sampling parameters that read the past (penalties, bad words) read them per row
(``tree_penalties.py``, ``tree_bad_words.py``).

PyTorch ops only (about six per depth level, no host synchronisation), built only on steps
whose requests use such parameters.

Shapes: trees ``[R, N]`` (``DDTreeBatch``), ``cu_num_logits`` int ``[R + 1]``; outputs long
``[rows, L]`` (path tokens, ``-1`` after the path) and long ``[rows]`` (path lengths).
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree import DDTreeBatch


def tree_path_tokens(trees: DDTreeBatch, max_depth: int) -> torch.Tensor:
    """long ``[R, N + 1, max_depth]``: for tree index ``i`` of request ``r`` the tokens of the
    nodes on its path at depths ``1 .. depth(i)``, in order, then ``-1``; the root's row and
    padding nodes' rows (tree indices past ``num_nodes``) hold ``-1`` only."""
    num_reqs, width = trees.token_ids.shape
    device = trees.token_ids.device
    # One spare column takes the writes of climbs already past the root.
    paths = torch.full((num_reqs, width + 1, max_depth + 1), -1, dtype=torch.long, device=device)
    node_paths = paths[:, 1:, :]
    index = torch.arange(1, width + 1, device=device).expand(num_reqs, width)
    current = torch.where(trees.valid_mask(), index, 0)  # tree index climbed to, 0 = done
    for _ in range(max_depth):
        live = current >= 1
        node = (current - 1).clamp(min=0)
        token = trees.token_ids.gather(1, node)
        column = torch.where(live, trees.depths.gather(1, node) - 1, max_depth)
        node_paths.scatter_(2, column.unsqueeze(-1), token.unsqueeze(-1))
        current = torch.where(live, trees.parents.gather(1, node), 0)
    return paths[:, :, :max_depth].contiguous()


def row_requests(cu_num_logits: torch.Tensor, num_rows: int) -> torch.Tensor:
    """long ``[num_rows]``: the batch index of the request each logits row belongs to."""
    rows = torch.arange(num_rows, device=cu_num_logits.device, dtype=cu_num_logits.dtype)
    return torch.searchsorted(cu_num_logits[1:].contiguous(), rows, right=True).long()


def row_layout(cu_num_logits: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each logits row's request (batch index) and its place among that request's rows (0:
    the root), both long ``[num_rows]``."""
    requests = row_requests(cu_num_logits, num_rows)
    local = torch.arange(num_rows, device=requests.device) - cu_num_logits.long()[requests]
    return requests, local


def row_path_tokens(
    trees: DDTreeBatch,
    cu_num_logits: torch.Tensor,
    num_rows: int,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The path tokens of every logits row of a tree step (long ``[num_rows, max_depth]``,
    ``-1`` after the path) and their number (long ``[num_rows]``). A request's rows past its
    tree's nodes (drafts vLLM padded in, never walked) get empty paths."""
    requests, local = row_layout(cu_num_logits, num_rows)
    paths = tree_path_tokens(trees, max_depth)
    tokens = paths[requests, local.clamp(max=trees.tree_budget)]
    return tokens, (tokens >= 0).sum(dim=1)
