"""`vllm serve` with "method": "ddtree" answers like the target alone (CPU or GPU).

Builds a tiny random Qwen3 target with a word-level tokenizer and a chat template, a random
DFlash drafter, then starts the OpenAI server twice (target alone, then DDTree) and sends the
same greedy requests to /v1/completions and /v1/chat/completions, streamed and not, a
completion with its own DDTree options (``vllm_xargs``: ``tree_budget`` 4, ``ddtree_stats``)
and, unless ``--no-options``, request options: a chat completion with a JSON-schema
``response_format``, a completion with ``logprobs``, a chat completion with
``top_logprobs``, a completion with presence / frequency / repetition penalties and one with
``allowed_token_ids`` and ``bad_words``. The answers must be identical (logprobs within 1e-4);
/metrics of the DDTree server must show the spec-decode counters, its log one statistics line
per request that asked and its response the same statistics (``kv_transfer_params``), and an
out-of-range ``tree_budget`` must get a 400. Writes JSON; exits non-zero otherwise.

    python -m benchmarks.serve_check --out benchmarks/results [--port 8711] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} ; {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


# Tokens a JSON object of integers needs (``make_tokenizer(json_tokens=True)``).
JSON_TOKENS = ("{", "}", '"', ",", "[", "]", "-", *"0123456789", "n")
# The JSON schema of the structured-output request: {"n": <integer>}.
COUNT_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


def make_tokenizer(path: str, vocab_size: int, json_tokens: bool = False) -> None:
    """A word-level tokenizer over w0..w{V-1} (saved next to the target); with
    ``json_tokens``, the highest words give way to ``JSON_TOKENS`` and decoding joins tokens
    without spaces, so a grammar's JSON text comes back as it was generated."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extras = ("[UNK]", "<eos>", "user", "assistant", ":", ";", "system", "<pad>")
    punctuation = JSON_TOKENS if json_tokens else ()
    vocab = {f"w{i}": i for i in range(vocab_size - len(extras) - len(punctuation))}
    for extra in (*extras, *punctuation):
        vocab[extra] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if json_tokens:
        backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def request(port: int, route: str, body: dict | None = None) -> bytes:
    url = f"http://127.0.0.1:{port}{route}"
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if body is not None else {}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=300) as r:
        return r.read()


def streamed_text(raw: bytes, chat: bool) -> str:
    text = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        text.append((choice.get("delta") or {}).get("content") or "" if chat else choice["text"])
    return "".join(text)


def ask_all(port: int, model: str, prompts: list[str], options: bool = True) -> tuple[dict, list]:
    """The answers to compare, and per prompt the ``kv_transfer_params`` of the completion that
    asked for its own DDTree options (its tree statistics there with DDTree)."""
    answers, returned_stats = {}, []
    for i, prompt in enumerate(prompts):
        common = {"model": model, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        completion = json.loads(request(port, "/v1/completions", {**common, "prompt": prompt}))
        answers[f"completion_{i}"] = completion["choices"][0]["text"]
        raw = request(port, "/v1/completions", {**common, "prompt": prompt, "stream": True})
        answers[f"completion_stream_{i}"] = streamed_text(raw, chat=False)
        messages = [{"role": "user", "content": prompt}]
        chat = json.loads(request(port, "/v1/chat/completions", {**common, "messages": messages}))
        answers[f"chat_{i}"] = chat["choices"][0]["message"]["content"]
        raw = request(
            port, "/v1/chat/completions", {**common, "messages": messages, "stream": True}
        )
        answers[f"chat_stream_{i}"] = streamed_text(raw, chat=True)
        # A request's own DDTree options (vllm_xargs): ignored without DDTree.
        xargs = {"tree_budget": 4, "ddtree_stats": True}
        own = json.loads(
            request(port, "/v1/completions", {**common, "prompt": prompt, "vllm_xargs": xargs})
        )
        answers[f"completion_own_budget_{i}"] = own["choices"][0]["text"]
        returned_stats.append(own.get("kv_transfer_params"))
        if options:
            answers.update(
                {f"{name}_{i}": answer for name, answer in ask_options(port, model, prompt)}
            )
    return answers, returned_stats


def ask_options(port: int, model: str, prompt: str):
    """(name, answer) of each request option: a JSON-schema ``response_format`` (greedy, up
    to the grammar's end), ``logprobs`` on a completion and ``top_logprobs`` on a chat."""
    messages = [{"role": "user", "content": prompt}]
    common = {"model": model, "max_tokens": 24, "temperature": 0.0}
    schema = {"type": "json_schema", "json_schema": {"name": "count", "schema": COUNT_SCHEMA}}
    chat = {**common, "messages": messages, "response_format": schema}
    answer = json.loads(request(port, "/v1/chat/completions", chat))
    yield "chat_json_schema", answer["choices"][0]["message"]["content"]
    completion = {**common, "prompt": prompt, "ignore_eos": True, "logprobs": 3}
    answer = json.loads(request(port, "/v1/completions", completion))["choices"][0]
    yield "completion_logprobs", {"text": answer["text"], "logprobs": answer["logprobs"]}
    chat = {**common, "messages": messages, "ignore_eos": True, "logprobs": True}
    answer = json.loads(request(port, "/v1/chat/completions", {**chat, "top_logprobs": 2}))
    choice = answer["choices"][0]
    yield "chat_logprobs", {"text": choice["message"]["content"], "logprobs": choice["logprobs"]}
    plain = {**common, "prompt": prompt, "ignore_eos": True}
    penalised = {
        **plain,
        "presence_penalty": 0.6,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.4,
    }
    answer = json.loads(request(port, "/v1/completions", penalised))
    yield "completion_penalties", answer["choices"][0]["text"]
    masked = {**plain, "allowed_token_ids": list(range(0, 900, 3)), "bad_words": ["w3 w6", "w9"]}
    answer = json.loads(request(port, "/v1/completions", masked))
    yield "completion_allowed_ids_bad_words", answer["choices"][0]["text"]


def same_answer(a, b, tolerance: float = 1e-4) -> bool:
    """Equal answers: strings, token lists and keys exactly, floats (logprobs) within
    ``tolerance``."""
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, (int, float))
            and isinstance(b, (int, float))
            and (abs(a - b) <= tolerance)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_answer(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        pairs = zip(a, b, strict=False)
        return len(a) == len(b) and all(same_answer(x, y, tolerance) for x, y in pairs)
    return a == b


def status_of(port: int, route: str, body: dict) -> int:
    """The HTTP status of a request expected to be refused."""
    try:
        request(port, route, body)
        return 200
    except urllib.error.HTTPError as error:
        return error.code


def serve(model: str, port: int, extra: list[str], log_path: str):
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "4",
        *extra,
    ]
    log = open(log_path, "w")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # CPU platform: KV cache size in GiB
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            request(port, "/v1/models")
            return proc
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(2)
    stop(proc)
    raise TimeoutError(f"server did not come up; see {log_path}")


