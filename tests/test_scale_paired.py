"""The scale-model bench's bookkeeping (the run itself needs a GPU: ``scale-paired``)."""

from __future__ import annotations

import os

import pytest

from benchmarks.scale_paired import (
    DATASETS,
    compilation_config,
    identical,
    kv_bytes_per_token,
    on_reference,
    oracle_spec,
    roofline,
    row_roofline,
    token_prompts,
)
from vllm_ddtree.testing.scale_models import QWEN3_6_27B, QWEN3_8B

PROFILE = {"p_top": 0.9, "decay": 1.0, "tail": 0.5, "slope": 3.0, "miss_slope": 1.0}
CALIBRATION = {"profiles": {d + s: {"model": PROFILE} for d in DATASETS for s in ("", "_t1")}}


def test_prompts_are_seeded_distinct_per_mode_and_dataset_and_avoid_special_ids():
    a = token_prompts("greedy", "math500", 3, 16, 151936)
    assert a == token_prompts("greedy", "math500", 3, 16, 151936)
    assert a != token_prompts("sampling", "math500", 3, 16, 151936)
    assert a != token_prompts("greedy", "mtbench", 3, 16, 151936)
    assert max(max(p) for p in a) < 151936 - 1024 and all(len(p) == 16 for p in a)


def test_the_oracle_gives_each_sequence_its_datasets_profile_per_mode():
    pools = {("greedy", "math500"): [[1, 2]], ("sampling", "mtbench"): [[3, 4], [5, 6]]}
    references = {("greedy", "math500"): [[7]], ("sampling", "mtbench"): [[8], [9, 9]]}
    spec = oracle_spec(pools, references, CALIBRATION)
    assert spec["sequences"] == [[1, 2, 7], [3, 4, 8], [5, 6, 9, 9]]
    assert spec["sequence_models"] == ["math500", "mtbench_t1", "mtbench_t1"]
    assert spec["rank_models"]["mtbench_t1"] == PROFILE
    with pytest.raises(ValueError, match="no profile"):
        oracle_spec(pools, references, {"profiles": {}})


def test_outputs_are_compared_with_ar_round_by_round_and_with_the_reference():
    runs = {
        "ar": [{"tokens": [[1, 2, 3]], "prompts": [[0]]}] * 2,
        "dflash": [
            {"tokens": [[1, 2, 3]], "prompts": [[0]]},
            {"tokens": [[1, 5, 3]], "prompts": [[0]]},
        ],
    }
    same = identical(runs)
    assert same["ar"]["identical"] == 2
    assert same["dflash"] == {"identical": 1, "requests": 2, "first_differences": [1]}
    kept = on_reference(runs, {(0,): [1, 2, 9]})
    assert kept == {"ar": pytest.approx(2 / 3), "dflash": pytest.approx(3 / 6)}


def test_the_roofline_counts_weights_kv_and_the_drafter_only_for_speculative_engines():
    floor = {"bandwidth": 1e12, "target": 16e9, "drafter": 2e9, "kv_per_token": 1e5}
    ar = roofline({"speculative": False, "steps": 100}, 1, 1.6, floor, context=1000)
    assert ar["limit_ms"] == pytest.approx(16.1)
    assert ar["step_ms"] == pytest.approx(16.0)
    spec = roofline({"speculative": True, "steps": 10}, 2, 0.5, floor, context=1000)
    assert spec["limit_ms"] == pytest.approx(18.2)
    assert spec["percent_of_limit"] == pytest.approx(100 * 18.2 / 50)
    # Steps: drafts / batch for speculative engines, output tokens / batch for AR.
    answer = {"tokens": [[1] * 8, [1] * 8], "drafts": 6, "seconds": 1.0}
    rows = row_roofline({"ar": [answer], "ddtree_v2_b64": [answer]}, 2, floor, prompt_len=0)
    assert rows["ar"]["step_ms"] == pytest.approx(1e3 / 8)
    assert rows["ddtree_v2_b64"]["step_ms"] == pytest.approx(1e3 / 3)
    assert rows["ar"]["decode_ms"] is None


def test_decode_steps_leave_the_prefills_out():
    """With the row's requests timed at one output token, ``decode_ms`` is the rest of the
    time over the decode steps: a speculative engine's verify steps, AR's tokens less each
    request's first (the prefill's); the roofline's share is taken of it."""
    floor = {"bandwidth": 1e12, "target": 16e9, "drafter": 2e9, "kv_per_token": 0}
    answer = {"tokens": [[1] * 8, [1] * 8], "drafts": 6, "seconds": 1.0}
    prefill = {"ar": 0.4, "ddtree_v2_b64": 0.1}
    runs = {"ar": [answer], "ddtree_v2_b64": [answer]}
    rows = row_roofline(runs, 2, floor, prompt_len=0, prefill_seconds=prefill)
    assert rows["ar"]["step_ms"] == pytest.approx(1e3 / 8)  # unchanged
    assert rows["ar"]["decode_ms"] == pytest.approx(600 / 7)  # (16 - 2 first tokens) / 2
    assert rows["ddtree_v2_b64"]["decode_ms"] == pytest.approx(900 / 3)
    assert rows["ar"]["percent_of_limit"] == pytest.approx(100 * 16 / (600 / 7))
    # A prefill timed longer than the whole row (noise) gives no decode time.
    noisy = row_roofline(runs, 2, floor, prompt_len=0, prefill_seconds={"ar": 1.2})
    assert noisy["ar"]["decode_ms"] is None
    assert noisy["ar"]["percent_of_limit"] == pytest.approx(100 * 16 / (1e3 / 8))


def test_kv_bytes_count_only_attention_layers():
    assert kv_bytes_per_token(QWEN3_8B) == 36 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(QWEN3_6_27B) == 16 * 2 * 4 * 256 * 2


