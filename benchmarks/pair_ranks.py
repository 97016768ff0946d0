"""Per-depth ranks of a real pair's drafter, and the synthetic-acceptance profile they fit.

The scale models' acceptance is synthetic (``vllm_ddtree/testing/synthetic_acceptance.py``):
where the target's token ranks among the drafter's candidates, per depth. ``calibrate`` fits
that model to the DDTree paper's published acceptance lengths (a strong drafter); this fits it
to what a real, weak pair does: the SmolLM2-135M-Instruct target and this project's DFlash
drafter (``drafters/``), float32 on this machine, T = 0.

The pair decodes held-out chat prompts through the reference engine
(``vllm_ddtree/reference.py``, DDTree at ``--budget``; lossless, so its output is the target's
own continuation). Every round, the drafter's per-depth logits are kept; afterwards the
target's token at each predicted position is ranked in them. From those ranks:

* ``p_top`` and ``decay``: least squares of ``p_top x decay^(d-1)`` against the share ranked
  first at depth ``d`` among rounds ranked first at every shallower depth (what the chain
  accepts), weighted by those rounds;
* ``tail``: the geometric ratio of the rank below the first, from the share ranked second
  where not first (``1 - tail``): the near ranks are the ones a tree catches;
* ``slope`` / ``miss_slope``: the drafter's mean logit drop from its first to its second
  candidate where it ranks the target's token first / where it does not.

The fitted model's simulated acceptance (``simulate``: real tree builds and walks) is set
beside the reference engine's measured acceptance at each of ``--budgets`` on the same prompts.

    python -m benchmarks pair-ranks --prompts 8 --max-tokens 96 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.common import git_commit
from vllm_ddtree import envs


class RecordingDraftSource:
    """A draft source that keeps every round's logits and the bonus position they follow."""

    def __init__(self, source):
        self.source = source
        self.depth = source.depth
        self.rounds: list[tuple[int, object]] = []  # (bonus position, float [depth, V])

    def feature_layers(self) -> list[int]:
        return self.source.feature_layers()

    def reset(self) -> None:
        self.source.reset()

    def extend_context(self, token_ids, features, positions) -> None:
        self.source.extend_context(token_ids, features, positions)

    def draft_logits(self, bonus_token: int, position: int):
        logits = self.source.draft_logits(bonus_token, position)
        self.rounds.append((position, logits.detach().cpu()))
        return logits


def rank_rows(rounds, sequence: list[int]) -> list[dict]:
    """Per round and depth where the sequence goes on: the round's index, the target's token's
    rank (0 = first) and the drafter's logit drop from its first to its second candidate."""
    import torch

    rows = []
    for index, (position, logits) in enumerate(rounds):
        for d in range(logits.shape[0]):
            at = position + 1 + d
            if at >= len(sequence):
                break
            row = logits[d]
            truth = sequence[at]
            rank = int((row > row[truth]).sum())
            top2 = torch.topk(row, 2).values
            gap = float(top2[0] - top2[1])
            rows.append({"round": index, "depth": d + 1, "rank": rank, "gap": gap})
    return rows


def first_after_first(rows: list[dict], depth: int) -> tuple[list[float], list[int]]:
    """Per depth ``d``: among rounds whose target tokens ranked first at every depth above
    ``d``, the share ranked first at ``d`` too, and how many such rounds there were. The chain
    accepts depth ``d`` exactly then, and the model draws its depths independently, so this
    conditional share (not the marginal) is what its ``P(first)`` must be."""
    by_round: dict[tuple, dict[int, int]] = {}
    for r in rows:
        by_round.setdefault((r.get("prompt", 0), r["round"]), {})[r["depth"]] = r["rank"]
    shares, counts = [], []
    for d in range(1, depth + 1):
        reached = [
            ranks
            for ranks in by_round.values()
            if d in ranks and all(ranks.get(e) == 0 for e in range(1, d))
        ]
        counts.append(len(reached))
        shares.append(sum(ranks[d] == 0 for ranks in reached) / len(reached) if reached else 0.0)
    return shares, counts


