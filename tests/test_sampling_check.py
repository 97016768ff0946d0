"""The GPU sampling check's scoring (``benchmarks/lossless_gpu.py``): what it passes and fails,
and ``--score-sampling`` from the engines' result files a cut-short run leaves behind."""

import json
import random

from tests.benchmark_modules import load_benchmark

lossless_gpu = load_benchmark("lossless_gpu")


def draws(seed: int, weights: list[float], repeats: int = 400) -> list[list[int]]:
    rng = random.Random(seed)
    tokens = range(len(weights))
    return [rng.choices(tokens, weights, k=4) for _ in range(repeats)]


def test_same_distribution_passes_and_another_fails():
    target = draws(0, [5, 3, 1, 1])
    same = draws(1, [5, 3, 1, 1])
    other = draws(2, [1, 1, 3, 5])
    rows = lossless_gpu.sampling_positions(target, same, vocab_size=8)
    assert [r["token"] for r in rows] == [1, 2, 3]
    assert all(r["distinct_tokens"] == 4 for r in rows)
    assert lossless_gpu.sampling_passed(rows, accepted_tokens=100)
    assert not lossless_gpu.sampling_passed(rows, accepted_tokens=0)  # no tree was tested
    assert not lossless_gpu.sampling_passed(
        lossless_gpu.sampling_positions(target, other, vocab_size=8), accepted_tokens=100
    )
    assert not lossless_gpu.sampling_passed([{"error": ["engine died"]}], accepted_tokens=100)


def test_score_sampling_reads_a_work_folder(tmp_path):
    results = {
        "sampling_target": {"sampled": draws(0, [5, 3, 1, 1])},
        "sampling_ddtree": {
            "sampled": draws(1, [5, 3, 1, 1]),
            "metrics": {"vllm:spec_decode_num_accepted_tokens": 321},
            "runner": "V1",
            "cudagraph_mode": "PIECEWISE",
            "async_scheduling": True,
        },
    }
    for name, result in results.items():
        with open(tmp_path / f"{name}.job.json.result", "w") as f:
            json.dump(result, f)
    scored = lossless_gpu.score_sampling(str(tmp_path), vocab_size=8)
    assert scored["passed"] and scored["repeats"] == 400
    assert scored["ddtree_accepted_tokens"] == 321
    assert scored["ddtree_engine"] == {
        "runner": "V1",
        "cudagraph_mode": "PIECEWISE",
        "async_scheduling": True,
    }