def test_phases_keep_the_chain_in_each_and_ar_beside_it():
    from benchmarks.scale_paired import engine_phases

    names = ["ar", "dflash", "ddtree_v2_b32", "ddtree_v2_b64", "ddtree_v2_b128"]
    assert engine_phases(names, 0) == [names]
    assert engine_phases(names, 2) == [
        ["ar", "dflash"],
        ["dflash", "ddtree_v2_b32", "ddtree_v2_b64"],
        ["dflash", "ddtree_v2_b128"],
    ]


def test_without_an_ar_phase_the_chain_and_the_trees_start_at_once(tmp_path, monkeypatch):
    """``--no-ar-phase``: AR makes the references alone, without torch.compile, and closes;
    the first phase starts the chain beside the trees (a 27B run under torch.compile saves
    one engine start and AR's compile), its rows set the trees against the chain and the
    references."""
    from benchmarks.scale_paired import engine_phases

    names = ["dflash", "ddtree_v2_b32", "ddtree_v2_b64"]
    assert engine_phases(names, 1) == [["dflash", "ddtree_v2_b32"], ["dflash", "ddtree_v2_b64"]]
    assert engine_phases(names, 0) == [names]
    argv = ["--budgets", "32", "--batches", "1", "--max-tokens", "8", "--prompt-len", "4"]
    argv += ["--repeats", "1", "--modes", "greedy,sampling", "--datasets", "humaneval"]
    argv += ["--per-phase", "1", "--no-ar-phase", "--torch-compile"]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv)
    assert _FakeEngines.started == [["ar"], ["dflash", "ddtree_v2_b32"]]
    assert _FakeEngines.compile_modes == {"ar": 0, "dflash": 3, "ddtree_v2_b32": 3}
    assert [p["engines"] for p in summary["phases"]] == [["dflash", "ddtree_v2_b32"]]
    rows = summary["rows"]
    assert len(rows) == 2 and all(set(r["engines"]) == {"dflash", "ddtree_v2_b32"} for r in rows)
    assert all(v == 1.0 for r in rows for v in r["on_reference"].values())
    assert set(summary["splits"]) == {"dflash", "ddtree_v2_b32"}
    assert "| ddtree_v2_b32 |" in (tmp_path / "out" / "scale_paired.md").read_text()


def test_engines_that_cannot_fit_side_by_side_stop_the_run_before_any_starts():
    """Seven 8B engines (AR, the chain, budgets 8-64, "auto") ran out of GPU memory at the
    seventh start, minutes into a lease, where six had fit (benchmarks/results/
    2026-12-04_0003f14_scale-8b-grid/log-seven-engines). The bench now adds up each phase's engines
    (weights, KV cache, ``ENGINE_OVERHEAD_BYTES``) against the GPU's free memory first, and
    names the ``--per-phase`` that fits."""
    from benchmarks.scale_paired import ENGINE_OVERHEAD_BYTES, memory_advice

    gib = 1 << 30
    fixed = ["ddtree_v2_b8", "ddtree_v2_b16", "ddtree_v2_b32", "ddtree_v2_b64"]
    names = ["ar", "dflash", *fixed, "ddtree_v2_auto"]
    need = {name: 21 * gib for name in names} | {"ar": 16 * gib, "ddtree_v2_auto": 24 * gib}
    free = 139 * gib
    advice = memory_advice(names, need, free, per_phase=0)
    assert advice is not None
    assert "7 engines" in advice and "145 GiB" in advice and "139 GiB" in advice
    assert "--per-phase 5" in advice  # AR with the chain, then the chain and five DDTree
    assert memory_advice(names, need, free, per_phase=5) is None
    assert memory_advice(names[:-2] + names[-1:], need, free, per_phase=0) is None  # six fit
    assert "does not fit" in memory_advice(names, need, 40 * gib, per_phase=0)
    assert 1 * gib < ENGINE_OVERHEAD_BYTES < 8 * gib


def test_the_report_is_written_from_a_committed_run(tmp_path):
    """The committed scale run (before phases) and its table rebuild as they were measured."""
    import json
    import os

    from benchmarks.common import ROOT
    from benchmarks.scale_paired import write_report

    run = os.path.join(ROOT, "tests", "fixtures", "runs", "scale_8b_ba38bef.json")
    with open(run) as f:
        summary = json.load(f)
    write_report(summary, str(tmp_path))
    table = (tmp_path / "scale_paired.md").read_text()
    assert "| 0 | greedy | math500 | 1 | ddtree_v2_b32 |" in table
    assert "Step-time split" in table


def test_the_readme_headline_says_what_was_measured_and_picks_the_fastest_budget():
    import json
    import os

    from benchmarks.common import ROOT
    from benchmarks.scale_paired import headline

    with open(os.path.join(ROOT, "tests", "fixtures", "runs", "scale_8b_ba38bef.json")) as f:
        summary = json.load(f)
    table = headline(summary, "benchmarks/results/RUN/scale_paired.md")
    assert "random weights at qwen3-8b's shapes, acceptance synthetic" in table
    math500 = next(line for line in table.splitlines() if line.startswith("| math500 | 1 |"))
    best = max(
        (name for name in summary["rows"][1]["over_chain"] if name.startswith("ddtree")),
        key=lambda name: summary["rows"][1]["over_chain"][name]["median"],
    )
    assert f"b{best.rsplit('_b', 1)[-1]} |" in math500