def stop(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except Exception:  # noqa: BLE001
        os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work", default="/tmp/vllm-ddtree-serve")
    parser.add_argument("--port", type=int, default=8711)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--no-options",
        action="store_true",
        help="leave out the request options",
    )
    parser.add_argument(
        "--server-args", default="", help="more `vllm serve` arguments, e.g. memory limits"
    )
    args = parser.parse_args()
    if args.dtype == "float32":
        # Triton's float32 dots in IEEE precision (TF32 by default on NVIDIA GPUs), in both
        # servers' attention kernels: otherwise logprobs part at about 1e-2 between the
        # target alone's kernel shapes and the tree verify's, as the lossless grid's
        # --f32-dots ieee avoids.
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    from benchmarks.common import git_commit
    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

    spec = TinyQwen3Spec()
    target = make_tiny_qwen3(os.path.join(args.work, "target"), spec)
    make_tokenizer(target, spec.vocab_size, json_tokens=True)
    drafter = make_tiny_dflash(os.path.join(args.work, "drafter"), spec)
    prompts = ["w1 w2 w3", "w10 w20 w30 w40", "w7"]
    common = ["--dtype", args.dtype, *args.server_args.split()]
    ddtree = json.dumps({"method": "ddtree", "model": drafter, "tree_budget": 16})
    os.makedirs(args.out, exist_ok=True)
    results, returned_stats = {}, {}
    metrics_text = ""
    refused = None  # the DDTree server's status for an out-of-range tree_budget
    for name, extra in (("target", common), ("ddtree", [*common, "--speculative-config", ddtree])):
        proc = serve(target, args.port, extra, os.path.join(args.out, f"serve_{name}.log"))
        try:
            results[name], returned_stats[name] = ask_all(
                args.port, target, prompts, not args.no_options
            )
            if name == "ddtree":
                metrics_text = request(args.port, "/metrics").decode()
                bad = {"model": target, "prompt": prompts[0], "max_tokens": 4}
                refused = status_of(
                    args.port, "/v1/completions", {**bad, "vllm_xargs": {"tree_budget": 99}}
                )
        finally:
            stop(proc)
    differences = [
        k for k in results["target"] if not same_answer(results["target"][k], results["ddtree"][k])
    ]
    spec_lines = [line for line in metrics_text.splitlines() if line.startswith("vllm:spec_decode")]
    # The model runner the DDTree server chose (its start-up log line).
    with open(os.path.join(args.out, "serve_ddtree.log"), errors="replace") as f:
        server_log = f.read()
    runner = re.search(r"method 'ddtree' .* on the (V\d) model runner", server_log)
    # One line per request that asked for its tree statistics (ddtree_stats).
    stats_lines = re.findall(r"vllm-ddtree: request \S+: \d+ verify steps.*", server_log)
    summary = {
        "commit": git_commit(),
        "identical": not differences,
        "differences": differences,
        "answers_checked": len(results["target"]),
        "ddtree_runner": runner.group(1) if runner else None,
        "out_of_range_tree_budget_status": refused,
        "request_stats_lines": stats_lines,
        # Per prompt, the statistics the DDTree server returned to the request that asked.
        "request_stats_returned": [
            (params or {}).get("ddtree_stats") for params in returned_stats["ddtree"]
        ],
        "target_alone_kv_transfer_params": returned_stats["target"],
        "metrics": spec_lines[:20],
        "triton_f32_dots": os.environ.get("TRITON_F32_DEFAULT", "Triton's default"),
        "answers": results,
        "example": {
            k: results["ddtree"][k]
            for k in ("completion_0", "chat_stream_0", "chat_json_schema_0")
            if k in results["ddtree"]
        },
    }
    with open(os.path.join(args.out, "serve_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("metrics", "answers")}))
    returned = [stats for stats in summary["request_stats_returned"] if stats]
    passed = (
        not differences
        and spec_lines
        and refused == 400
        and len(stats_lines) == len(prompts)
        and len(returned) == len(prompts)
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
