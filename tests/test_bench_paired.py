"""benchmarks/bench_paired.py: engines by turns, ratios of adjacent runs (its logic with a
stand-in engine, then real vLLM-CPU engines side by side in their own processes)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from benchmarks import bench_paired


def answer(tokens: int, seconds: float, drafts: int = 0, accepted: int = 0) -> dict:
    return {"tokens": [[0] * tokens], "seconds": seconds, "drafts": drafts, "accepted": accepted}


def test_each_round_runs_every_engine_once_in_a_rotating_order_after_an_untimed_pass():
    calls = []

    def run(name, prompts, temperature, one_at_a_time):
        calls.append((name, one_at_a_time))
        return answer(10, 1.0)

    names = ["ar", "dflash", "ddtree_v2_b16"]
    runs = bench_paired.measure_row(run, names, [[1, 2]], 0.0, batch=1, repeats=4)
    order = [name for name, _ in calls]
    assert order[:3] == names  # the untimed pass
    rounds = [order[3 + 3 * r : 6 + 3 * r] for r in range(4)]
    assert rounds == [bench_paired.turn_order(names, r) for r in range(4)]
    assert [r[0] for r in rounds] == ["ar", "dflash", "ddtree_v2_b16", "ar"]
    assert all(sorted(r) == sorted(names) for r in rounds)
    assert all(one for _, one in calls)  # batch 1: one request at a time
    assert {name: len(a) for name, a in runs.items()} == dict.fromkeys(names, 4)


def test_ratios_pair_each_round_with_the_chains_round():
    """A host that slows down for whole rounds moves every engine of the round alike: the
    paired ratios stay at the engines' true ratio where the medians of separate runs would
    not."""
    slow = [1.0, 1.6, 1.0, 1.6, 1.0]  # each round's host slowdown
    runs = {
        "dflash": [answer(100, 1.0 * s, drafts=10, accepted=8) for s in slow],
        "ddtree_v2_b64": [answer(100, 0.8 * s, drafts=10, accepted=15) for s in slow],
    }
    row = bench_paired.summarize_row(runs)
    ratio = row["over_chain"]["ddtree_v2_b64"]
    assert ratio["median"] == pytest.approx(1.25)
    assert ratio["min"] == pytest.approx(1.25) and ratio["max"] == pytest.approx(1.25)
    assert row["over_chain"]["dflash"]["median"] == pytest.approx(1.0)
    tree = row["engines"]["ddtree_v2_b64"]
    assert tree["tok_per_s"] == pytest.approx(125.0)
    assert tree["mean_acceptance_length"] == pytest.approx(2.5)
    assert row["engines"]["dflash"]["mean_acceptance_length"] == pytest.approx(1.8)


def test_a_row_keeps_each_requests_seconds_when_requests_ran_one_at_a_time():
    """A batch-1 row's requests run one at a time: each one's seconds stay in the row (which
    prompt a slow round came from), a batched row has none."""
    alone = {name: [answer(100, 1.0) for _ in range(2)] for name in ("dflash", "ddtree_b32")}
    for rounds in alone.values():
        for r, a in enumerate(rounds):
            a["request_seconds"] = [0.25 + r, 0.75]
    row = bench_paired.summarize_row(alone)
    assert row["engines"]["ddtree_b32"]["runs_request_seconds"] == [[0.25, 0.75], [1.25, 0.75]]
    batched = {name: [answer(100, 1.0)] for name in ("dflash", "ddtree_b32")}
    assert "runs_request_seconds" not in bench_paired.summarize_row(batched)["engines"]["dflash"]


def test_the_engines_are_auto_s_budgets_with_full_graph_sizes_and_their_runner():
    jobs = bench_paired.engine_jobs("drafter", depth=15, budgets=[16, 64], max_seqs=4)
    assert [j["name"] for j in jobs] == ["ar", "dflash", "ddtree_v2_b16", "ddtree_v2_b64"]
    tree = jobs[3]
    assert tree["env"] == {"VLLM_DDTREE_RUNNER": "v2"}
    assert tree["kwargs"]["speculative_config"]["tree_budget"] == 64
    assert {65 * b for b in range(1, 5)} <= set(tree["cudagraph_capture_sizes"])
    assert {16, 32, 64} <= set(tree["cudagraph_capture_sizes"])  # the drafter's ladder
    args = bench_paired.engine_args(tree, "target", {"dtype": "float32", "seed": None})
    assert args["dtype"] == "float32" and "seed" not in args
    assert args["max_num_batched_tokens"] >= 65 * 4
    # What "auto" serves on V2 with the packaged profile, per batch size.
    assert bench_paired.auto_engine(1) == "ddtree_v2_b128"
    assert bench_paired.auto_engine(16) == "dflash"
    assert bench_paired.auto_engine(64) == "ddtree_v2_b16"
    assert bench_paired.auto_engine(1, "v1") == "dflash"


def test_skip_leaves_out_named_engines_but_never_the_chain():
    jobs = bench_paired.engine_jobs("drafter", depth=15, budgets=[16, 32], max_seqs=4)
    kept = bench_paired.without_engines(jobs, ["ar"])
    assert [j["name"] for j in kept] == ["dflash", "ddtree_v2_b16", "ddtree_v2_b32"]
    assert bench_paired.without_engines(jobs, []) == jobs
    for wrong in (["dflash"], ["ddtree_v2_b64"]):
        with pytest.raises(ValueError, match=r"--skip: .* allowed: \['ar', 'ddtree_v2_b16'"):
            bench_paired.without_engines(jobs, wrong)


def flat_profile(tmp_path, source: str, tree_acceptance: dict[int, float]) -> str:
    """A cost profile whose steps all cost the same (the chain's and every tree's): the
    budget with the largest acceptance wins by far. Returns its JSON's path."""
    from vllm_ddtree.budget.cost_model import CostProfile, StepCost

    profile = CostProfile(
        source=source,
        depth=15,
        chain=StepCost(3.0, 0.0),
        tree=StepCost(3.0, 0.0),
        chain_acceptance=1.5,
        tree_acceptance=tree_acceptance,
        max_batch=64,
    )
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile.to_dict()))
    return str(path)