def fit_rank_model(rows: list[dict], depth: int):
    """The ``RankModel`` the rank rows fit (module docstring), with the per-depth share ranked
    first after first (``first_after_first``) and its counts."""
    import numpy as np

    from vllm_ddtree.testing.synthetic_acceptance import RankModel

    shares, counts = first_after_first(rows, depth)
    measured, weight = np.array(shares), np.array(counts, dtype=float)
    best = None
    for p_top in np.linspace(0.01, 0.999, 200):
        for decay in np.linspace(0.5, 1.0, 101):
            model = p_top * decay ** np.arange(depth)
            loss = float(np.sum(weight * (model - measured) ** 2))
            if best is None or loss < best[0]:
                best = (loss, float(p_top), float(decay))
    missed = [r["rank"] for r in rows if r["rank"] > 0]
    second = sum(rank == 1 for rank in missed) / len(missed) if missed else 1.0
    sure = [r["gap"] for r in rows if r["rank"] == 0]
    unsure = [r["gap"] for r in rows if r["rank"] > 0]
    model = RankModel(
        p_top=best[1],
        decay=best[2],
        tail=min(1.0 - second, 1.0 - 1e-6),
        slope=sum(sure) / len(sure) if sure else 3.0,
        miss_slope=sum(unsure) / len(unsure) if unsure else 1.0,
    )
    return model, shares, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--budget", type=int, default=64, help="the reference run that ranks")
    parser.add_argument("--budgets", default="16,32,64,128", help="measured and simulated")
    parser.add_argument("--rounds", type=int, default=2000, help="simulated drafter blocks")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    started = time.time()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ddtree.demo import (
        DEFAULT_CACHE,
        TRAINED_DRAFTER,
        humaneval_chat_prompts,
        prepare_smollm2,
    )
    from vllm_ddtree.dflash_drafter import DFlashDrafter
    from vllm_ddtree.reference import DDTreeReference, DFlashDraftSource
    from vllm_ddtree.testing.synthetic_acceptance import simulate

    torch.manual_seed(0)
    target_path = prepare_smollm2(envs.cache_dir(DEFAULT_CACHE))
    prompts = humaneval_chat_prompts(AutoTokenizer.from_pretrained(target_path), args.prompts)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    drafter = DFlashDrafter.from_pretrained(TRAINED_DRAFTER).eval()
    budgets = [int(b) for b in args.budgets.split(",") if b]

    rows, measured = [], {}
    for budget in sorted(set(budgets) | {args.budget}):
        lengths = []
        for prompt_index, prompt in enumerate(prompts):
            source = RecordingDraftSource(DFlashDraftSource(drafter, target))
            engine = DDTreeReference(target, source, tree_budget=budget)
            out = engine.generate(prompt, args.max_tokens, eos_token_id=None)
            lengths += out.acceptance_lengths
            if budget == args.budget:
                ranked = rank_rows(source.rounds, list(prompt) + list(out.token_ids))
                rows += [dict(r, prompt=prompt_index) for r in ranked]
        measured[f"b{budget}"] = sum(lengths) / len(lengths)
    depth = drafter.config.block_size - 1
    model, first, reached = fit_rank_model(rows, depth)
    simulated = simulate(model, budgets, rounds=args.rounds, depth=depth)
    result = {
        "commit": git_commit(),
        "device": "cpu",
        "pair": "SmolLM2-135M-Instruct + drafters/SmolLM2-135M-Instruct-DFlash, float32, T = 0",
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "ranked_with_budget": args.budget,
        "ranked_positions": len(rows),
        "p_first_after_first_by_depth": first,
        "rounds_reaching_depth": reached,
        "model": model.to_dict(),
        "measured_acceptance": measured,
        "simulated_acceptance": simulated,
        "seconds": time.time() - started,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pair_ranks.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        "# The SmolLM2 pair's per-depth ranks and the rank model they fit",
        "",
        f"Commit {result['commit'][:7]}, CPU, {result['pair']}; {args.prompts} HumanEval chat "
        f"prompts x {args.max_tokens} tokens, ranks from the reference engine at budget "
        f"{args.budget} ({len(rows)} ranked positions).",
        "",
        "Share ranked first at depth d among rounds ranked first above d, by depth (those "
        "rounds): " + ", ".join(f"{p:.3f} ({n})" for p, n in zip(first, reached, strict=True)),
        "",
        "Fitted model: " + ", ".join(f"{k} {v:.4g}" for k, v in model.to_dict().items()),
        "",
        "| acceptance length | chain | " + " | ".join(f"b{b}" for b in budgets) + " |",
        "| --- | --- | " + " | ".join("---" for _ in budgets) + " |",
        "| reference engine (measured) | - | "
        + " | ".join(f"{measured[f'b{b}']:.2f}" for b in budgets)
        + " |",
        f"| rank model (simulated) | {simulated['chain']:.2f} | "
        + " | ".join(f"{simulated[f'b{b}']:.2f}" for b in budgets)
        + " |",
    ]
    with open(os.path.join(args.out, "pair_ranks.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
