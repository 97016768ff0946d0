"""Start vLLM engines in a subprocess (tests/helpers/run_vllm_generate.py) and read results."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
HELPER = os.path.join(HELPER_DIR, "run_vllm_generate.py")
TREE_ATTN_ACTIVE = "TREE_ATTN: tree attention backend active"


def run_helper(script: str, *args: str, timeout: int = 900) -> tuple[dict, str]:
    """Run a script that prints one ``RESULT {json}`` line: a helper in ``tests/helpers/`` by
    name, or a module (``-m benchmarks.lifecycle_fuzz``).

    Returns (the parsed result, the subprocess's whole log)."""
    command = script.split() if script.startswith("-m ") else [HELPER_DIR + os.sep + script]
    proc = subprocess.run(
        [sys.executable, *command, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT ")), proc.stdout + proc.stderr


def run_engines(target: str, runs: list[dict], prompts: list[list[int]], max_tokens: int = 32):
    """Returns (results by run name, the subprocess's whole log)."""
    return run_helper(
        os.path.basename(HELPER), target, json.dumps(runs), json.dumps(prompts), str(max_tokens)
    )
