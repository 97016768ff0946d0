"""Fit a step-cost profile (``vllm_ddtree.budget.cost_model.CostProfile``) from a bench run.

``python -m benchmarks fit-profile BENCH_JSON [--out profile.json]`` reads a
``bench_e2e.json`` or a ``bench_paired.json`` (through its per-round ratios to the chain),
fits the step costs of the chain and of DDTree (``cost_model``'s docstring says the model) and
the acceptance per budget, and prints what ``"tree_budget": "auto"`` would serve at each batch
size. A packaged profile (``vllm_ddtree/budget/cost_profiles/``) is such a fit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import numpy as np

from vllm_ddtree.budget.cost_model import CostProfile, StepCost, choose_budget

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
