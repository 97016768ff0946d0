"""DDTree through every way vLLM's scheduler drives a request (vLLM-CPU, V1 runner, float32).

Each case runs ``benchmarks/lifecycle_fuzz.py plan``: the target alone, one request at a time, is
the truth; DDTree engines are driven step by step (requests joining mid-decode, aborts,
preemption, chunked prefill, prefix caching, token-budget exhaustion, the drafter skipped near
its length limit). Every greedy request must equal the target alone (an aborted one: a prefix
of it), every seeded sampled request must be identical across DDTree engines, no engine may
fail, and every KV block must be free at the end.
"""

from __future__ import annotations

import json

import pytest

from tests.benchmark_modules import load_benchmark
from tests.vllm_runs import run_helper

pytest.importorskip("vllm")
FUZZ = load_benchmark("lifecycle_fuzz")


def request(
    req_id: str, prompt: list[int], max_tokens: int, arrive: int = 0, **extra
) -> dict[str, object]:
    return {
        "id": req_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "arrive": arrive,
        "abort": None,
        "temperature": 0.0,
        "seed": None,
        "stop_token_ids": [],
        **extra,
    }


def run_plan(target: str, drafter: str, plan: dict, timeout: int = 900) -> dict:
    """``benchmarks/lifecycle_fuzz.py plan`` in a subprocess (vLLM engines keep process-wide
    state); its result. The subprocess runs without torch.compile (``TORCH_COMPILE_DISABLE``;
    the plans check the scheduler and the tree step, not compiled code): with it, about one
    plan in eight of a ``CI=true`` run died in an endless recursion through torch's tensor
    printing during garbage collection, in a process that had compiled kernels; without it,
    24 plans in six such runs did not. A run whose interpreter crashed is still run once more
    (a warning with the crash's head); a second crash fails the test."""
    args = ("plan", target, drafter, json.dumps(plan))
    return run_helper(
        "-m benchmarks.lifecycle_fuzz",
        *args,
        timeout=timeout,
        rerun_after_interpreter_crash=True,
        env={"TORCH_COMPILE_DISABLE": "1"},
    )[0]


def check_lifecycle(result: dict) -> None:
    """The invariants every run of a plan must keep (``lifecycle_fuzz.failures``)."""
    assert FUZZ.failures(result) == []


@pytest.mark.vllm_engine
def test_a_one_token_request_joining_mid_decode(tiny_target_path, tiny_drafter_path):
    """vLLM pads a new 1-token request into a speculative row (``pad_spec_decode``: drafts
    of -1) while others decode: it has no tree and must decode plainly (the engine raised
    "scheduled with drafts but has no tree" before)."""
    requests = [
        request("a", [1, 2, 3], 40),
        request("b", [5, 6, 7, 8], 40),
        request("c", [9, 10], 40),
        request("d", [42], 20, arrive=3),
    ]
    plan = {"requests": requests, "runs": [{"name": "b8", "budget": 8}]}
    check_lifecycle(run_plan(tiny_target_path, tiny_drafter_path, plan))


@pytest.mark.vllm_engine
def test_requests_left_out_by_the_token_budget(tiny_target_path, tiny_drafter_path):
    """155 tokens a step for four requests of 1 + 32 rows: one is left out of each step and
    keeps the drafts of its last scheduled step; it verifies its own tree when it comes back
    (the engine raised "scheduled with drafts but has no tree" before)."""
    requests = [request(f"r{i}", [3 + i, 4, 5 + i], n) for i, n in enumerate([8, 48, 48, 48])]
    plan = {
        "engine": {"max_num_batched_tokens": 155},
        "requests": requests,
        "runs": [{"name": "b32", "budget": 32}],
    }
    result = run_plan(tiny_target_path, tiny_drafter_path, plan)
    check_lifecycle(result)
    run = result["runs"]["b32"]
    assert run["accepted"] > 2 * run["drafts"], run  # the oracle's trees, verified


