"""A step-cost model, fitted from ``benchmarks/bench_e2e.py`` or ``bench_paired.py`` results, and
the budget it picks.

Decode speed with speculation is ``batch x acceptance(budget) / step_ms``: every target
forward (one step) emits ``acceptance`` tokens per request. The model keeps, from one bench
run on one GPU and one target/drafter pair:

- ``step_ms = base_ms + per_request_ms x batch + per_token_ms x verify tokens +
  per_node_pair_ms x batch x nodes^2`` per kind of step (verify tokens = batch x (1 + tree
  budget) for DDTree, batch x (1 + depth) for the DFlash chain; nodes = the tree budget).
  ``base_ms`` holds the drafter pass and the per-step overheads of the runner that kind ran on,
  ``per_request_ms`` what each request adds whatever its tree (the tree step's per-request
  work), ``per_token_ms`` the verify forward's cost per token and ``per_node_pair_ms`` the part
  that grows with the square of a tree (each node's ancestor row in the tree attention and the
  best-first build): budget 1024 costs ~10 ms a step at batch 1 where 512 costs ~4. For the
  chain, whose verify tokens and nodes are fixed multiples of the batch, the per-request and
  quadratic parts are folded into ``per_token_ms``. The coefficients are the non-negative
  least-squares fit of the run's T = 0 rows in relative error, so that the few-millisecond
  steps of small batches, where the budget is decided, weigh as much as the 100-ms ones;
- the mean acceptance length of the chain and of DDTree at each measured budget, interpolated
  in log2(budget) between them.

``choose_budget`` returns the budget (among the candidates inside the measured budget range:
acceptance is not extrapolated) with the highest predicted tokens/s at a batch size (the
smallest budget among those predicted within ``NEAR_TIE`` of it), or
None unless a tree is predicted at least ``MIN_PREDICTED_GAIN`` times as fast as the chain
(``"tree_budget": "auto"`` then serves the DFlash chain). The numbers are the measured pair's;
another pair or GPU needs its own profile, fitted from a bench run by ``python -m benchmarks
fit-profile BENCH_JSON --out profile.json`` (``benchmarks/fit_cost_profile.py``; a
``bench_paired.json``: engines run by turns, each engine's core in a process of its own as
``vllm serve`` runs it). This module keeps what the runtime needs: the profile and the choice.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace

BUDGET_CANDIDATES = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
# A tree is chosen only where predicted at least this much faster than the chain: two benches
# of one pair on one GPU parted by up to a third at batch 1 (benchmarks/results/README.md), and
# a tree that is predicted barely faster may measure slower.
MIN_PREDICTED_GAIN = 1.10
# Budgets predicted within this fraction of the fastest are a tie, and the smallest of them is
# chosen: the profile's acceptance is a mean over prompt sets, and a larger tree pays its step
# on every set but pays back only where acceptance runs deep: on the SmolLM2 pair's V2 benches
# at batch 1, budgets 16 and 32, predicted 2% apart, had the same mean speedup over the chain,
# but on the set where the chain is strongest (sharegpt) 16 kept 0.89-1.03x of it, 32 0.78-0.80x.
NEAR_TIE = 0.05
# An online "auto" judges budgets by the acceptance this engine reached on its own workload,
# not by a mean over prompt sets: there a tie is narrower, and a batch size keeps the budget it
# is served while that is predicted within HOLD_MARGIN of the fastest (so that noise in the
# live estimates does not move it back and forth, each move a step of another verify width).
# On the 8B scale model (benchmarks/results/2026-12-03_41c5d93_scale-8b-auto-grid) the 5% tie
# toward the smaller budget held "auto" at 0.85-0.95x the fastest fixed budget in most batch-1
# rows, its budget at batch 1 moving between 16, 32 and 64 from one refresh to the next.
LIVE_NEAR_TIE = 0.01
HOLD_MARGIN = 0.03
# What "auto" schedules per batch size at start on the V2 runner (``choose_schedule``): trees of
# 17 verify tokens and more, whose every uniform verify batch vLLM's default graph sizes (steps
# of 8, then 16 tokens) give a FULL graph in its V2 manager. Narrower trees need the sizes the
# plugin adds, and "auto" reaches them online only, from live acceptance (``ONLINE_CANDIDATES``).
SCHEDULE_CANDIDATES = tuple(b for b in BUDGET_CANDIDATES if b >= 16)
# What an online "auto" on V2 may move down to once it learns the acceptance: budget 8 as well,
# whose verify batches get FULL graphs from the sizes the plugin adds
# (``graph_sizes.verify_graph_sizes``). At many requests a tree of 9 verify tokens a request
# can beat the chain's 16 where a tree of 17 cannot: on the 8B scale model budget 16 accepts
# little more than the chain there (benchmarks/results/2026-12-04_cd5632b_scale-8b-flash-context).
ONLINE_CANDIDATES = tuple(b for b in BUDGET_CANDIDATES if b >= 8)
# An online "auto" tries the next larger budget of a batch size, when it has no live estimate,
# if predicted at most this much slower than the fastest (cost_model.choose_live_schedule).
EXPLORE_MARGIN = 0.10
# The largest CUDA graph (tokens) the plugin asks for when the user chose none: every verify
# batch up to this many tokens replays a FULL graph; beyond it graphs cost memory and start-up
# time (vLLM's own default stops at 512). "auto" schedules no wider verify batch.
VERIFY_GRAPH_TOKENS = 2048
PROFILE_DIR = os.path.join(os.path.dirname(__file__), "cost_profiles")
# The packaged profiles, one per vLLM model runner DDTree can run on (their step costs differ).
PACKAGED_PROFILES = {
    "V1": os.path.join(PROFILE_DIR, "h200_smollm2.json"),
    "V2": os.path.join(PROFILE_DIR, "h200_smollm2_v2.json"),
}
DEFAULT_PROFILE = PACKAGED_PROFILES["V1"]


@dataclass(frozen=True)
class StepCost:
    """``step_ms = base_ms + per_request_ms * batch + per_token_ms * tokens + per_node_pair_ms
    * batch * nodes**2`` for one kind of step (``tokens``: the step's verify tokens over its
    ``batch`` requests, ``nodes``: each request's tree budget)."""

    base_ms: float
    per_token_ms: float
    per_request_ms: float = 0.0
    per_node_pair_ms: float = 0.0

    def step_ms(self, tokens: int, batch: int = 1, nodes: int = 0) -> float:
        return (
            self.base_ms
            + self.per_request_ms * batch
            + self.per_token_ms * tokens
            + self.per_node_pair_ms * batch * nodes * nodes
        )


@dataclass(frozen=True)
class CostProfile:
    """What ``choose_budget`` needs, fitted from one bench run
    (``benchmarks/fit_cost_profile.py``).

    Attributes:
        source: where the numbers come from (commit, GPU, pair), for log lines.
        depth: the chain's drafts per step (the drafter's ``num_speculative_tokens``).
        chain, tree: step costs of the DFlash chain and of DDTree (each on its runner).
        chain_acceptance: tokens per chain step.
        tree_acceptance: ``{budget: tokens per DDTree step}`` at the measured budgets.
        max_batch: the largest batch size measured; larger batches are judged at it (the
            linear step cost is not extrapolated in batch).
    """

    source: str
    depth: int
    chain: StepCost
    tree: StepCost
    chain_acceptance: float
    tree_acceptance: dict[int, float]
    max_batch: int = 1

    @property
    def target_name(self) -> str | None:
        """The target the profile was measured on, as its ``source`` names it
        (``"KIND at COMMIT on GPU: TARGET + DRAFTER"``), or None."""
        _, colon, pair = self.source.rpartition(": ")
        target = pair.partition(" + ")[0].strip() if colon else ""
        return target if target and target != "?" else None

    def measured_on(self, target: str) -> bool:
        """Whether the profile was measured on ``target`` (a model path or hub id, compared by
        its last component)."""
        name = os.path.basename(str(target).rstrip("/"))
        return self.target_name is not None and name.lower() == self.target_name.lower()

    def measured_range(self) -> tuple[int, int]:
        return min(self.tree_acceptance), max(self.tree_acceptance)

    def acceptance(self, tree_budget: int) -> float:
        """Tokens per DDTree step at ``budget``: linear in log2(budget) between measured
        budgets, the nearest measured value outside them."""
        points = sorted(self.tree_acceptance.items())
        if tree_budget <= points[0][0]:
            return points[0][1]
        if tree_budget >= points[-1][0]:
            return points[-1][1]
        for (b0, a0), (b1, a1) in zip(points, points[1:], strict=False):
            if b0 <= tree_budget <= b1:
                t = (math.log2(tree_budget) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return a0 + t * (a1 - a0)
        raise AssertionError("unreachable")

    def tree_tokens_per_s(self, tree_budget: int, batch: int) -> float:
        step = self.tree.step_ms(batch * (1 + tree_budget), batch, tree_budget)
        return 1000.0 * batch * self.acceptance(tree_budget) / step

    def chain_tokens_per_s(self, batch: int) -> float:
        step = self.chain.step_ms(batch * (1 + self.depth), batch)
        return 1000.0 * batch * self.chain_acceptance / step

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tree_acceptance"] = {str(k): v for k, v in self.tree_acceptance.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> CostProfile:
        return cls(
            source=str(data["source"]),
            depth=int(data["depth"]),
            chain=StepCost(**data["chain"]),
            tree=StepCost(**data["tree"]),
            chain_acceptance=float(data["chain_acceptance"]),
            tree_acceptance={int(k): float(v) for k, v in data["tree_acceptance"].items()},
            max_batch=int(data.get("max_batch", 1)),
        )


def _judged_batch(profile: CostProfile, batch: int) -> int:
    """The batch size a prediction for ``batch`` requests is made at: the largest measured one
    when larger."""
    return max(1, min(batch, profile.max_batch))


def _predicted_trees(profile: CostProfile, batch: int, candidates) -> dict[int, float]:
    """Predicted tokens/s of each candidate budget inside the measured range (the range's
    low end when none is) at ``batch`` requests (judged at ``profile.max_batch`` when
    larger)."""
    batch = _judged_batch(profile, batch)
    low, high = profile.measured_range()
    candidates = [b for b in candidates if low <= b <= high] or [low]
    return {b: profile.tree_tokens_per_s(b, batch) for b in candidates}


def _fastest(predicted: dict[int, float], tie: float = NEAR_TIE) -> int:
    """The smallest budget predicted within ``tie`` of the fastest."""
    fastest = max(predicted.values())
    return min(b for b, tok_s in predicted.items() if tok_s >= (1 - tie) * fastest)


def served_budget(schedule: list[tuple[int, int, int]] | None, batch: int) -> int | None:
    """The budget ``schedule`` (vLLM's inclusive ranges) serves at ``batch`` requests."""
    for first, last, budget in schedule or ():
        if first <= batch <= last:
            return budget
    return None


def choose_budget(
    profile: CostProfile, batch: int, candidates=BUDGET_CANDIDATES, chain: bool = True
) -> tuple[int | None, dict[str, float]]:
    """The budget with the highest predicted tokens/s at ``batch`` concurrent requests (judged
    at ``profile.max_batch`` when larger; the smallest of those within ``NEAR_TIE`` of the
    highest), or None when ``chain`` may be served and no candidate is predicted at least
    ``MIN_PREDICTED_GAIN`` times as fast as the DFlash chain; with the predictions
    (``{"chain": tok/s, "b16": tok/s, ...}``) behind the choice."""
    trees = _predicted_trees(profile, batch, candidates)
    predicted = {"chain": profile.chain_tokens_per_s(_judged_batch(profile, batch))}
    predicted.update({f"b{b}": tok_s for b, tok_s in trees.items()})
    if chain and max(trees.values()) < MIN_PREDICTED_GAIN * predicted["chain"]:
        return None, predicted
    return _fastest(trees), predicted


def chain_considered(profile: CostProfile, runner: str, target: str | None) -> bool:
    """Whether "auto" may serve the DFlash chain on ``profile``: on the V2 runner only where
    the profile was measured on the served ``target`` (or the target is not known), since a
    chain engine cannot learn that trees pay and a V2 tree engine learns its budgets online;
    on V1 (one verify width per engine) the profile decides."""
    return runner.lower() != "v2" or target is None or profile.measured_on(target)


def choose_schedule(
    profile: CostProfile,
    max_num_seqs: int,
    max_verify_tokens: int,
    candidates=SCHEDULE_CANDIDATES,
) -> list[tuple[int, int, int]]:
    """``"tree_budget": "auto"``'s budget for every batch size up to ``max_num_seqs``, as vLLM's
    per-batch-size schedule (``num_speculative_tokens_per_batch_size``: inclusive ranges
    ``(first, last, budget)``): at each batch size the budget predicted fastest (the smallest
    within ``NEAR_TIE``) among the candidates whose verify batch, ``batch x (1 + budget)``
    tokens, has a CUDA graph (at most ``max_verify_tokens``); 0 (no drafts: vLLM decodes
    those batches as the target alone, in its graphs) where no candidate's fits."""

    def fastest_fitting(batch: int) -> int:
        predicted = _fitting_predictions(profile, batch, candidates, max_verify_tokens)
        return _fastest(predicted) if predicted else 0

    return _ranges(max_num_seqs, fastest_fitting)


def _fitting_predictions(
    profile: CostProfile, batch: int, candidates, max_verify_tokens: int
) -> dict[int, float]:
    """``_predicted_trees`` at ``batch`` of the candidates whose verify batch, ``batch x
    (1 + budget)`` tokens, is at most ``max_verify_tokens`` (empty when none is)."""
    fitting = [b for b in candidates if batch * (1 + b) <= max_verify_tokens]
    return _predicted_trees(profile, batch, fitting) if fitting else {}


def _ranges(max_num_seqs: int, budget_at) -> list[tuple[int, int, int]]:
    """``budget_at(batch)`` for batch sizes 1..``max_num_seqs`` as vLLM's inclusive ranges
    ``(first, last, budget)``."""
    schedule: list[tuple[int, int, int]] = []
    for batch in range(1, max_num_seqs + 1):
        budget = budget_at(batch)
        if schedule and schedule[-1][2] == budget:
            schedule[-1] = (schedule[-1][0], batch, budget)
        else:
            schedule.append((batch, batch, budget))
    return schedule


def fitting_schedule(
    max_num_seqs: int, tree_budget: int, max_verify_tokens: int
) -> list[tuple[int, int, int]]:
    """An explicit ``tree_budget`` as vLLM's per-batch-size schedule whose every verify batch
    fits ``max_verify_tokens`` (the largest CUDA graph): at each batch size the budget, halved
    until ``batch x (1 + budget)`` fits (at least 1), so few widths need graphs."""

    def halved_to_fit(batch: int) -> int:
        budget = tree_budget
        while budget > 1 and batch * (1 + budget) > max_verify_tokens:
            budget //= 2
        return budget

    return _ranges(max_num_seqs, halved_to_fit)


def online_candidates(tree_budget: int) -> tuple[int, ...]:
    """The budgets an online "auto" engine of ``tree_budget`` on the V1 runner moves between:
    the cost model's candidates below it, and itself (its verify batches have one CUDA-graph
    width: ``budget/online.py`` moves a V1 engine only without graphs). On the V2 runner
    "auto" moves among ``online_schedule``'s budgets, whose widths all have graphs."""
    return tuple(sorted({b for b in BUDGET_CANDIDATES if b < tree_budget} | {tree_budget}))


def online_schedule(
    schedule: list[tuple[int, int, int]], max_num_seqs: int
) -> tuple[list[tuple[int, int, int]], tuple[int, ...]]:
    """V2 "auto": the per-batch-size schedule to give vLLM and the budgets the engine moves
    among online. Those are the schedule's budgets and every smaller ``ONLINE_CANDIDATES``
    budget, so that "auto" can move at every batch size, also where the schedule has one budget
    (an engine of 1-4 requests). vLLM captures FULL graphs for the budget of every entry at
    every batch size, and its lookup ignores entries past ``max_num_seqs``: each budget the
    schedule lacks gets an entry of its own past ``max_num_seqs`` (one batch size each), for
    its graphs only."""
    scheduled = sorted({budget for _, _, budget in schedule if budget > 0})
    budgets = sorted(set(scheduled) | {b for b in ONLINE_CANDIDATES if b < scheduled[-1]})
    missing = [b for b in budgets if b not in scheduled]
    graphs_only = [(max_num_seqs + 1 + i, max_num_seqs + 1 + i, b) for i, b in enumerate(missing)]
    return list(schedule) + graphs_only, tuple(budgets)


def choose_live_schedule(
    profile: CostProfile,
    live: dict[int, tuple[float, float]],
    candidates,
    max_num_seqs: int,
    max_verify_tokens: int,
    min_trees: float,
    explore: bool = False,
    served: list[tuple[int, int, int]] | None = None,
    untimed=None,
) -> tuple[list[tuple[int, int, int]], dict[int, float]]:
    """``choose_schedule`` over ``candidates`` with the acceptance this engine reached
    (``live``: ``{budget: (tokens per verify step, decayed trees behind it)}``,
    ``OnlineAcceptance.snapshot``) where at least ``min_trees`` trees stand behind it, the
    profile's elsewhere, never below a smaller budget's (a larger best-first tree holds the
    smaller one: a live estimate below a smaller budget's is stale, from before a workload
    shift, and judged as unmeasured); the profile's step costs. With ``explore``, a batch
    size whose next larger fitting budget has no live estimate is given it when predicted
    within ``EXPLORE_MARGIN`` of its fastest (so a budget above the one served is measured
    again); else, given ``untimed(budget, batch)`` (whether the engine served that batch size
    but never timed that budget's steps there), it is given the next smaller fitting budget
    when that one is untimed and predicted within ``EXPLORE_MARGIN`` (a smaller budget's
    acceptance is learned for free, its step time only by serving it). A batch size gets the
    smallest budget within ``LIVE_NEAR_TIE`` of the fastest,
    unless the budget ``served`` there (the schedule being served) is predicted within
    ``HOLD_MARGIN`` of the fastest: then it keeps it. Returns the schedule and the tokens per
    step it used by budget."""
    acceptance: dict[int, float] = {}
    known: set[int] = set()
    floor = 0.0
    for b in sorted(candidates):
        # A live estimate below a smaller budget's is stale (a larger best-first tree holds
        # the smaller one): measured before the workload shifted, it is judged as unmeasured.
        if b in live and live[b][1] >= min_trees and live[b][0] >= floor:
            acceptance[b] = live[b][0]
            known.add(b)
        else:
            acceptance[b] = max(profile.acceptance(b), floor)
        floor = acceptance[b]
    judged = replace(profile, tree_acceptance=acceptance)

    def budget_at(batch: int) -> int:
        predicted = _fitting_predictions(judged, batch, candidates, max_verify_tokens)
        if not predicted:  # no tree's verify fits a graph: no drafts
            return 0
        best = _fastest(predicted, LIVE_NEAR_TIE)
        held = served_budget(served, batch)
        if held in predicted and predicted[held] >= (1 - HOLD_MARGIN) * predicted[best]:
            best = held
        if not explore:
            return best
        larger = sorted(b for b in predicted if b > best)
        if larger and larger[0] not in known:
            if predicted[larger[0]] >= (1 - EXPLORE_MARGIN) * predicted[best]:
                return larger[0]
        smaller = sorted((b for b in predicted if b < best), reverse=True)
        if untimed is not None and smaller and untimed(smaller[0], batch):
            if predicted[smaller[0]] >= (1 - EXPLORE_MARGIN) * predicted[best]:
                return smaller[0]
        return best

    return _ranges(max_num_seqs, budget_at), acceptance


def format_schedule(schedule: list[tuple[int, int, int]]) -> str:
    """``choose_schedule``'s ranges as ``"1-4: 128, 5-7: 64, ..."`` (requests: budget)."""
    return ", ".join(
        f"{first}: {budget}" if first == last else f"{first}-{last}: {budget}"
        for first, last, budget in schedule
    )


def choose_automatic(
    batch: int,
    runner: str,
    tensor_parallel_size: int = 1,
    path: str | None = None,
    target: str | None = None,
) -> tuple[int | None, dict[str, float], CostProfile | None]:
    """What ``"tree_budget": "auto"`` serves at ``batch`` concurrent requests: the budget
    ``choose_budget`` picks on the profile at ``path`` (by default the packaged one of
    ``runner``, "V1" or "V2"), or None for the DFlash chain; with the predictions and the
    profile. The packaged profiles were measured on one GPU: at ``tensor_parallel_size`` > 1
    without a profile of one's own, "auto" serves the chain (predictions empty, profile None),
    which the TP = 2 bench measured faster than every tree it ran there."""
    if path is None and tensor_parallel_size > 1:
        return None, {}, None
    profile = load_profile(path, runner=runner.upper())
    chain = chain_considered(profile, runner, target)
    tree_budget, predicted = choose_budget(profile, batch, chain=chain)
    return tree_budget, predicted, profile


def load_profile(path: str | None = None, runner: str = "V1") -> CostProfile:
    """The profile at ``path`` (JSON from ``benchmarks/fit_cost_profile.py``), by default the
    packaged one of ``runner`` ("V1" or "V2", the vLLM model runner DDTree runs on)."""
    with open(path or PACKAGED_PROFILES[runner]) as f:
        return CostProfile.from_dict(json.load(f))


def describe_automatic(max_num_seqs: int, runner: str, path: str | None = None) -> str:
    """What ``"tree_budget": "auto"`` serves an engine of ``max_num_seqs`` requests on
    ``runner`` ("v1" or "v2") with the profile at ``path`` (the packaged one by default): the
    predictions at that limit, the choice, and on V2 the budget per batch size."""
    tree_budget, predicted, profile = choose_automatic(max_num_seqs, runner, 1, path)
    lines = [
        f"profile: {profile.source}",
        f"predicted tok/s at {max_num_seqs} requests: "
        + ", ".join(f"{name} {tok_s:.0f}" for name, tok_s in predicted.items()),
        "choice: "
        + (
            "the DFlash chain"
            if tree_budget is None
            else f"trees (budget {tree_budget} at {max_num_seqs} requests)"
        ),
    ]
    if tree_budget is not None and runner.lower() == "v2":
        schedule = choose_schedule(profile, max_num_seqs, VERIFY_GRAPH_TOKENS)
        lines.append("budget per batch size: " + format_schedule(schedule))
        budgets = list(online_schedule(schedule, max_num_seqs)[1])
        if len(budgets) > 1:
            lines.append(f"then moves among budgets {budgets} as it learns the acceptance")
    elif tree_budget is not None:
        budgets = list(online_candidates(tree_budget))
        lines.append(
            f"then, without CUDA graphs, moves among budgets {budgets} as it learns the acceptance"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description='What "tree_budget": "auto" serves: the cost profile\'s predictions and choice'
    )
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--runner", choices=("v1", "v2"), default="v2")
    parser.add_argument("--profile", help="a fitted profile JSON (default: the packaged one)")
    args = parser.parse_args()
    print(describe_automatic(args.max_num_seqs, args.runner, args.profile))