def test_auto_is_judged_by_the_cost_profile_given(tmp_path):
    """``--cost-profile``: the engine marked "auto" is the one that profile chooses, not the
    packaged profile's."""
    path = flat_profile(tmp_path, "test", {8: 2.0, 32: 4.0})
    assert bench_paired.auto_engine(16, "v2", path) == "ddtree_v2_b32"
    assert bench_paired.auto_engine(16, "v2") != "ddtree_v2_b32"


def stand_in_bench(tmp_path, monkeypatch, seconds: dict[str, float]):
    """``bench_paired.main`` with a stand-in engine per job (no vLLM), each round of engine
    ``name`` taking ``seconds.get(name, 0.5)``. Returns the argv of a run (before its
    options) and the list the stand-in records each started engine's job in."""
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 16}))
    prompts = {"eval": {name: [f"{name} {i}" for i in range(4)] for name in bench_paired.DATASETS}}
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    started = []

    class StandIn:
        def __init__(self, jobs, target, overrides, timeout, engine_core_process):
            started.extend(jobs)
            self.ready = {job["name"]: {"gpu": "gpu", "device_id": "id"} for job in jobs}

        def run(self, name, prompts, temperature, one_at_a_time, max_tokens):
            took = seconds.get(name, 0.5)
            return answer(max_tokens * len(prompts), took, drafts=4, accepted=4)

        def close(self):
            pass

    class Tokenizer:
        def apply_chat_template(self, messages, **kwargs):
            return [ord(c) for c in messages[0]["content"]]

    monkeypatch.setattr(bench_paired, "Engines", StandIn)
    monkeypatch.setattr(
        "transformers.AutoTokenizer.from_pretrained", lambda path: Tokenizer(), raising=True
    )
    argv = ["--target", "t", "--drafter", str(drafter), "--prompts", str(tmp_path / "prompts.json")]
    return argv, started