def test_the_readme_headline_shows_what_auto_served_beside_the_fastest_fixed_budget():
    """Users run "auto": where the run had its engine, the headline gives its tok/s
    (acceptance) and its ratio to the chain in every row."""
    import json
    import os

    from benchmarks.common import ROOT
    from benchmarks.scale_paired import AUTO, headline, ratio_text

    run = "benchmarks/results/2026-12-04_0003f14_scale-8b-grid/scale_paired.json"
    with open(os.path.join(ROOT, run)) as f:
        summary = json.load(f)
    lines = headline(summary, "benchmarks/results/RUN/scale_paired.md").splitlines()
    assert '| DDTree "auto" | "auto" / chain |' in next(
        x for x in lines if x.startswith("| profile")
    )
    for row in summary["rows"]:
        auto = row["engines"][AUTO]
        cells = (
            f"| {auto['tok_per_s']:.0f} ({auto['mean_acceptance_length']:.2f}) "
            f"| {ratio_text(row['over_chain'][AUTO], '-')} |"
        )
        prefix = f"| {row['dataset']} | {row['batch']} | {row['temperature']:g} |"
        assert next(x for x in lines if x.startswith(prefix)).endswith(cells), prefix
    without = dict(
        summary,
        rows=[
            dict(r, engines={k: v for k, v in r["engines"].items() if k != AUTO})
            for r in summary["rows"]
        ],
    )
    assert '"auto"' not in headline(without, "benchmarks/results/RUN/scale_paired.md")


def test_a_hybrids_step_reads_its_recurrent_state_once_per_request():
    from benchmarks.scale_paired import state_bytes_per_request

    assert state_bytes_per_request(QWEN3_8B) == 0
    # 48 GatedDeltaNet layers of 48 value heads, each a 128 x 128 matrix, float32 (the
    # engines' SSM state dtype).
    assert state_bytes_per_request(QWEN3_6_27B) == 48 * 48 * 128 * 128 * 4
    assert state_bytes_per_request(QWEN3_6_27B, ssm_bytes=2) == 48 * 48 * 128 * 128 * 2
    floor = {"bandwidth": 1e12, "target": 0, "drafter": 0, "kv_per_token": 0, "state": 1e9}
    assert roofline({"speculative": False, "steps": 1}, 2, 1.0, floor, 0)["limit_ms"] == 2.0


class _FakeEngines:
    """Stands in for bench_paired.Engines: AR answers a fixed continuation per prompt, every
    other engine the same tokens in fewer steps; no GPU, no vLLM."""

    started: list[list[str]] = []

    max_seqs: dict[str, int] = {}
    compile_modes: dict[str, int] = {}

    def __init__(self, jobs, target, overrides, timeout, engine_core_process):
        self.names = [job["name"] for job in jobs]
        _FakeEngines.max_seqs.update({job["name"]: job["max_seqs"] for job in jobs})
        _FakeEngines.compile_modes.update(
            {job["name"]: job["kwargs"]["compilation_config"]["mode"] for job in jobs}
        )
        self.ready = {name: {"gpu": "stand-in", "runner": "V2"} for name in self.names}
        _FakeEngines.started.append(self.names)
        self.closed = False

    def run(self, name, prompts, temperature, one_at_a_time, max_tokens):
        assert not self.closed and name in self.names
        tokens = [[(p[0] + i) % 97 for i in range(max_tokens)] for p in prompts]
        drafts = 0 if name == "ar" else len(prompts) * max_tokens // 4
        seconds = 0.1 + 0.05 * max_tokens  # a prefill, then the tokens
        return {"tokens": tokens, "seconds": seconds, "drafts": drafts, "accepted": 3 * drafts}

    def split(self, name, prompts, temperature, max_tokens, kind):
        measured = {
            "batch": len(prompts),
            "temperature": temperature,
            "target_forwards": max_tokens,
            "wall_ms_per_forward": 1.0,
        }
        if kind == "host_profile":
            top = [{"function": "x.py:1(f)", "calls": 1, "self_ms": 1, "cumulative_ms": 1}]
            return dict(measured, top_self=top, top_cumulative=top)
        return dict(measured, phases_per_forward={}, rest_host_ms=1.0)

    def close(self):
        self.closed = True


def _run_on_stand_ins(tmp_path, monkeypatch, argv: list[str]) -> dict:
    """``scale-paired`` with ``argv`` (past the calibration and folders) with the GPU parts
    stood in (the build, the copy bandwidth, the engines); returns its summary."""
    import json
    import subprocess
    import types

    import benchmarks.scale_paired as bench

    def build(cmd, **kwargs):
        paths = {"target": str(tmp_path / "t"), "drafter": str(tmp_path / "d"), "parameters": 1}
        return types.SimpleNamespace(stdout=json.dumps(paths))

    monkeypatch.setattr(subprocess, "run", build)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(bench, "free_gpu_bytes", lambda: 1 << 50)  # (its own test)
    monkeypatch.setattr(bench, "checkpoint_bytes", lambda path, leave_out=(): 16e9)
    monkeypatch.setattr(bench, "Engines", _FakeEngines)
    _FakeEngines.started, _FakeEngines.max_seqs, _FakeEngines.compile_modes = [], {}, {}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CALIBRATION))
    out = tmp_path / "out"
    common = ["--calibration", str(cal), "--out", str(out), "--work", str(tmp_path / "w")]
    assert bench.main(common + argv) == 0
    return json.loads((out / "scale_paired.json").read_text())