@pytest.mark.vllm_engine
def test_the_drafter_skipped_near_its_length_limit(tiny_target_path, tiny_drafter_path):
    """A drafter limited to 64 positions, a target to 256: once a request nears 64, vLLM
    drafts nothing for the whole batch and schedules zeros as drafts; no tree may be verified
    against them (the previous step's trees were, and outputs diverged)."""
    lengths, max_tokens = [20, 30, 41, 52], [48, 80, 100, 120]
    requests = [
        request(f"r{i}", [100 * i + 1, *range(2, n + 1)], m)
        for i, (n, m) in enumerate(zip(lengths, max_tokens, strict=True))
    ]
    limit = {"max_model_len": 64}
    plan = {
        "requests": requests,
        "runs": [
            {"name": "b8", "budget": 8, "speculative": limit},
            {"name": "b8_random", "budget": 8, "drafter": "random", "speculative": limit},
        ],
    }
    check_lifecycle(run_plan(tiny_target_path, tiny_drafter_path, plan))


@pytest.mark.vllm_engine
def test_the_drafter_writes_only_inside_its_requests_blocks(tiny_target_path, tiny_drafter_path):
    """Trees narrower than the drafter is deep (budgets 2 and 4, depth 15) under a small KV
    cache (preemptions): vLLM reserved ``budget + 1`` slots past a step for a drafter that
    writes ``depth`` queries past the accepted path, so its K/V landed in the null block or in
    other requests' blocks (``step_checks`` raised "the drafter writes K/V past its request's
    blocks" before)."""
    fuzz = {"seed": 1, "num_requests": 16, "vocab_size": 1024, "max_model_len": 256}
    fuzz.update(arrival_steps=1, abort_fraction=0.0, sampled_fraction=0.0)
    plan = {
        "engine": {"num_gpu_blocks_override": 24, "block_size": 32, "max_num_seqs": 8},
        "fuzz": fuzz,
        "runs": [{"name": "b2", "budget": 2}, {"name": "b4", "budget": 4}],
    }
    result = run_plan(tiny_target_path, tiny_drafter_path, plan)
    check_lifecycle(result)
    assert all(run["preemptions"] > 0 for run in result["runs"].values()), result["runs"]


RUNS = [
    {"name": "b2", "budget": 2},
    {"name": "b8", "budget": 8},
    {"name": "b32", "budget": 32},
    {"name": "b8_random_drafter", "budget": 8, "drafter": "random"},
]
FUZZ_ENGINES = {
    # Chunked prefill under a small token budget, prefix caching, a small KV cache (preemption
    # and recompute); greedy requests only: vLLM-CPU's chunked prefill of a seeded request
    # fails in vLLM itself ("CPU Generator does not use offset"), with or without DDTree.
    "chunked_greedy": (
        {"seed": 0, "sampled_fraction": 0.0},
        {"num_gpu_blocks_override": 16, "max_num_batched_tokens": 96, "max_num_seqs": 6},
    ),
    # Whole prefills, 30% of the requests sampled with seeds. Without chunking a prompt waits
    # until it fits the token budget less vLLM's drafting reserve (max_num_seqs x depth): 512.
    "whole_prefill_sampled": (
        {"seed": 1, "sampled_fraction": 0.3},
        {
            "num_gpu_blocks_override": 12,
            "max_num_batched_tokens": 512,
            "max_num_seqs": 8,
            "enable_chunked_prefill": False,
        },
    ),
}


@pytest.mark.vllm_engine
@pytest.mark.parametrize("setting", sorted(FUZZ_ENGINES))
def test_lifecycle_fuzz(tiny_target_path, tiny_drafter_path, setting):
    """A seeded random schedule (24 requests: 1-token to near-``max_model_len`` prompts,
    repeated prompts under prefix caching, stop tokens, aborts, arrivals while others decode)
    through DDTree at budgets 2, 8 and 32 with the oracle drafter and at 8 with a random one,
    every step's invariants checked: see ``check_lifecycle``."""
    fuzz, engine = FUZZ_ENGINES[setting]
    fuzz = {"num_requests": 24, "vocab_size": 1024, "max_model_len": 256, **fuzz}
    engine = {"block_size": 32, "enable_prefix_caching": True, **engine}
    plan = {"engine": engine, "fuzz": fuzz, "runs": RUNS}
    result = run_plan(tiny_target_path, tiny_drafter_path, plan)
    check_lifecycle(result)
    runs = result["runs"]
    assert sum(run["preemptions"] for run in runs.values()) > 0, runs
    assert any(r["abort"] is not None for r in result["requests"])


