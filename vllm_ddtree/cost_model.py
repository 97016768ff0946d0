"""A step-cost model fitted from ``benchmarks/bench_e2e.py`` or ``bench_paired.py`` results, and
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
another pair or GPU needs its own profile (``python -m vllm_ddtree.cost_model
bench_e2e.json --out profile.json``, or a ``bench_paired.json``: engines run by turns, each
engine's core in a process of its own as ``vllm serve`` runs it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass

import numpy as np

BUDGET_CANDIDATES = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
# A tree is chosen only where predicted at least this much faster than the chain: two benches
# of one pair on one GPU parted by up to a third at batch 1 (benchmarks/results/README.md), and
# a tree that is predicted barely faster may measure slower.
MIN_PREDICTED_GAIN = 1.10
# Budgets predicted within this fraction of the fastest are a tie, and the smallest of them is
# chosen: the profile's acceptance is a mean over prompt sets, and a larger tree pays its step
# on every set but pays back only where acceptance runs deep. Measured (the two V2 benches of
# the SmolLM2 pair, f8ddc72 and e72fe79, batch 1): budgets 16 and 32, predicted 2% apart, had
# the same mean speedup over the chain, but on the set where the chain is strongest (sharegpt)
# budget 16 kept 0.89x / 1.03x of it and budget 32 0.78x / 0.80x.
NEAR_TIE = 0.05
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
    """What ``choose_budget`` needs, fitted from one bench run (``fit_profile``).

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


def choose_budget(
    profile: CostProfile, batch: int, candidates=BUDGET_CANDIDATES
) -> tuple[int | None, dict[str, float]]:
    """The budget with the highest predicted tokens/s at ``batch`` concurrent requests (judged
    at ``profile.max_batch`` when larger; the smallest of those within ``NEAR_TIE`` of the
    highest), or None when no candidate is predicted at least ``MIN_PREDICTED_GAIN`` times as
    fast as the DFlash chain; with the predictions (``{"chain": tok/s, "b16": tok/s, ...}``)
    behind the choice."""
    batch = max(1, min(batch, profile.max_batch))
    low, high = profile.measured_range()
    candidates = [b for b in candidates if low <= b <= high] or [low]
    predicted = {"chain": profile.chain_tokens_per_s(batch)}
    for tree_budget in candidates:
        predicted[f"b{tree_budget}"] = profile.tree_tokens_per_s(tree_budget, batch)
    fastest = max(predicted[f"b{b}"] for b in candidates)
    if fastest < MIN_PREDICTED_GAIN * predicted["chain"]:
        return None, predicted
    tied = [b for b in candidates if predicted[f"b{b}"] >= (1 - NEAR_TIE) * fastest]
    return min(tied), predicted


FIT_TIE_TOLERANCE = 1e-9  # relative: fits whose errors differ less than this are tied