@pytest.mark.parametrize("per_phase", [0, 2])
def test_a_whole_scale_run_on_stand_in_engines(tmp_path, monkeypatch, per_phase):
    """The bench end to end with the GPU parts stood in (the build, the copy bandwidth, the
    engines): every phase starts the engines it names beside the chain, every row and split
    lands in the report, and the oracle file ranks each prompt by its dataset's profile."""
    import json

    argv = ["--budgets", "32,64,128", "--batches", "1,4", "--repeats", "2", "--max-tokens", "8"]
    argv += ["--prompt-len", "4", "--per-phase", str(per_phase)]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv)
    out = tmp_path / "out"
    names = ["dflash", "ddtree_v2_b32", "ddtree_v2_b64", "ddtree_v2_b128"]
    if per_phase:
        assert _FakeEngines.started == [["ar"], ["dflash"], names[1:3], [names[-1]]]
        assert [p["engines"] for p in summary["phases"]] == [
            ["ar", "dflash"],
            ["dflash", *names[1:3]],
            ["dflash", names[-1]],
        ]
    else:
        assert _FakeEngines.started == [["ar"], names]
    rows = summary["rows"]
    # Per phase: 3 datasets at batch 1 and one mixed row at batch 4, greedy and sampling.
    assert len(rows) == (3 if per_phase else 1) * 2 * (3 + 1)
    assert all(
        r["identical"][n]["identical"] == r["identical"][n]["requests"]
        for r in rows
        for n in r["engines"]
    )
    assert set(summary["splits"]) == {"ar", *names}
    assert all(
        [s["batch"] for s in summary["splits"][name][kind]] == [1]
        for name in summary["splits"]
        for kind in ("step_split", "host_phases", "host_profile")
    )
    oracle = json.loads((tmp_path / "w" / "oracle.json").read_text())
    assert set(oracle["sequence_models"]) == {d + s for d in DATASETS for s in ("", "_t1")}
    assert all(set(r["prefill_seconds"]) == set(r["engines"]) for r in rows)
    assert all(r["roofline"][n]["decode_ms"] is not None for r in rows for n in r["engines"])
    table = (out / "scale_paired.md").read_text()
    assert "| ddtree_v2_b128 |" in table and "Step-time split" in table
    assert "Host time per step" in table and "Host profile (cProfile" in table


def test_datasets_narrow_the_grid_and_its_references(tmp_path, monkeypatch):
    """``--datasets humaneval``: every row, the split's prompts and AR's references are
    HumanEval's alone (a 27B run reaches its tree phase sooner); an unknown name is refused
    with the allowed ones."""
    import json

    import benchmarks.scale_paired as bench

    argv = ["--budgets", "32", "--batches", "1", "--repeats", "1", "--max-tokens", "8"]
    argv += ["--prompt-len", "4", "--per-phase", "1", "--modes", "greedy"]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv + ["--datasets", "humaneval"])
    assert {r["dataset"] for r in summary["rows"]} == {"humaneval"}
    assert len(summary["rows"]) == 2  # phase 0 (AR, the chain) and phase 1 (the chain, b32)
    oracle = json.loads((tmp_path / "w" / "oracle.json").read_text())
    assert set(oracle["sequence_models"]) == {"humaneval"}
    with pytest.raises(SystemExit):
        bench.main(["--calibration", "c", "--out", "o", "--datasets", "humaneval,gsm8k"])


def test_a_budget_runs_only_at_the_batches_whose_verify_fits_the_token_limit(tmp_path, monkeypatch):
    """``--max-verify-tokens 260``: budget 128 (129 tokens a request) runs at batch 1 only,
    budget 64 (65) at batches 1 and 4; AR and the chain at every batch; each engine is sized
    (``max_num_seqs``, graphs) for the largest batch it runs at."""
    from benchmarks.bench_paired import CHAIN

    argv = ["--budgets", "64,128", "--batches", "1,4", "--repeats", "1", "--max-tokens", "8"]
    argv += ["--prompt-len", "4", "--max-verify-tokens", "260"]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv)
    for row in summary["rows"]:
        engines = set(row["engines"])
        assert {"ar", CHAIN, "ddtree_v2_b64"} <= engines
        assert ("ddtree_v2_b128" in engines) == (row["batch"] == 1)
    assert _FakeEngines.max_seqs == {
        "ar": 4,
        CHAIN: 4,
        "ddtree_v2_b64": 4,
        "ddtree_v2_b128": 1,
    }
    assert summary["batches_served"]["ddtree_v2_b128"] == [1]


def test_a_hybrid_target_is_served_text_only_with_ddtrees_hybrid_settings_by_every_engine():
    """The 27B hybrid's class is Qwen3.5/3.6's multimodal one: without language_model_only vLLM
    asks for an image processor the scale model has none of (the first 27B run stopped there)."""
    from types import SimpleNamespace

    from benchmarks.scale_paired import engine_overrides
    from vllm_ddtree.config import HYBRID_ENGINE_ARGS

    args = SimpleNamespace(
        prompt_len=128, max_tokens=128, kv_cache_gb=1.0, max_model_len=0, prefix_caching=False
    )
    hybrid = engine_overrides(QWEN3_6_27B, args, [32, 64], 4)
    assert hybrid["language_model_only"] is True
    assert hybrid["additional_config"] == {"gdn_prefill_backend": "triton"}
    assert all(hybrid[key] == value for key, value in HYBRID_ENGINE_ARGS.items())
    dense = engine_overrides(QWEN3_8B, args, [32, 64], 4)
    assert "language_model_only" not in dense and "additional_config" not in dense
    assert dense["max_model_len"] == 128 + 128 + 2 * 65 + 2 * QWEN3_8B.block_size
    # --prefix-caching: every engine with it, a hybrid's states in vLLM's align layout.
    args.prefix_caching = True
    for model in (QWEN3_6_27B, QWEN3_8B):
        assert engine_overrides(model, args, [32], 4)["enable_prefix_caching"] is True


def test_a_hybrid_engines_kv_cache_holds_a_state_block_per_verified_token():
    """vLLM keeps 1 + k state blocks per hybrid request (k: drafts per step): the first 27B
    run gave the chain 1 GiB where its start asked for 2.72 GiB."""
    from benchmarks.bench_paired import engine_jobs
    from benchmarks.scale_paired import kv_cache_bytes, state_bytes_per_request

    jobs = {job["name"]: job for job in engine_jobs("d", 15, [32], 1, "v1")}
    gib = 1 << 30
    assert kv_cache_bytes(QWEN3_6_27B, jobs["ar"], 1, 1.0) == gib
    chain = kv_cache_bytes(QWEN3_6_27B, jobs["dflash"], 1, 1.0)
    assert chain >= 2.72 * gib
    assert chain >= gib + 16 * state_bytes_per_request(QWEN3_6_27B)
    tree = kv_cache_bytes(QWEN3_6_27B, jobs["ddtree_b32"], 4, 1.0)
    # Prefix caching (vLLM's align layout) keeps one more state block per request.
    aligned = kv_cache_bytes(QWEN3_6_27B, jobs["ddtree_b32"], 4, 1.0, prefix_caching=True)
    assert aligned > tree
    assert tree >= gib + 4 * 33 * state_bytes_per_request(QWEN3_6_27B)
    assert kv_cache_bytes(QWEN3_8B, jobs["dflash"], 16, 1.0) == gib  # dense: the base


