"""benchmarks/coupled_acceptance.py: its engines, acceptance lengths and report (no engine)."""

import argparse
import json
import os

from benchmarks.coupled_acceptance import (
    CHAIN,
    acceptance_length,
    engine_specs,
    eval_texts,
    first_divergence,
    main,
    measured_commit,
    memory_limits,
    summarize,
    write_report,
)
from vllm_ddtree.envs import COUPLED_DRAFTS as COUPLED_DRAFTS_ENV


def test_engines_are_the_chain_then_coupled_and_uncoupled_per_budget():
    specs = engine_specs("drafter", [16, 64])
    assert [s["name"] for s in specs] == [
        CHAIN,
        "ddtree_b16_coupled",
        "ddtree_b16_uncoupled",
        "ddtree_b64_coupled",
        "ddtree_b64_uncoupled",
    ]
    assert specs[0]["speculative_config"]["method"] == "dflash"
    assert specs[1]["env"] == {COUPLED_DRAFTS_ENV: "1"}
    assert specs[2]["env"] == {COUPLED_DRAFTS_ENV: "0"}
    assert specs[4]["speculative_config"]["tree_budget"] == 64


def test_acceptance_length_is_one_plus_accepted_per_draft():
    metrics = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens": 7}
    assert acceptance_length(metrics) == 1.7
    assert acceptance_length({}) is None


def test_report_says_whether_coupled_and_uncoupled_emitted_the_same(tmp_path):
    def run(tokens, length):
        return {"tokens": tokens, "acceptance_length": length}

    results = {
        "humaneval": {
            CHAIN: run([[1]], 1.1),
            "ddtree_b16_coupled": run([[1, 2]], 2.0),
            "ddtree_b16_uncoupled": run([[1, 2]], 1.5),
        },
        "mtbench": {
            CHAIN: run([[3]], 1.2),
            "ddtree_b16_coupled": run([[3, 4]], 1.9),
            "ddtree_b16_uncoupled": run([[3, 5]], 1.4),
        },
    }
    summary = summarize(results, [16])
    assert summary["humaneval"]["b16_same_tokens"] is True
    assert summary["mtbench"]["b16_same_tokens"] is False
    assert summary["mtbench"]["acceptance_length"]["ddtree_b16_coupled"] == 1.9
    settings = {
        "device_note": "cpu",
        "target_name": "t",
        "drafter_name": "d",
        "dtype": "float32",
        "temperature": 1.0,
        "prompts_per_set": 1,
        "max_tokens": 2,
        "batch": 1,
    }
    report = {"commit": "abc", "settings": settings, "summary": summary, "runs": results}
    write_report(report, str(tmp_path))
    table = (tmp_path / "coupled_acceptance.md").read_text()
    assert "| mtbench | 1.20 | 1.90 | 1.40 | b16: False | b16: 0/1 (1) |" in table
    assert "| humaneval | 1.10 | 2.00 | 1.50 | b16: True | b16: 1/1 |" in table
    with open(os.path.join(tmp_path, "coupled_acceptance.json")) as f:
        assert json.load(f)["summary"] == summary


def test_a_prompts_file_gives_its_held_out_humaneval_and_mtbench_sets(tmp_path):
    path = tmp_path / "prompts.json"
    held_out = {"humaneval": ["def f():"], "mtbench": ["Write a poem."], "sharegpt": ["hi"]}
    path.write_text(json.dumps({"train": ["x"], "eval": held_out}))
    assert eval_texts(str(path)) == {"humaneval": ["def f():"], "mtbench": ["Write a poem."]}


def test_memory_limits_pass_only_what_was_given():
    given = argparse.Namespace(gpu_memory_utilization=0.05, kv_cache_bytes=1 << 30)
    assert memory_limits(given) == {
        "gpu_memory_utilization": 0.05,
        "kv_cache_memory_bytes": 1 << 30,
    }
    unset = argparse.Namespace(gpu_memory_utilization=None, kv_cache_bytes=None)
    assert memory_limits(unset) == {}


def test_the_measured_commit_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("VLLM_DDTREE_COMMIT", "0123abc")
    assert measured_commit() == "0123abc"


def test_first_divergence_is_the_first_differing_position():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_rescore_rewrites_the_summary_from_the_runs(tmp_path):
    def run(tokens):
        return {"tokens": tokens, "acceptance_length": 1.5}

    runs = {
        "humaneval": {
            CHAIN: run([[1, 2], [3, 4]]),
            "ddtree_b8_coupled": run([[1, 2], [3, 4]]),
            "ddtree_b8_uncoupled": run([[1, 2], [3, 9]]),
        }
    }
    report = {
        "commit": "abc",
        "settings": {
            "device_note": "gpu",
            "target_name": "t",
            "drafter_name": "d",
            "dtype": "bfloat16",
            "temperature": 1.0,
            "prompts_per_set": 2,
            "max_tokens": 2,
            "batch": 2,
            "budgets": [8],
        },
        "summary": {},
        "runs": runs,
    }
    source = tmp_path / "old.json"
    source.write_text(json.dumps(report))
    assert main(["--rescore", str(source), "--out", str(tmp_path / "new")]) == 0
    with open(tmp_path / "new" / "coupled_acceptance.json") as f:
        summary = json.load(f)["summary"]["humaneval"]
    assert summary["b8_same_tokens"] is False
    assert summary["b8_identical_sequences"] == [1, 2]
    assert summary["b8_first_divergences"] == [1]