def test_a_run_leaves_out_skipped_engines_and_marks_what_the_given_profile_serves(
    tmp_path, monkeypatch
):
    """``main`` end to end with a stand-in engine per job (no vLLM): ``--skip ar`` starts no
    AR engine, ``--cost-profile`` decides the marked engine, and the summary records the depth
    and the profile's source (what ``cost_model`` fits a profile from)."""
    from benchmarks.fit_cost_profile import fit_profile

    profile = flat_profile(tmp_path, "calibration", {16: 2.0, 32: 4.0})
    argv, started = stand_in_bench(tmp_path, monkeypatch, {"dflash": 1.0})
    out = tmp_path / "out"
    argv += ["--out", str(out), "--batches", "4", "--temperatures", "0", "--repeats", "2"]
    argv += ["--skip", "ar", "--cost-profile", profile, "--budgets", "16"]
    assert bench_paired.main(argv) == 0
    assert [job["name"] for job in started] == ["dflash", "ddtree_v2_b16", "ddtree_v2_b32"]
    summary = json.loads((out / "bench_paired.json").read_text())
    assert summary["depth"] == 15 and summary["cost_profile"] == "calibration"
    (row,) = summary["rows"]
    assert row["auto_serves"] == "ddtree_v2_b32" and "ar" not in row["engines"]
    assert row["over_chain"]["ddtree_v2_b32"]["median"] == pytest.approx(2.0)
    assert sorted(fit_profile(summary).tree_acceptance) == [16, 32]
    assert "judged by the cost profile of calibration" in (out / "bench_paired.md").read_text()
    with pytest.raises(SystemExit):
        bench_paired.main(argv[:-4] + ["--skip", "dflash"])


def test_online_auto_runs_the_auto_engine_and_judges_it_against_the_fastest_fixed_budget(
    tmp_path, monkeypatch
):
    """``--online-auto``: the engine of "tree_budget": "auto" starts alone (the plugin's CUDA
    graphs, ``max_num_seqs`` the largest batch) beside the fixed budgets; every row marks it
    as "auto" (the profile's choice kept as ``profile_serves``) and the report holds it
    against the chain and the row's fastest fixed budget, round by round."""
    profile = flat_profile(tmp_path, "calibration", {16: 2.0, 32: 4.0})
    seconds = {"dflash": 1.0, "ddtree_v2_b16": 0.8, "ddtree_v2_b32": 0.4, bench_paired.AUTO: 0.5}
    argv, started = stand_in_bench(tmp_path, monkeypatch, seconds)
    out = tmp_path / "out"
    argv += ["--out", str(out), "--batches", "1,4", "--temperatures", "0", "--repeats", "2"]
    argv += ["--cost-profile", profile, "--budgets", "16", "--online-auto"]
    assert bench_paired.main(argv) == 0
    auto = next(job for job in started if job["name"] == bench_paired.AUTO)
    assert auto["start_alone"] and auto["max_seqs"] == 4
    assert auto["kwargs"]["speculative_config"]["tree_budget"] == "auto"
    assert bench_paired.engine_args(auto, "t")["compilation_config"] == {}
    summary = json.loads((out / "bench_paired.json").read_text())
    assert summary["online_auto"]
    for row in summary["rows"]:
        assert row["auto_serves"] == bench_paired.AUTO
        assert row["profile_serves"] == "ddtree_v2_b32"
        assert row["over_chain"][bench_paired.AUTO]["median"] == pytest.approx(2.0)
    report = (out / "bench_paired.md").read_text()
    assert '"auto": the engine of "tree_budget": "auto"' in report
    # b32 is the fastest fixed budget: "auto" at 0.5 s a round against its 0.4 s.
    table = report.split('## DDTree "auto" against the fastest fixed budget')[1]
    assert table.count("| b32 |") == len(summary["rows"]) == 4
    assert "| 2.00 (2.00-2.00) | 0.80 (0.80-0.80) |" in table
    with pytest.raises(SystemExit):
        bench_paired.main(argv + ["--ddtree-runner", "v1"])