def test_a_hybrid_tree_engines_kv_cache_passes_the_plugins_state_check():
    """The first 27B DDTree engine (b64, batch 1) was refused at start: the plugin's state
    check counts each block's conv window too (``gdn_state.slot_layout_bytes``), 13.1 GiB
    against the 11.1 the bench gave. The bench sizes from the plugin's own layout."""
    from benchmarks.bench_paired import engine_jobs
    from benchmarks.scale_paired import kv_cache_bytes
    from vllm_ddtree.hybrid.gdn_state import GDNStateShapes, check_slot_layout_fits

    h = QWEN3_6_27B.hybrid
    shapes = GDNStateShapes(
        num_gdn_layers=QWEN3_6_27B.num_hidden_layers
        - QWEN3_6_27B.num_hidden_layers // h["full_attention_interval"],
        num_k_heads=h["linear_num_key_heads"],
        num_v_heads=h["linear_num_value_heads"],
        head_k_dim=h["linear_key_head_dim"],
        head_v_dim=h["linear_value_head_dim"],
        conv_kernel=h["linear_conv_kernel_dim"],
    )
    for budget, batch in [(64, 1), (32, 4), (256, 1)]:
        jobs = {job["name"]: job for job in engine_jobs("d", 15, [budget], batch, "v1")}
        for name in (f"ddtree_b{budget}", "dflash"):
            job = jobs[name]
            available = kv_cache_bytes(QWEN3_6_27B, job, batch, 1.0)
            check_slot_layout_fits(shapes, batch, job["width"] - 1, available)


def test_an_auto_engine_serves_every_batch_with_the_plugins_graphs(tmp_path, monkeypatch):
    """``--auto-max-seqs 64``: one "auto" engine of 64 requests beside the fixed budgets at
    every batch, its graphs left to the plugin, the token budget raised to cover its widest
    verify batch; the report sets it against the chain and the fastest fixed budget."""
    from benchmarks.scale_paired import AUTO

    started = []
    original = _FakeEngines.__init__

    def remember(self, jobs, target, overrides, timeout, engine_core_process):
        started.extend((job, overrides) for job in jobs)
        original(self, jobs, target, overrides, timeout, engine_core_process)

    monkeypatch.setattr(_FakeEngines, "__init__", remember)
    argv = ["--budgets", "16,32", "--batches", "1,4", "--repeats", "2", "--max-tokens", "8"]
    argv += ["--prompt-len", "4", "--auto-max-seqs", "64", "--split-batches", ""]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv)
    assert all(AUTO in row["engines"] for row in summary["rows"])
    assert summary["batches_served"][AUTO] == [1, 4]
    job, overrides = next((j, o) for j, o in started if j["name"] == AUTO)
    assert job["max_seqs"] == 64 and job["kwargs"]["speculative_config"]["tree_budget"] == "auto"
    assert "cudagraph_capture_sizes" not in job["kwargs"]["compilation_config"]
    assert overrides["max_num_batched_tokens"] >= 64 * job["width"]
    table = (tmp_path / "out" / "scale_paired.md").read_text()
    section = table.split('## DDTree "auto"')[1]
    assert section.count("| greedy |") == 4 and section.count("| sampling |") == 4
    assert "| b16 |" in section or "| b32 |" in section


def test_a_workload_shift_runs_its_datasets_in_order_on_every_engine(tmp_path, monkeypatch):
    """``--shift humaneval,mtbench``: each dataset's chunks in order, every engine but AR by
    turns per chunk (outputs checked against the references), the "auto" engine's nodes per
    tree recorded, and the report's shift section written."""
    from benchmarks.scale_paired import AUTO

    argv = ["--budgets", "16,32", "--batches", "1", "--max-tokens", "8", "--prompt-len", "4"]
    argv += ["--auto-max-seqs", "4", "--split-batches", "", "--shift", "humaneval,mtbench"]
    argv += ["--shift-chunks", "3", "--shift-batch", "2"]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv)
    shift = summary["shift"]
    assert not summary["rows"]
    engines = {"dflash", "ddtree_v2_b16", "ddtree_v2_b32", AUTO}
    assert len(shift) == 2 * 3 * len(engines)
    assert {r["engine"] for r in shift} == engines
    assert [r["dataset"] for r in shift] == ["humaneval"] * 12 + ["mtbench"] * 12
    assert all(r["equals_reference"] for r in shift)
    table = (tmp_path / "out" / "scale_paired.md").read_text()
    assert "## Workload shift" in table and '- mtbench: "auto" within 5%' in table


def test_a_shift_sizes_every_engine_for_its_chunks_requests(tmp_path, monkeypatch):
    """``--shift-batch 4`` with ``--batches 1``: the chunks run 4 requests at a time, so every
    engine, AR (whose references the chunks are checked against) first, serves 4; at
    ``max_num_seqs`` 1 AR made the references of a 48-prompt pool one request at a time and
    the run spent its whole limit there on the GPU host."""
    argv = ["--budgets", "16,32", "--batches", "1", "--max-tokens", "8", "--prompt-len", "4"]
    argv += ["--auto-max-seqs", "64", "--split-batches", "", "--shift", "humaneval,mtbench"]
    argv += ["--shift-chunks", "2", "--shift-batch", "4"]
    _run_on_stand_ins(tmp_path, monkeypatch, argv)
    assert all(seqs >= 4 for seqs in _FakeEngines.max_seqs.values()), _FakeEngines.max_seqs


