"""A step-cost model fitted from ``benchmarks/bench_e2e.py`` results, and the budget it picks.

Decode speed with speculation is ``batch x acceptance(budget) / step_ms``: every target
forward (one step) emits ``acceptance`` tokens per request. The model keeps, from one bench
run on one GPU and one target/drafter pair:

- ``step_ms = base_ms + per_request_ms x batch + per_token_ms x verify tokens`` per kind of
  step (least squares over the run's T = 0 rows; verify tokens = batch x (1 + tree budget) for
  DDTree, batch x (1 + depth) for the DFlash chain); ``base_ms`` holds the drafter pass and the
  per-step overheads of the runner that kind ran on, ``per_request_ms`` what each request adds
  whatever its tree (the tree step's per-request work; for the chain, whose verify tokens are a
  fixed multiple of the batch, it is folded into ``per_token_ms``);
- the mean acceptance length of the chain and of DDTree at each measured budget, interpolated
  in log2(budget) between them.

``choose_budget`` returns the budget (among the candidates inside the measured budget range:
acceptance is not extrapolated) with the highest predicted tokens/s at a batch size (the
smallest budget among those predicted within ``NEAR_TIE`` of it), or
None unless a tree is predicted at least ``MIN_PREDICTED_GAIN`` times as fast as the chain
(``"tree_budget": "auto"`` then serves the DFlash chain). The numbers are the measured pair's;
another pair or GPU needs its own profile (``python -m vllm_ddtree.cost_model FIT
bench_e2e.json --out profile.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass

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
    """``step_ms = base_ms + per_request_ms * batch + per_token_ms * tokens`` for one kind of
    step (``tokens``: the step's verify tokens over its ``batch`` requests)."""

    base_ms: float
    per_token_ms: float
    per_request_ms: float = 0.0

    def step_ms(self, tokens: int, batch: int = 1) -> float:
        return self.base_ms + self.per_request_ms * batch + self.per_token_ms * tokens


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

    def acceptance(self, budget: int) -> float:
        """Tokens per DDTree step at ``budget``: linear in log2(budget) between measured
        budgets, the nearest measured value outside them."""
        points = sorted(self.tree_acceptance.items())
        if budget <= points[0][0]:
            return points[0][1]
        if budget >= points[-1][0]:
            return points[-1][1]
        for (b0, a0), (b1, a1) in zip(points, points[1:], strict=False):
            if b0 <= budget <= b1:
                t = (math.log2(budget) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return a0 + t * (a1 - a0)
        raise AssertionError("unreachable")

    def tree_tokens_per_s(self, budget: int, batch: int) -> float:
        step = self.tree.step_ms(batch * (1 + budget), batch)
        return 1000.0 * batch * self.acceptance(budget) / step

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
    for budget in candidates:
        predicted[f"b{budget}"] = profile.tree_tokens_per_s(budget, batch)
    fastest = max(predicted[f"b{b}"] for b in candidates)
    if fastest < MIN_PREDICTED_GAIN * predicted["chain"]:
        return None, predicted
    tied = [b for b in candidates if predicted[f"b{b}"] >= (1 - NEAR_TIE) * fastest]
    return min(tied), predicted


def _fit_line(points: list[tuple[float, float]]) -> StepCost:
    """Least-squares ``y = a + b x`` (``b`` >= 0: more verify tokens never cost less)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    slope = max(slope, 0.0)
    return StepCost(base_ms=mean_y - slope * mean_x, per_token_ms=slope)


def _fit_plane(points: list[tuple[float, float, float]]) -> StepCost:
    """Least-squares ``y = a + b x + c n`` over ``(x = verify tokens, n = batch, y = step ms)``
    with ``b``, ``c`` >= 0: the unconstrained fit when both slopes come out non-negative, else the
    better (smaller squared error) of the lines in ``x`` alone and in ``n`` alone."""
    by_tokens = _fit_line([(x, y) for x, _, y in points])
    by_batch = _fit_line([(n, y) for _, n, y in points])
    candidates = [
        by_tokens,
        StepCost(base_ms=by_batch.base_ms, per_token_ms=0.0, per_request_ms=by_batch.per_token_ms),
    ]
    mean_x, mean_n, mean_y = (statistics.fmean(p[i] for p in points) for i in range(3))
    sxx = sum((x - mean_x) ** 2 for x, _, _ in points)
    snn = sum((n - mean_n) ** 2 for _, n, _ in points)
    sxn = sum((x - mean_x) * (n - mean_n) for x, n, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, _, y in points)
    sny = sum((n - mean_n) * (y - mean_y) for _, n, y in points)
    det = sxx * snn - sxn * sxn
    if det > 1e-9 * max(sxx * snn, 1e-30):  # tokens and batch separable
        per_token = (snn * sxy - sxn * sny) / det
        per_request = (sxx * sny - sxn * sxy) / det
        if per_token >= 0 and per_request >= 0:
            candidates.append(
                StepCost(
                    base_ms=mean_y - per_token * mean_x - per_request * mean_n,
                    per_token_ms=per_token,
                    per_request_ms=per_request,
                )
            )

    def squared_error(cost: StepCost) -> float:
        return sum((cost.step_ms(x, n) - y) ** 2 for x, n, y in points)

    return min(candidates, key=squared_error)


def tree_engine_prefix(engine_names) -> str:
    """The name prefix of a bench's DDTree engines of one runner: ``ddtree_b`` (V1, followed
    by the budget) when the run has any, else ``ddtree_v2_b`` (V2)."""
    return "ddtree_b" if any(n.startswith("ddtree_b") for n in engine_names) else "ddtree_v2_b"


def fit_profile(bench: dict, chain_engine: str = "dflash") -> CostProfile:
    """A profile from a ``bench_e2e.json`` (its T = 0 rows of ``chain_engine`` and of every
    ``ddtree_bN`` engine of one runner; ``ddtree_v2_bN`` when the run has no V1 tree rows)."""
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
    chain = _fit_line([(r["batch"] * (1 + depth), step_ms(r)) for r in chain_rows])
    tree = _fit_plane(
        [(r["batch"] * (1 + b), r["batch"], step_ms(r)) for b, rs in tree_rows.items() for r in rs]
    )
    acceptance = {
        b: statistics.fmean(r["mean_acceptance_length"] for r in rs) for b, rs in tree_rows.items()
    }
    source = (
        f"bench_e2e at {bench.get('commit', '?')} on {bench.get('gpu', '?')}: "
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
    budget, predicted = choose_budget(profile, batch)
    return budget, predicted, profile


def load_profile(path: str | None = None, runner: str = "V1") -> CostProfile:
    """The profile at ``path`` (JSON from ``fit_profile``), by default the packaged one of
    ``runner`` ("V1" or "V2", the vLLM model runner DDTree runs on)."""
    with open(path or PACKAGED_PROFILES[runner]) as f:
        return CostProfile.from_dict(json.load(f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="a bench_e2e.json")
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
        budget, predicted = choose_budget(profile, batch)
        best = "the DFlash chain" if budget is None else f"tree_budget {budget}"
        shown = ", ".join(f"{k} {v:.0f}" for k, v in predicted.items())
        print(f"batch {batch}: {best} (predicted tok/s: {shown})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