def _fit_relative_nonnegative(features: list[list[float]], step_ms: list[float]) -> list[float]:
    """Coefficients ``c >= 0`` minimising ``sum(((features @ c - y) / y) ** 2)``: the
    least-squares fit in relative error, solved exactly over every set of free coefficients
    (a handful of features: at most 2**4 - 1 small solves); unused features get 0; among
    tied fits, the one with the fewest and earliest free coefficients."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(step_ms, dtype=np.float64)
    weighted = x / y[:, None]
    ones = np.ones_like(y)
    best: tuple[float, np.ndarray] | None = None
    columns = range(x.shape[1])
    for size in range(1, x.shape[1] + 1):
        for free in itertools.combinations(columns, size):
            solved, *_ = np.linalg.lstsq(weighted[:, free], ones, rcond=None)
            if (solved < 0).any():
                continue
            coefficients = np.zeros(x.shape[1])
            coefficients[list(free)] = solved
            error = float(np.sum((weighted @ coefficients - ones) ** 2))
            # Collinear rows (a bench of one budget) fit equally well with several sets;
            # the first set found wins unless another is better beyond rounding, so the
            # choice does not hang on the linear-algebra library's last bits.
            if best is None or error < best[0] * (1 - FIT_TIE_TOLERANCE):
                best = (error, coefficients)
    assert best is not None, "a single feature always has a non-negative fit"
    return [float(c) for c in best[1]]


def fit_chain_cost(points: list[tuple[int, int, float]]) -> StepCost:
    """``(batch, verify tokens, step ms)`` rows of the chain -> ``base + per_token x tokens``."""
    base, per_token = _fit_relative_nonnegative(
        [[1.0, t] for _, t, _ in points], [y for *_, y in points]
    )
    return StepCost(base_ms=base, per_token_ms=per_token)


def fit_tree_cost(points: list[tuple[int, int, float]]) -> StepCost:
    """``(batch, budget, step ms)`` rows of DDTree -> the four-term ``StepCost``."""
    features = [[1.0, n, n * (1 + b), n * b * b] for n, b, _ in points]
    base, per_request, per_token, per_pair = _fit_relative_nonnegative(
        features, [y for *_, y in points]
    )
    return StepCost(
        base_ms=base, per_token_ms=per_token, per_request_ms=per_request, per_node_pair_ms=per_pair
    )


def tree_engine_prefix(engine_names) -> str:
    """The name prefix of a bench's DDTree engines of one runner: ``ddtree_b`` (V1, followed
    by the budget) when the run has any, else ``ddtree_v2_b`` (V2)."""
    return "ddtree_b" if any(n.startswith("ddtree_b") for n in engine_names) else "ddtree_v2_b"


def is_paired_summary(summary: dict) -> bool:
    """Whether ``summary`` is a ``bench_paired.json`` (rows of engines run by turns) rather
    than a ``bench_e2e.json`` (rows per engine)."""
    return isinstance(summary.get("rows"), list)


def bench_from_paired(summary: dict, chain_engine: str = "dflash") -> dict:
    """A ``bench_paired.json`` summary in ``bench_e2e.json``'s layout (``engines[name]["rows"]``
    with ``batch``, ``temperature``, ``tok_per_s``, ``mean_acceptance_length``), for
    ``fit_profile``. Each engine's tok/s in a row is the chain's median times the median of the
    engine's per-round ratios to the chain: engines measured by turns are compared through
    their paired ratios, steadier than each engine's own median (a slow round of the host
    moves every engine of that round alike)."""
    engines: dict[str, dict] = {
        name: {**ready, "rows": []} for name, ready in summary.get("engines", {}).items()
    }
    for row in summary["rows"]:
        chain = row["engines"].get(chain_engine)
        if chain is None:
            continue
        for name, measured in row["engines"].items():
            ratio = row["over_chain"].get(name, {}).get("median")
            if ratio is None:
                continue
            engines.setdefault(name, {"rows": []})["rows"].append(
                {
                    "dataset": row["dataset"],
                    "batch": row["batch"],
                    "temperature": row["temperature"],
                    "tok_per_s": chain["tok_per_s"] * ratio,
                    "mean_acceptance_length": measured["mean_acceptance_length"],
                }
            )
    return {**summary, "engines": engines}


def fit_profile(bench: dict, chain_engine: str = "dflash") -> CostProfile:
    """A profile from a ``bench_e2e.json`` or a ``bench_paired.json`` (``bench_from_paired``):
    its T = 0 rows of ``chain_engine`` and of every ``ddtree_bN`` engine of one runner
    (``ddtree_v2_bN`` when the run has no V1 tree rows)."""
    kind = "bench_e2e"
    if is_paired_summary(bench):
        bench, kind = bench_from_paired(bench, chain_engine), "bench_paired"
    engines = bench["engines"]
    depth = int(bench.get("depth") or 15)

    def rows(name: str) -> list[dict]:
        return [r for r in engines.get(name, {}).get("rows", []) if r["temperature"] == 0]

    def step_ms(r: dict) -> float:
        return 1000.0 * r["batch"] * r["mean_acceptance_length"] / r["tok_per_s"]

    chain_rows = rows(chain_engine)
    if not chain_rows:
        raise ValueError(f"the bench has no T = 0 rows of {chain_engine!r}")
    prefix = tree_engine_prefix(engines)
    tree_rows = {
        int(name.removeprefix(prefix)): rows(name)
        for name in engines
        if name.startswith(prefix) and rows(name)
    }
    if not tree_rows:
        raise ValueError("the bench has no T = 0 rows of a DDTree engine")
    chain = fit_chain_cost([(r["batch"], r["batch"] * (1 + depth), step_ms(r)) for r in chain_rows])
    tree = fit_tree_cost([(r["batch"], b, step_ms(r)) for b, rs in tree_rows.items() for r in rs])
    acceptance = {
        b: statistics.fmean(r["mean_acceptance_length"] for r in rs) for b, rs in tree_rows.items()
    }
    source = (
        f"{kind} at {bench.get('commit', '?')} on {bench.get('gpu', '?')}: "
        f"{bench.get('target_name', '?')} + {bench.get('drafter_name', '?')}"
    )
    return CostProfile(
        source=source,
        depth=depth,
        chain=chain,
        tree=tree,
        chain_acceptance=statistics.fmean(r["mean_acceptance_length"] for r in chain_rows),
        tree_acceptance=acceptance,
        max_batch=max(r["batch"] for r in chain_rows),
    )


def choose_automatic(
    batch: int, runner: str, tensor_parallel_size: int = 1, path: str | None = None
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
    tree_budget, predicted = choose_budget(profile, batch)
    return tree_budget, predicted, profile


def load_profile(path: str | None = None, runner: str = "V1") -> CostProfile:
    """The profile at ``path`` (JSON from ``fit_profile``), by default the packaged one of
    ``runner`` ("V1" or "V2", the vLLM model runner DDTree runs on)."""
    with open(path or PACKAGED_PROFILES[runner]) as f:
        return CostProfile.from_dict(json.load(f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="a bench_e2e.json or a bench_paired.json")
    parser.add_argument("--out", help="write the fitted profile here (JSON)")
    parser.add_argument("--batches", default="1,4,16,64", help="batch sizes to print choices for")
    args = parser.parse_args(argv)
    with open(args.bench) as f:
        profile = fit_profile(json.load(f))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(profile.to_dict(), f, indent=1)
            f.write("\n")
    print(profile.source)
    for batch in (int(b) for b in args.batches.split(",")):
        tree_budget, predicted = choose_budget(profile, batch)
        best = "the DFlash chain" if tree_budget is None else f"tree_budget {tree_budget}"
        shown = ", ".join(f"{k} {v:.0f}" for k, v in predicted.items())
        print(f"batch {batch}: {best} (predicted tok/s: {shown})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