def test_max_num_seqs_sizes_every_engine_as_a_server_while_the_rows_stay_at_batch_1(
    tmp_path, monkeypatch
):
    """``--max-num-seqs 16`` with ``--batches 1``: every engine is started for 16 requests
    (its graphs cover 16 verify batches), the rows run one request, and the report says how
    the engines were sized. At c009ebe budget 32 ran 1.11x the chain at one request on
    engines sized for 16, and 1.25x on engines sized for one (two machines): this pairs the
    two sizings on one."""
    argv = ["--budgets", "32", "--batches", "1", "--max-tokens", "8", "--prompt-len", "4"]
    argv += ["--repeats", "1", "--modes", "greedy", "--datasets", "humaneval"]
    argv += ["--split-batches", "", "--max-num-seqs", "16"]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv)
    assert _FakeEngines.max_seqs == {"ar": 16, "dflash": 16, "ddtree_v2_b32": 16}
    assert summary["max_num_seqs"] == _FakeEngines.max_seqs
    assert {r["batch"] for r in summary["rows"]} == {1}
    table = (tmp_path / "out" / "scale_paired.md").read_text()
    assert "max_num_seqs: ar 16, dflash 16, ddtree_v2_b32 16." in table
    _run_on_stand_ins(tmp_path, monkeypatch, argv[:-2])
    assert set(_FakeEngines.max_seqs.values()) == {1}


def test_a_shift_phase_settles_where_auto_stays_within_5_percent():
    from benchmarks.scale_paired import AUTO, shift_phases

    def rows(dataset, chunk, auto, b16, b32):
        rates = {AUTO: auto, "ddtree_v2_b16": b16, "ddtree_v2_b32": b32, "dflash": 999}
        return [
            {"dataset": dataset, "chunk": chunk, "engine": e, "tok_per_s": v}
            for e, v in rates.items()
        ]

    shift = rows("humaneval", 0, 80, 90, 100) + rows("humaneval", 1, 97, 90, 100)
    shift += rows("humaneval", 2, 99, 90, 100) + rows("mtbench", 0, 90, 100, 80)
    shift += rows("mtbench", 1, 99, 100, 80) + rows("mtbench", 2, 90, 100, 80)
    phases = shift_phases(shift)
    assert phases["humaneval"]["auto_over_best_fixed"] == [0.8, 0.97, 0.99]
    assert phases["humaneval"]["within_5_percent_from_chunk"] == 1
    assert phases["mtbench"]["within_5_percent_from_chunk"] is None  # fell back at the end
    # Medians over the chunks after the first: mtbench's "auto" 94.5 against b16's 100.
    assert phases["mtbench"]["median_tok_per_s"][AUTO] == 94.5
    assert phases["mtbench"]["median_auto_over_best_fixed"] == pytest.approx(0.945)
    assert phases["humaneval"]["median_tok_per_s"]["dflash"] == 999
    assert phases["humaneval"]["best_fixed"] == "ddtree_v2_b32"


def test_a_shift_phase_compares_auto_with_the_phases_best_budget_chunk_by_chunk():
    """A chunk where another fixed budget happened to run faster does not count against
    "auto": each chunk is set against the phase's best budget by median. Failed before: the
    fastest fixed engine of each chunk, whose noise alone puts it above "auto" serving that
    same budget (the 8B shift run at 8766111: "auto" served budget 64 throughout, within 2% of
    it in most chunks, and was within 5% of the per-chunk best only from its last chunk)."""
    from benchmarks.scale_paired import AUTO, shift_phases

    def rows(chunk, auto, b16, b64):
        rates = {AUTO: auto, "ddtree_v2_b16": b16, "ddtree_v2_b64": b64}
        return [
            {"dataset": "humaneval", "chunk": chunk, "engine": e, "tok_per_s": v}
            for e, v in rates.items()
        ]

    # "auto" serves 64 from chunk 1; budget 16 is slower by median, faster in chunk 2.
    shift = rows(0, 50, 90, 100) + rows(1, 99, 90, 100) + rows(2, 98, 120, 100)
    shift += rows(3, 100, 85, 101)
    phase = shift_phases(shift)["humaneval"]
    assert phase["best_fixed"] == "ddtree_v2_b64"
    assert phase["auto_over_best_fixed"] == pytest.approx([0.5, 0.99, 0.98, 100 / 101])
    assert phase["within_5_percent_from_chunk"] == 1


def test_a_sampling_only_run_splits_its_steps_on_greedy_prompts(tmp_path, monkeypatch):
    """``--modes sampling`` with a step-time split: the split serves greedy prompts, which
    such a run must make too (it stopped with a KeyError before any row)."""
    argv = ["--budgets", "64", "--batches", "1", "--repeats", "1", "--max-tokens", "8"]
    argv += ["--prompt-len", "4", "--modes", "sampling", "--split-batches", "1"]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv)
    assert {row["mode"] for row in summary["rows"]} == {"sampling"}
    assert [s["batch"] for s in summary["splits"]["ddtree_v2_b64"]["step_split"]] == [1]


def test_a_runs_report_is_rewritten_from_its_json(tmp_path):
    """``--report-from RUN/scale_paired.json --out DIR``: the run's tables with this commit's
    report code, nothing measured."""
    from benchmarks.scale_paired import main

    run = "benchmarks/results/2026-12-03_8766111_scale-8b-shift/scale_paired.json"
    assert main(["--report-from", run, "--out", str(tmp_path)]) == 0
    report = (tmp_path / "scale_paired.md").read_text()
    assert "Commit 87661113c3eccbc832155e700f23459c4f2d8811" in report
    assert "phase's best fixed budget (ddtree_v2_b64, by its median)" in report