def test_rows_are_per_set_at_batch_1_and_mixed_above():
    sets = {"humaneval": [[1], [2], [3]], "mtbench": [[4], [5]], "sharegpt": [[6], [7], [8]]}
    assert bench_paired.row_groups(sets, 1, 2) == {
        "humaneval": [[1], [2]],
        "mtbench": [[4], [5]],
        "sharegpt": [[6], [7]],
    }
    assert bench_paired.row_groups(sets, 4, 2) == {"mixed": [[1], [4], [6], [2]]}


@pytest.mark.vllm_engine
def test_real_engines_run_by_turns_in_their_own_processes(
    tiny_target_path, tiny_drafter_path, tmp_path
):
    """AR, vLLM's DFlash chain and DDTree (V1 runner: vLLM-CPU has no V2) started side by
    side, each in its own process with its own metrics; a row by turns; at T = 0 every engine
    gives the target alone's tokens (float32), and each engine's spec-decode counters are its
    own (the random drafter proposes, the target rejects: acceptance 1)."""
    pytest.importorskip("vllm")
    with open(os.path.join(tiny_drafter_path, "config.json")) as f:
        depth = json.load(f)["block_size"] - 1
    jobs = bench_paired.engine_jobs(tiny_drafter_path, depth, [8], max_seqs=2, runner="v1")
    cpu = {
        "dtype": "float32",
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "max_model_len": 512,
        "compilation_config": None,
        "gpu_memory_utilization": 0.12,  # on vLLM-CPU: the share of host memory, per engine
        "kv_cache_memory_bytes": None,
    }
    engines = bench_paired.Engines(jobs, tiny_target_path, cpu, timeout=600)
    try:
        assert {r["runner"] for r in engines.ready.values()} == {"V1"}

        def run(name, prompts, temperature, one_at_a_time):
            return engines.run(name, prompts, temperature, one_at_a_time, 24)

        names = [j["name"] for j in jobs]
        prompts = [[3, 17, 29, 41, 5, 11], [7, 7, 19, 23]]
        runs = bench_paired.measure_row(run, names, prompts, 0.0, batch=1, repeats=2)
    finally:
        engines.close()
    assert all(not p.is_alive() for p, _ in engines.workers.values())
    outputs = {name: answers[0]["tokens"] for name, answers in runs.items()}
    assert outputs["ddtree_b8"] == outputs["ar"] and outputs["dflash"] == outputs["ar"]
    assert all(len(t) == 24 for t in outputs["ar"])
    row = bench_paired.summarize_row(runs)
    drafts = {name: sum(a["drafts"] for a in answers) for name, answers in runs.items()}
    assert drafts["ar"] == 0 and drafts["dflash"] > 0 and drafts["ddtree_b8"] > 0
    assert row["engines"]["ddtree_b8"]["mean_acceptance_length"] >= 1.0
    assert set(row["over_chain"]) == set(names)


def test_the_report_names_auto_s_worst_row(tmp_path):
    def row(batch, tree_seconds, auto_serves):
        runs = {
            "dflash": [answer(100, 1.0)] * 3,
            "ddtree_v2_b16": [answer(100, tree_seconds)] * 3,
        }
        return {
            "dataset": "mixed",
            "batch": batch,
            "temperature": 0.0,
            **bench_paired.summarize_row(runs),
            "auto_serves": auto_serves,
        }

    summary = {
        "commit": "abc",
        "gpu": "gpu",
        "target_name": "t",
        "drafter_name": "d",
        "repeats": 3,
        "rows": [row(4, 0.8, "ddtree_v2_b16"), row(16, 1.25, "ddtree_v2_b16")],
    }
    bench_paired.write_report(summary, str(tmp_path))
    text = (tmp_path / "bench_paired.md").read_text()
    assert "lowest median of a row: 0.80 (mixed, batch 16, ddtree_v2_b16) over 2 rows" in text
    assert json.loads((tmp_path / "bench_paired.json").read_text())["rows"][1]["batch"] == 16


