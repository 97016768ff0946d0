"""Fit the synthetic acceptance model to published acceptance lengths.

``python -m benchmarks calibrate --out DIR`` fits ``RankModel``
(``vllm_ddtree/testing/synthetic_acceptance.py``) so that simulated blocks of 15 draft depths
give the DDTree paper's DFlash numbers for Qwen3-8B (Ringel & Romano 2026): first the shape
(how P(ranked first) decays with depth, where a missed token ranks, how confident the drafter
is) on MATH-500, where the paper gives the chain and DDTree at every budget; then, with that
shape, ``p_top`` per dataset and temperature from the chain's number alone, with the tree's
emerging acceptance set beside the paper's best. Writes ``calibration.json`` (the models and
how far each lands) and ``calibration.md``.

The fit is a coordinate search over the parameters in an unbounded form, every evaluation on
the same random blocks (common random numbers), so it is deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace

from benchmarks.common import git_commit
from vllm_ddtree.testing.synthetic_acceptance import RankModel, simulate

BUDGETS = [16, 32, 64, 128, 256, 512]
# The DDTree paper's acceptance lengths for Qwen3-8B with its DFlash drafter.
PAPER = {
    "math500": {
        "chain": 7.79,
        "b16": 8.61,
        "b32": 9.27,
        "b64": 9.75,
        "b128": 10.20,
        "b256": 10.43,
        "b512": 10.73,
    },
    "humaneval": {"chain": 6.61, "best": 9.67},
    "mtbench": {"chain": 4.28, "best": 6.58},
}
PAPER_T1_CHAIN = {"humaneval": 5.48, "math500": 6.46, "mtbench": 3.77}


def _to_free(model: RankModel) -> list[float]:
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    return [
        logit(model.p_top),
        logit(model.decay),
        logit(model.tail),
        math.log(model.slope),
        math.log(model.miss_slope),
    ]


def _from_free(x: list[float]) -> RankModel:
    sigmoid = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    return RankModel(
        p_top=sigmoid(x[0]),
        decay=sigmoid(x[1]),
        tail=sigmoid(x[2]),
        slope=math.exp(x[3]),
        miss_slope=math.exp(x[4]),
    )


def relative_error(simulated: dict, target: dict) -> float:
    return sum(((simulated[k] - v) / v) ** 2 for k, v in target.items())


def coordinate_search(loss, x: list[float], free: list[int], step: float = 0.5, rounds=12):
    """Minimise ``loss(x)`` over the coordinates ``free`` (steps halve when none helps)."""
    best = loss(x)
    for _ in range(rounds):
        improved = False
        for i in free:
            for sign in (1, -1):
                trial = list(x)
                trial[i] += sign * step
                value = loss(trial)
                if value < best:
                    best, x, improved = value, trial, True
                    break
        if not improved:
            step /= 2
            if step < 0.02:
                break
    return x, best


def fit(rounds: int, seed: int) -> dict:
    def simulated(model: RankModel, budgets=BUDGETS) -> dict:
        return simulate(model, budgets, rounds=rounds, seed=seed)

    start = RankModel(p_top=0.9, decay=0.99, tail=0.8, slope=3.0, miss_slope=1.0)
    shape_x, shape_loss = coordinate_search(
        lambda x: relative_error(simulated(_from_free(x)), PAPER["math500"]),
        _to_free(start),
        free=[0, 1, 2, 3, 4],
    )
    shape = _from_free(shape_x)
    results = {"math500": {"model": shape.to_dict(), "simulated": simulated(shape)}}

    def p_top_for(chain: float) -> RankModel:
        # The chain's acceptance is exact in p_top (RankModel.chain_acceptance): bisection.
        low, high = 1e-4, 1 - 1e-6
        for _ in range(60):
            mid = (low + high) / 2
            if replace(shape, p_top=mid).chain_acceptance() < chain:
                low = mid
            else:
                high = mid
        return replace(shape, p_top=(low + high) / 2)

    for name in ("humaneval", "mtbench"):
        model = p_top_for(PAPER[name]["chain"])
        sim = simulated(model)
        results[name] = {"model": model.to_dict(), "simulated": sim}
    for name, chain in PAPER_T1_CHAIN.items():
        model = p_top_for(chain)
        results[f"{name}_t1"] = {"model": model.to_dict(), "simulated": simulated(model)}
    return {"shape_loss": shape_loss, "profiles": results}


def report(found: dict) -> str:
    lines = [
        "| profile | p_top | decay | tail | slope | miss slope | chain (paper) | "
        "best tree, budget (paper) | MATH-500 budgets b16..b512 (paper) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, entry in found["profiles"].items():
        m, sim = entry["model"], entry["simulated"]
        base = name.removesuffix("_t1")
        paper = PAPER.get(base, {}) if not name.endswith("_t1") else {}
        chain_paper = PAPER_T1_CHAIN[base] if name.endswith("_t1") else paper.get("chain")
        best = max(BUDGETS, key=lambda b: sim[f"b{b}"])
        best_paper = paper.get("best", paper.get("b512", "—"))
        curve = " / ".join(f"{sim[f'b{b}']:.2f}" for b in BUDGETS)
        if name == "math500":
            curve += " (" + " / ".join(f"{paper[f'b{b}']:.2f}" for b in BUDGETS) + ")"
        lines.append(
            f"| {name} | {m['p_top']:.4f} | {m['decay']:.4f} | {m['tail']:.3f} | "
            f"{m['slope']:.2f} | {m['miss_slope']:.2f} | {sim['chain']:.2f} ({chain_paper}) | "
            f"{sim[f'b{best}']:.2f}, b{best} ({best_paper}) | {curve} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=600, help="simulated blocks per evaluation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.time()
    found = fit(args.rounds, args.seed)
    found.update(
        commit=git_commit(),
        rounds=args.rounds,
        seed=args.seed,
        budgets=BUDGETS,
        paper=PAPER,
        paper_t1_chain=PAPER_T1_CHAIN,
        seconds=round(time.time() - started, 1),
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(found, f, indent=1)
    table = report(found)
    with open(os.path.join(args.out, "calibration.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