def test_flash_context_engines_copy_theirs_with_the_switch_and_are_set_against_them(
    tmp_path, monkeypatch
):
    """``--flash-context 16,auto``: budget 16 and "auto" also run as engines whose TREE_ATTN
    takes the context through FlashAttention, each beside the engine it copies, at the same
    batches; the engines copied keep the tree kernel alone (the default would take
    FlashAttention for large batches); the report sets each against its own engine; the
    fastest fixed budget and "auto"'s tables stay on those engines; a budget not in the grid
    is refused naming the allowed ones."""
    from benchmarks.scale_paired import AUTO, FLASH_ENV, TREE_KERNEL_ENV, fastest_fixed

    started = []
    original = _FakeEngines.__init__

    def remember(self, jobs, target, overrides, timeout, engine_core_process):
        started.extend(jobs)
        original(self, jobs, target, overrides, timeout, engine_core_process)

    monkeypatch.setattr(_FakeEngines, "__init__", remember)
    argv = ["--budgets", "16,32", "--batches", "1,4", "--repeats", "2", "--max-tokens", "8"]
    argv += ["--prompt-len", "4", "--auto-max-seqs", "8", "--split-batches", ""]
    summary = _run_on_stand_ins(tmp_path, monkeypatch, argv + ["--flash-context", "16,auto"])
    jobs = {job["name"]: job for job in started}
    for name in ("ddtree_v2_b16", AUTO):
        copy = jobs[name + "_fa"]
        assert copy["env"].items() >= FLASH_ENV.items()
        assert jobs[name]["env"].items() >= TREE_KERNEL_ENV.items()
        assert copy["kwargs"] == jobs[name]["kwargs"]
        assert summary["batches_served"][name + "_fa"] == summary["batches_served"][name]
    assert "ddtree_v2_b32_fa" not in jobs
    for row in summary["rows"]:
        assert fastest_fixed(row["engines"], row["over_chain"]) in (
            "ddtree_v2_b16",
            "ddtree_v2_b32",
        )
    table = (tmp_path / "out" / "scale_paired.md").read_text()
    section = table.split("## TREE_ATTN's context through FlashAttention")[1].split("##")[0]
    assert (
        section.count("| ddtree_v2_b16_fa |") == 8 and section.count("| ddtree_v2_auto_fa |") == 8
    )
    with pytest.raises(SystemExit):
        _run_on_stand_ins(tmp_path, monkeypatch, argv + ["--flash-context", "64"])


def test_max_model_len_leaves_room_for_two_of_the_auto_engines_widest_trees():
    """The 8B grid at cedb958 gave every engine a max_model_len for two trees of the grid's
    widest fixed budget (32), while its "auto" engine served budgets up to 128: vLLM cut the
    trees of a request's last steps at max_model_len, those verifies left the FULL CUDA graph
    (the engine's log: the tree attention kernel compiling during inference), and "auto"'s
    steps at one request ran 10.7 ms where fixed budgets ran 8.4. The length is sized from
    every engine's widest tree, "auto"'s included."""
    from types import SimpleNamespace

    from benchmarks.bench_paired import auto_job, engine_jobs
    from benchmarks.scale_paired import engine_overrides, verified_budgets

    args = SimpleNamespace(
        prompt_len=128, max_tokens=256, kv_cache_gb=1.0, max_model_len=0, prefix_caching=False
    )
    jobs = engine_jobs("d", 15, [8, 32], 1, "v2")
    assert verified_budgets(jobs) == [15, 8, 32]
    auto = auto_job("d", 15, 64, "v2")
    widest = auto["width"] - 1
    assert widest >= 128  # the packaged profile's widest measured budget
    overrides = engine_overrides(QWEN3_8B, args, verified_budgets([*jobs, auto]), 16)
    assert overrides["max_model_len"] >= 128 + 256 + 2 * (1 + widest)


def test_max_model_len_can_be_set_for_every_engine():
    """``--max-model-len``: a tight length makes requests' last trees meet it, the case where
    vLLM cuts trees and "auto" drafts narrower ones that fit."""
    from types import SimpleNamespace

    from benchmarks.scale_paired import engine_overrides

    args = SimpleNamespace(
        prompt_len=128, max_tokens=256, kv_cache_gb=1.0, max_model_len=400, prefix_caching=False
    )
    assert engine_overrides(QWEN3_8B, args, [64], 1)["max_model_len"] == 400
    args.max_model_len = 0
    assert engine_overrides(QWEN3_8B, args, [64], 1)["max_model_len"] > 128 + 256 + 2 * 65


CPU_CALIBRATION = "benchmarks/results/2026-12-02_00e665f_calibration/calibration.json"


@pytest.mark.vllm_engine
def test_the_whole_run_on_vllm_cpu_keeps_every_tree_on_the_reference(tmp_path):
    """``--cpu``: the GPU run's path (build, references, the engines started phase by phase,
    rows, report) on the shrunk Qwen3.6-27B-shaped hybrid, the target of the run the GPU host
    last refused at start. Every DDTree output, greedy and sampled, is the reference the
    oracle ranks, which AR's outputs are at both temperatures. vLLM-CPU's chain is left unchecked
    at T = 1: its rejection sampler's Triton launches do nothing without a GPU driver
    (vllm-project/vllm#42638)."""
    import json

    from benchmarks.common import ROOT
    from benchmarks.scale_paired import main

    out = tmp_path / "out"
    argv = ["--cpu", "--model", "qwen3.6-27b", "--root", str(tmp_path / "models")]
    argv += ["--work", str(tmp_path / "w"), "--out", str(out)]
    argv += ["--calibration", os.path.join(ROOT, CPU_CALIBRATION)]
    argv += ["--budgets", "8", "--batches", "1,2", "--repeats", "1", "--max-tokens", "24"]
    argv += ["--prompt-len", "16", "--batch1-prompts", "1", "--kv-cache-gb", "0.25"]
    argv += ["--per-phase", "1"]
    assert main(argv) == 0
    summary = json.loads((out / "scale_paired.json").read_text())
    assert summary["gpu"] == "cpu" and summary["model"] == "qwen3.6-27b/16-successor"
    rows = summary["rows"]
    # Phase 0 (AR, the chain) and phase 1 (the chain, budget 8): 3 datasets at batch 1 and
    # one mixed row at batch 2, greedy and sampling.
    assert len(rows) == 2 * 2 * (3 + 1)
    trees = [r for r in rows if "ddtree_b8" in r["engines"]]
    assert len(trees) == 8 and {r["mode"] for r in trees} == {"greedy", "sampling"}
    assert all(r["on_reference"]["ddtree_b8"] == 1.0 for r in trees)
    with_ar = [r for r in rows if "ar" in r["engines"]]
    assert all(r["on_reference"]["ar"] == 1.0 for r in with_ar)
    assert all(r["roofline"]["ar"]["percent_of_limit"] is None for r in with_ar)
    assert "No copy bandwidth (CPU)" in (out / "scale_paired.md").read_text()


