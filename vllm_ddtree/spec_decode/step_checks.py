"""Invariant checks of every DDTree step, for tests: ``VLLM_DDTREE_CHECK_STEPS=1``.

Off (the default) each check costs one environment lookup. On, each reads device tensors on
the host (a synchronisation per step) and raises ``StepInvariantError`` naming the request
rows that break it:

* every verified tree node's input token is the node's draft token (a tree verified against
  other inputs, e.g. a stale tree against the zeros vLLM schedules when it skipped the
  drafter, walks nodes whose K/V were computed for other tokens);
* every K/V slot the drafter writes lies in its request's allocated blocks (a query past them
  lands in the null block or in another request's blocks).
"""

from __future__ import annotations

import torch

from vllm_ddtree import envs
from vllm_ddtree.tree import DDTreeBatch


class StepInvariantError(RuntimeError):
    """A DDTree step broke an invariant its exactness or memory safety rests on."""


def check_tree_tokens(input_ids: torch.Tensor, trees: DDTreeBatch, root_row: torch.Tensor):
    """``input_ids`` ``[T]`` of the step, ``trees`` ``[R, N]`` it verifies, ``root_row`` long
    ``[R]``: node ``i`` of request ``r`` is row ``root_row[r] + 1 + i``."""
    if not envs.checking_steps() or trees.num_requests == 0:
        return
    rows = (
        root_row.long().unsqueeze(1) + 1 + torch.arange(trees.tree_budget, device=root_row.device)
    )
    valid = trees.valid_mask()
    fed = input_ids[rows.clamp(max=input_ids.shape[0] - 1)].long()
    wrong = valid & (fed != trees.token_ids)
    if bool(wrong.any()):
        bad = wrong.any(dim=1).nonzero().flatten().tolist()
        raise StepInvariantError(
            f"vllm-ddtree: batch rows {bad} verify tree nodes whose input tokens are not the "
            f"nodes' tokens (inputs {fed[bad].tolist()}, nodes {trees.token_ids[bad].tolist()})"
        )


def check_slots_allocated(what: str, last_position: torch.Tensor, allocated_tokens) -> None:
    """``last_position`` long ``[R]``: the last position each request writes K/V at;
    ``allocated_tokens`` int ``[R]`` (host): the token slots its blocks hold."""
    if not envs.checking_steps():
        return
    last = last_position.long().cpu()
    allocated = torch.as_tensor(allocated_tokens, dtype=torch.long)[: last.shape[0]]
    outside = (last >= allocated).nonzero().flatten().tolist()
    if outside:
        raise StepInvariantError(
            f"vllm-ddtree: {what} writes K/V past its request's blocks (batch rows {outside}: "
            f"last position {last[outside].tolist()}, slots allocated "
            f"{allocated[outside].tolist()})"
        )
