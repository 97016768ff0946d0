"""Start vLLM engines in a subprocess (tests/helpers/run_vllm_generate.py) and read results."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
HELPER = os.path.join(HELPER_DIR, "run_vllm_generate.py")
TREE_ATTN_ACTIVE = "TREE_ATTN: tree attention backend active"


def tree_attn_backend_name() -> str:
    """The backend name vLLM reports for TREE_ATTN: its own enum member in a vLLM patched with
    the upstream series (``vllm_ddtree/upstream``), the ``CUSTOM`` slot the plugin fills
    otherwise."""
    import importlib.util

    in_tree = importlib.util.find_spec("vllm.v1.attention.backends.tree_attn") is not None
    return "TREE_ATTN" if in_tree else "CUSTOM"


def cpu_gdn_states_must_be_float32() -> bool:
    """Whether this host is a CPU without AMX tiles, where vLLM-CPU's GatedDeltaNet prefill
    takes float32 SSM states only and vLLM does not pick them by itself (it does with AMX):
    a hybrid engine here needs ``--mamba-ssm-cache-dtype float32``."""
    import torch

    return not torch.cuda.is_available() and not torch.cpu._is_amx_tile_supported()


def run_helper(
    script: str,
    *args: str,
    timeout: int = 900,
    rerun_after_interpreter_crash: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[dict, str]:
    """Run a script that prints one ``RESULT {json}`` line: a helper in ``tests/helpers/`` by
    name, or a module (``-m benchmarks.lifecycle_fuzz``). With
    ``rerun_after_interpreter_crash``, a run the interpreter itself died in (a signal or a
    fatal Python error, never a failed check: those exit with a traceback) is run once more,
    its crash reported as a warning; a second crash fails. ``env``: variables set for the
    subprocess.

    Returns (the parsed result, the subprocess's whole log)."""
    command = script.split() if script.startswith("-m ") else [HELPER_DIR + os.sep + script]

    def run_once():
        return subprocess.run(
            [sys.executable, *command, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )

    proc = run_once()
    if rerun_after_interpreter_crash and interpreter_crashed(proc.returncode, proc.stderr):
        import warnings

        warnings.warn(
            "the helper's interpreter crashed; run again. The crash:\n"
            + failure_summary(proc.returncode, proc.stderr),
            stacklevel=2,
        )
        proc = run_once()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, failure_summary(proc.returncode, proc.stderr)
    return json.loads(lines[-1].removeprefix("RESULT ")), proc.stdout + proc.stderr


def interpreter_crashed(returncode: int, stderr: str) -> bool:
    """Whether a subprocess died by a signal or in a fatal Python error (not by an exception
    or a failed check, which exit with status 1 and a traceback)."""
    return returncode < 0 or "Fatal Python error" in stderr


def failure_summary(returncode: int, stderr: str, head_lines: int = 30) -> str:
    """What a crashed helper said: its exit status, the first lines after a fatal error (the
    signal and the crashing thread's innermost frames: the tail of a deep stack is only its
    outer frames) and the log's tail, with runs of repeated lines collapsed."""
    lines = stderr.splitlines()
    fatal = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), None)
    parts = [f"exit status {returncode}"]
    if fatal is not None:
        parts.append("\n".join(_collapse_repeats(lines[max(fatal - 5, 0) : fatal + head_lines])))
    parts.append("\n".join(_collapse_repeats(lines))[-3000:])
    return "\n...\n".join(parts)


def _collapse_repeats(lines: list[str]) -> list[str]:
    """Lines with each run of one repeated block (a recursion's frames) printed once."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        for period in range(1, 13):
            block = lines[i : i + period]
            repeats = 1
            while lines[i + repeats * period : i + (repeats + 1) * period] == block:
                repeats += 1
            if repeats > 2:
                out += block + [f"  [the {period} lines above repeat {repeats - 1} more times]"]
                i += repeats * period
                break
        else:
            out.append(lines[i])
            i += 1
    return out


def run_engines(target: str, runs: list[dict], prompts: list[list[int]], max_tokens: int = 32):
    """Returns (results by run name, the subprocess's whole log)."""
    return run_helper(
        os.path.basename(HELPER), target, json.dumps(runs), json.dumps(prompts), str(max_tokens)
    )