def test_ars_step_is_set_against_the_roofline_by_its_weight_gemms():
    """AR's profiled split: the weight GEMMs (cuBLAS's kernels, not FlashAttention's CUTLASS
    ones) read the weights at a share of the copy bandwidth; the rest of the busy time is
    every other kernel."""
    from benchmarks.scale_paired import ar_kernel_roofline, is_weight_gemm

    assert is_weight_gemm("nvjet_sm90_tst_192x8_64x8_2x1_v_bz_TNT")
    assert is_weight_gemm("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>")
    assert not is_weight_gemm("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>")
    assert not is_weight_gemm("void vllm::rms_norm_kernel<c10::BFloat16, 8, 3, true>")
    ops = [
        {"name": "nvjet_a", "calls": 36, "ms": 3.0},
        {"name": "void cutlass::device_kernel<flash::FlashAttnFwdSm90>", "calls": 36, "ms": 0.4},
        {"name": "nvjet_b", "calls": 1, "ms": 1.0},
        {"name": "void vllm::rms_norm_kernel", "calls": 72, "ms": 0.3},
    ]
    split = {"batch": 1, "temperature": 0.0, "device_busy_ms": 5.0, "top_device_ops": ops}
    summary = {
        "splits": {"ar": {"step_split": [split]}},
        "floor_bytes": {"bandwidth": 5e12, "target": 16e9},
    }
    lines = ar_kernel_roofline(summary)
    # 16 GB in the GEMMs' 4 ms: 4000 GB/s, 80% of 5000; 1 ms of other kernels; 3.2 ms limit.
    assert lines[-1] == "| 1 | 0 | 5.00 | 4.00 | 4000 | 80 | 1.00 | 3.20 |"
    assert ar_kernel_roofline({**summary, "floor_bytes": {"bandwidth": None, "target": 1}}) == []
    assert ar_kernel_roofline({"splits": {}, "floor_bytes": summary["floor_bytes"]}) == []


def test_each_engines_busy_time_is_split_by_kernel_beside_the_chains():
    """The profiled splits' device kernels by what they do, each engine's beside the chain's:
    TREE_ATTN's kernels, FlashAttention's, the tree build's, the tree step's own ops and the
    weight GEMMs; "other" is the busy time left."""
    from benchmarks.scale_paired import device_kernel_table, kernel_class

    assert kernel_class("_tree_attention_kernel") == "TREE_ATTN"
    assert kernel_class("void cutlass::device_kernel<flash::FlashAttnFwdCombine<...>>") == (
        "FlashAttention"
    )
    assert kernel_class("_segment_top_kernel") == "tree build"
    assert kernel_class("_walk_and_emit_kernel") == "tree step ops"
    assert kernel_class("nvjet_sm90_tst_192x72_64x6_2x1_v_bz_TNT") == "weight GEMMs"
    assert kernel_class("triton_red_fused_fused_add_rms_norm_0") == "other"

    def split(busy, ops):
        ops = [{"name": name, "calls": 36, "ms": ms} for name, ms in ops]
        return {
            "step_split": [dict(batch=1, temperature=0.0, device_busy_ms=busy, top_device_ops=ops)]
        }

    flash = "void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>"
    summary = {
        "splits": {
            "dflash": split(8.0, [("nvjet_a", 6.0), (flash, 0.5)]),
            "ddtree_v2_b64": split(
                9.0, [("nvjet_b", 6.2), (flash, 0.5), ("_tree_attention_kernel", 0.4)]
            ),
        }
    }
    lines = device_kernel_table(summary)
    assert lines[-2] == "| 1 | 0 | dflash | 8.000 | 0.000 | 0.500 | 0.000 | 0.000 | 6.000 | 1.500 |"
    assert lines[-1] == (
        "| 1 | 0 | ddtree_v2_b64 | 9.000 (+1.000) | 0.400 (+0.400) | 0.500 (+0.000) | "
        "0.000 (+0.000) | 0.000 (+0.000) | 6.200 (+0.200) | 1.900 (+0.400) |"
    )
    assert device_kernel_table({"splits": {"dflash": split(8.0, [])}}) == []


def test_torch_compile_serves_the_drafters_in_graphs_as_vllm_serve_does():
    """Without torch.compile vLLM captures FULL graphs only and runs V1's drafters eager (its
    drafter graphs are piecewise, which needs torch.compile); ``--torch-compile`` takes vLLM's
    serving mode, whose mixed part graphs the drafter piecewise."""
    from vllm.config import CUDAGraphMode

    plain = compilation_config([33, 66], torch_compile=False)
    assert plain == {
        "mode": 0,
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [33, 66],
    }
    assert CUDAGraphMode[plain["cudagraph_mode"]].mixed_mode() == CUDAGraphMode.NONE
    compiled = compilation_config(None, torch_compile=True)
    assert compiled["mode"] == 3 and "cudagraph_capture_sizes" not in compiled
    assert CUDAGraphMode[compiled["cudagraph_mode"]].mixed_mode() == CUDAGraphMode.PIECEWISE
    assert CUDAGraphMode[compiled["cudagraph_mode"]].decode_mode() == CUDAGraphMode.FULL
