"""One entry point for every benchmark: ``python -m benchmarks COMMAND [options]``.

Run from the repository root. ``python -m benchmarks COMMAND --help`` lists a command's
options; ``python -m benchmarks`` lists the commands.
"""

from __future__ import annotations

import runpy
import sys

# command -> (module in benchmarks/, what it measures)
COMMANDS = {
    "lossless": ("lossless_gpu", "DDTree against the target alone: the oracle grid (GPU)"),
    "lossless-options": (
        "lossless_options",
        "request options (penalties, bad words, grammars, logprobs) vs target (GPU)",
    ),
    "upstream-gpu": (
        "upstream_gpu",
        "vLLM patched with the upstream series, no plugin: the V2 oracle grid (GPU)",
    ),
    "lossless-pair": ("lossless_pair", "the real SmolLM2 pair against the target alone (GPU)"),
    "lifecycle": ("lifecycle_fuzz", "request lifecycles (joins, aborts, preemption) vs target"),
    "serve-check": ("serve_check", "the OpenAI server answers like the target alone"),
    "speed": ("bench_e2e", "AR vs the DFlash chain vs DDTree, tokens/s (GPU)"),
    "paired": ("bench_paired", "the same, engines by turns, ratios of adjacent runs (GPU)"),
    "kernels": ("bench_tree_attn", "the tree-attention kernel against TRITON_ATTN (GPU)"),
    "kernel-engines": ("tree_attn_vllm_gpu", "vLLM engines with TREE_ATTN (GPU)"),
    "step-ops": ("bench_step_ops", "host and device cost of each tree-step operation (GPU)"),
    "top-candidates": ("bench_top_candidates", "the tree's per-depth candidates (GPU)"),
    "hybrid-ops": (
        "bench_hybrid_ops",
        "a GatedDeltaNet layer's tree ops at a hybrid's shapes (GPU)",
    ),
    "profile": ("profile_step", "where a decode step's time goes (GPU)"),
    "fit-profile": ("fit_cost_profile", 'fit a step-cost profile for "tree_budget": "auto"'),
    "calibrate": ("calibrate_acceptance", "fit the synthetic acceptance model to the paper"),
    "pair-ranks": ("pair_ranks", "the SmolLM2 pair's per-depth ranks and the rank model they fit"),
    "parity": ("acceptance_parity", "DDTree in vLLM against the reference engine, per prompt"),
    "coupled": ("coupled_acceptance", "T > 0 acceptance of coupled and uncoupled trees"),
    "scale-paired": ("scale_paired", "AR, chain and DDTree on a scale model, by turns (GPU)"),
    "scale-model": ("scale_model", "build a random-weight target and drafter at a served shape"),
    "train": ("train_dflash", "train a DFlash drafter for SmolLM2"),
    "pad-heads": ("pad_heads", "zero-pad attention heads so tensor parallelism can split them"),
    "prompts": ("prompts", "write the benchmark prompt sets"),
    "results-index": ("results_index", "regenerate benchmarks/results/README.md from the runs"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: python -m benchmarks COMMAND [options]\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = COMMANDS[argv[0]][0]
    sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
    runpy.run_module(f"benchmarks.{module}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
