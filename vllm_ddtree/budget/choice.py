"""What ``"tree_budget": "auto"`` serves when the engine starts: ``choose(BudgetQuestion)``.

The installer asks once per engine, before vLLM sees the speculative config, with what the
engine's config says (runner, request limit, parallel sizes, served model, the user's cost
profile). The answer is a ``BudgetChoice``: the DFlash chain, or a tree budget with the budgets
the engine may move between online (``budget/online.py``) and, on the V2 runner, vLLM's
per-batch-size schedule (one budget per batch size, each a FULL graph). Every choice is logged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from vllm_ddtree.budget.cost_model import (
    VERIFY_GRAPH_TOKENS,
    CostProfile,
    chain_considered,
    choose_automatic,
    choose_schedule,
    format_schedule,
    online_candidates,
    online_schedule,
)

logger = logging.getLogger("vllm.ddtree")


class CostProfileError(ValueError):
    """The user's ``cost_profile`` cannot be read."""


@dataclass(frozen=True)
class BudgetQuestion:
    """What "auto" chooses for: one engine's settings.

    Attributes:
        depth: the drafter's depth (``num_speculative_tokens``), for the log line.
        runner: "v1" or "v2", the model runner DDTree runs on (its packaged profile).
        max_num_seqs: the engine's request limit (None: unset, chosen for one request).
        tensor_parallel_size: the target's tensor-parallel ranks (the packaged profiles were
            measured on one GPU).
        data_parallel_size: the engine's data-parallel ranks (above 1: one budget for all).
        target: the served model (path or hub id) when known.
        cost_profile: the user's cost profile path (None: the runner's packaged one).
        gives_schedule: the user set vLLM's per-batch-size schedule themselves.
    """

    depth: int
    runner: str
    max_num_seqs: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    target: str | None = None
    cost_profile: str | None = None
    gives_schedule: bool = False


@dataclass(frozen=True)
class BudgetChoice:
    """What "auto" serves.

    Attributes:
        tree_budget: tree nodes per request; None for the DFlash chain.
        online_budgets: the budgets the engine may move between as it learns its acceptance
            (V1: up to ``tree_budget``; V2: those of ``schedule``); empty where it stays put.
        schedule: vLLM's ``num_speculative_tokens_per_batch_size`` entries
            ``[(first batch size, last, budget), ...]`` to set (V2), or None.
    """

    tree_budget: int | None
    online_budgets: tuple[int, ...] = ()
    schedule: list[tuple[int, int, int]] | None = None


def choose(question: BudgetQuestion) -> BudgetChoice:
    """The budget a cost profile predicts fastest at ``question.max_num_seqs`` requests, or the
    chain where it predicts the chain at least as fast (and at tensor parallel > 1 without a
    profile of one's own); raises ``CostProfileError`` for a ``cost_profile`` that is not a file.

    Trees chosen, the engine then serves: under data parallelism that one budget on every rank
    (ranks must verify alike; vLLM drops per-batch-size schedules there); on V2 without a user
    schedule, a budget per batch size up to ``max_num_seqs`` (its largest as the tree budget),
    moving among them online; on V1, the budgets up to the choice (``online_candidates``)."""
    tree_budget, profile = _budget_at_start(question)
    if tree_budget is None:
        return BudgetChoice(None)
    if question.data_parallel_size > 1:
        logger.info(
            "vllm-ddtree: tree_budget 'auto' chose budget %d for all %d data-parallel ranks "
            "(fixed: ranks must verify alike)",
            tree_budget,
            question.data_parallel_size,
        )
        return BudgetChoice(tree_budget)
    if question.runner == "v1":
        return BudgetChoice(tree_budget, online_candidates(tree_budget))
    if question.gives_schedule:
        return BudgetChoice(tree_budget)
    schedule = choose_schedule(profile, question.max_num_seqs or 1, VERIFY_GRAPH_TOKENS)
    logger.warning(
        "vllm-ddtree: tree_budget 'auto' per batch size (requests: budget): %s",
        format_schedule(schedule),
    )
    scheduled = sorted({budget for _, _, budget in schedule if budget > 0})
    budgets = tuple(scheduled)
    if question.max_num_seqs is not None:  # (entries past it, for graphs, only need the limit)
        schedule, budgets = online_schedule(schedule, question.max_num_seqs)
    if len(budgets) < 2:
        return BudgetChoice(scheduled[-1])
    # vLLM captures graphs for every budget of the schedule: "auto" moves among them.
    return BudgetChoice(scheduled[-1], budgets, schedule)


def _budget_at_start(question: BudgetQuestion) -> tuple[int | None, CostProfile | None]:
    """The profile's fastest budget at the engine's batch (None: the chain) and the profile it
    read (None at tensor parallel > 1 without one); logged either way.

    A profile measured on another target than ``question.target`` does not choose the chain on
    the V2 runner (``cost_model.chain_considered``): there "auto" serves the profile's tree and
    learns this engine's budgets online, where a chain engine could never learn that trees
    pay."""
    path = question.cost_profile
    if path is not None and not os.path.isfile(str(path)):
        raise CostProfileError(
            f"speculative_config['cost_profile'] = {path!r} is not a file (a JSON written by "
            "python -m benchmarks fit-profile BENCH_JSON --out PATH)"
        )
    batch = question.max_num_seqs or 1
    tree_budget, predicted, profile = choose_automatic(
        batch, question.runner, question.tensor_parallel_size, path, question.target
    )
    if profile is None:
        logger.warning(
            "vllm-ddtree: tree_budget 'auto' at tensor_parallel_size=%d chose the DFlash chain "
            "(the packaged cost profiles were measured on one GPU; give a cost_profile "
            "measured at this tensor parallel size, or a tree_budget, for trees)",
            question.tensor_parallel_size,
        )
        return None, None
    shown = ", ".join(f"{k} {v:.0f}" for k, v in predicted.items())
    choice = "the DFlash chain" if tree_budget is None else f"tree_budget {tree_budget}"
    if not chain_considered(profile, question.runner, question.target):
        choice += (
            f" (the profile was measured on {profile.target_name or 'another target'}, not this "
            "target, so it does not choose the chain: trees, whose budgets this engine learns "
            "online; for the chain, a cost_profile measured on this target)"
        )
    logger.warning(
        "vllm-ddtree: tree_budget 'auto' at max_num_seqs=%d chose %s (predicted tok/s: %s; "
        "profile: %s, drafter depth there %d, here %d)",
        batch,
        choice,
        shown,
        profile.source,
        profile.depth,
        question.depth,
    )
    return tree_budget, profile