@pytest.mark.vllm_engine
@pytest.mark.parametrize("setting", sorted(FUZZ_ENGINES))
def test_lifecycle_fuzz_with_auto_moving_its_budget(
    tiny_target_path, tiny_drafter_path, tmp_path, setting
):
    """The fuzz's schedules through "auto" that moves its budget online (a profile favouring
    trees starts it at 16; a random drafter's trees take it down, the oracle's keep it up):
    every invariant holds while the scheduler's budgets change under joins, aborts and
    preemptions."""
    from tests.profiles import write_cheap_tree_profile

    online = {"tree_budget": "auto", "cost_profile": write_cheap_tree_profile(tmp_path)}
    fuzz, engine = FUZZ_ENGINES[setting]
    fuzz = {"num_requests": 24, "vocab_size": 1024, "max_model_len": 256, **fuzz}
    engine = {"block_size": 32, "enable_prefix_caching": True, **engine}
    runs = [
        {"name": "auto", "budget": 16, "speculative": online},
        {"name": "auto_random_drafter", "budget": 16, "speculative": online, "drafter": "random"},
    ]
    result = run_plan(
        tiny_target_path, tiny_drafter_path, {"engine": engine, "fuzz": fuzz, "runs": runs}
    )
    check_lifecycle(result)
    random_run = result["runs"]["auto_random_drafter"]
    assert random_run["draft_tokens"] < 16 * random_run["drafts"], random_run


# The hybrid fuzz's settings (seed, max_model_len, share of seeded sampled requests, engine):
# vLLM's plain state layout, whole prefills, a pool too large to preempt (a hybrid request takes
# its state blocks when it starts); and with prefix caching (vLLM's align layout, which needs
# chunked prefill: chunks end on state-block boundaries) on a pool small enough to preempt
# (requests crossing a state block need one more as they decode), greedy only (vLLM-CPU's
# chunked prefill of a seeded request fails in vLLM itself, see FUZZ_ENGINES).
HYBRID_FUZZ_ENGINES = {
    "plain": (2, 256, 0.3, {"num_gpu_blocks_override": 40, "enable_chunked_prefill": False}),
    "prefix_caching": (
        2,
        768,
        0.0,
        {
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
            "num_gpu_blocks_override": 46,
        },
    ),
}


@pytest.mark.vllm_engine
@pytest.mark.parametrize("setting", sorted(HYBRID_FUZZ_ENGINES))
def test_lifecycle_fuzz_on_a_hybrid_target(tmp_path, setting):
    """The fuzz on a GatedDeltaNet hybrid: the shrunk Qwen3.6-27B-shaped scale model, its
    predictable build (its target-alone output holds in bf16, which vLLM-CPU's GDN kernels
    take), served with DDTree's hybrid settings; requests join and leave mid-decode, some
    sampled with seeds, some run into ``max_model_len``, where steps of plain decodes killed
    the engine before (``test_hybrid_requests_decode_without_trees_near_max_model_len``); with
    prefix caching, in vLLM's align layout, requests are preempted and resumed
    (``HYBRID_FUZZ_ENGINES``; cache hits: ``test_vllm_hybrid_prefix_caching.py``)."""
    from vllm_ddtree.config import HYBRID_ENGINE_ARGS
    from vllm_ddtree.testing.scale_models import QWEN3_6_27B, build

    target, drafter = build(QWEN3_6_27B.shrunk(16).predictable(), str(tmp_path))
    seed, max_model_len, sampled_fraction, layout = HYBRID_FUZZ_ENGINES[setting]
    engine = {
        **HYBRID_ENGINE_ARGS,
        "dtype": "bfloat16",
        "language_model_only": True,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 512,
        "max_model_len": max_model_len,
        **layout,
    }
    fuzz = {"seed": seed, "num_requests": 16, "vocab_size": 1024, "max_model_len": max_model_len}
    fuzz["sampled_fraction"] = sampled_fraction
    runs = [{"name": "b4", "budget": 4}, {"name": "b16", "budget": 16}]
    result = run_plan(target, drafter, {"engine": engine, "fuzz": fuzz, "runs": runs})
    check_lifecycle(result)
    requests = result["requests"]
    assert any(r["abort"] is not None for r in requests)
    assert any(r["temperature"] > 0 for r in requests) == (sampled_fraction > 0)
    assert any(len(r["prompt"]) + r["max_tokens"] >= max_model_len - 6 for r in requests)
    if setting == "prefix_caching":
        runs = result["runs"]
        assert sum(run["preemptions"] for run in runs.values()) > 0, runs