def test_the_readme_table_is_rewritten_from_the_runs_json(tmp_path):
    runs = {
        "ar": [answer(100, 0.9)] * 3,
        "dflash": [answer(100, 1.0)] * 3,
        "ddtree_v2_b64": [answer(100, 0.5)] * 3,
    }
    row = {"dataset": "humaneval", "batch": 1, "temperature": 0.0}
    row.update(bench_paired.summarize_row(runs))
    row["auto_serves"] = "ddtree_v2_b64"
    summary = {
        "commit": "abcdef123",
        "gpu": "NVIDIA H200",
        "target_name": "t",
        "drafter_name": "d",
        "repeats": 3,
        "max_tokens": 8,
        "rows": [row],
    }
    run_dir = tmp_path / "results" / "paired_x"
    bench_paired.write_report(summary, str(run_dir))
    readme = tmp_path / "README.md"
    readme.write_text(
        f"intro\n{bench_paired.README_BEGIN}\nold\n{bench_paired.README_END}\noutro\n"
    )
    args = ["--readme", str(readme), "--readme-from", str(run_dir / "bench_paired.json")]
    assert bench_paired.main(args) == 0
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "[paired_x](results/paired_x/bench_paired.md): commit abcdef1, NVIDIA H200" in text
    assert (
        "| paired_x | humaneval | 1 | 0 | 111 (1.00) | 100 (1.00) | 200 (1.00), b64 | "
        "2.00 (2.00-2.00) | 1.11 (1.11-1.11) |" in text
    )


def test_the_docs_paired_table_is_generated_from_the_committed_runs():
    """docs/speed.md's table must be what ``--readme`` writes from the runs it links (no
    number in it typed by hand)."""
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
    with open(os.path.join(docs, "speed.md")) as f:
        text = f.read()
    block = text.split(bench_paired.README_BEGIN, 1)[1].split(bench_paired.README_END, 1)[0]
    links = re.findall(r"^- \[[^\]]+\]\(([^)]+/bench_paired\.md)\)", block, flags=re.MULTILINE)
    assert links, "the paired table links its runs"
    sources = []
    for link in links:
        with open(os.path.join(docs, link.replace(".md", ".json"))) as f:
            sources.append((json.load(f), link))
    assert block.strip() == bench_paired.paired_table(sources)


def test_an_engine_that_fails_to_start_raises_its_error_at_once(tiny_target_path):
    """The first 27B DDTree engine was refused at start (the plugin's state check) and the
    bench waited out its 220 s start timeout, then said only "did not start in time": the
    worker's error now comes back at once, named."""
    pytest.importorskip("vllm")
    jobs = bench_paired.engine_jobs("unused", 15, [], max_seqs=1, runner="v1")[:1]
    started = time.time()
    with pytest.raises(RuntimeError, match="engine ar did not start: .*not_an_engine_arg"):
        bench_paired.Engines(jobs, tiny_target_path, {"not_an_engine_arg": 1}, timeout=600)
    assert time.time() - started < 120


def test_engines_marked_to_start_alone_start_after_the_others_one_by_one():
    """An online "auto" engine times its graphs as it captures them: it starts once the
    other engines are ready, alone; the rest start side by side as before."""
    from benchmarks.bench_paired import start_groups
    from benchmarks.scale_paired import auto_job

    auto = auto_job("drafter", 15, 64, "v2")
    copy = dict(auto, name=auto["name"] + "_fa")
    jobs = [{"name": "ar"}, auto, {"name": "dflash"}, copy, {"name": "ddtree_v2_b16"}]
    groups = [[job["name"] for job in group] for group in start_groups(jobs)]
    assert groups == [["ar", "dflash", "ddtree_v2_b16"], [auto["name"]], [copy["name"]]]
    assert start_groups([auto]) == [[auto]]
    assert start_groups([{"name": "ar"}]) == [[{"name": "ar"}]]
