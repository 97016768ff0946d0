"""Installing vllm-ddtree changes nothing for an engine that does not use ``"method":
"ddtree"``: the same requests through a plain target and through vLLM's DFlash chain, served
once with the plugin loaded and once with ``VLLM_PLUGINS=""``, give identical outputs,
identical rendered chat prompts (a Qwen3-style template whose ``enable_thinking`` switch is
sent as a string and as a boolean), identical ``/metrics`` names; and vLLM resolves the same
attention backends for those engines (also when one asks for the ``CUSTOM`` slot)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from tests.test_serve import ROOT, free_port, served  # noqa: E402

# Qwen3's switch: thinking is turned off only by ``enable_thinking`` being the boolean false
# (a Jinja ``is false`` test), so the string "false" leaves it on, as in stock vLLM.
QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} ; {% endfor %}"
    "{% if add_generation_prompt %}assistant :"
    "{% if enable_thinking is defined and enable_thinking is false %} w3 w3{% endif %}"
    "{% endif %}"
)
SWITCH_VALUES = ("false", False, "true", True, "False")
PROMPTS = ("w1 w2 w3", "w10 w20 w30 w40")


def metric_names(text: str) -> list[str]:
    """The metric names a ``/metrics`` page declares (its ``# TYPE`` lines)."""
    return sorted(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE "))


def what_the_server_does(port: int, model: str) -> dict:
    """Answers (greedy completions and a chat completion), rendered chat prompts and metric
    names of the server on ``port``."""
    from benchmarks.serve_check import request

    seen: dict = {}
    body = {"model": model, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    for i, prompt in enumerate(PROMPTS):
        answer = json.loads(request(port, "/v1/completions", {**body, "prompt": prompt}))
        seen[f"completion_{i}"] = answer["choices"][0]["text"]
    messages = [{"role": "user", "content": "w5 w6"}]
    for value in SWITCH_VALUES:
        kwargs = {"enable_thinking": value}
        chat = {**body, "messages": messages, "chat_template_kwargs": kwargs, "max_tokens": 8}
        answer = json.loads(request(port, "/v1/chat/completions", chat))
        seen[f"chat_{value!r}"] = answer["choices"][0]["message"]["content"]
        tokenized = json.loads(
            request(
                port,
                "/tokenize",
                {"model": model, "messages": messages, "chat_template_kwargs": kwargs},
            )
        )
        seen[f"prompt_{value!r}"] = tokenized["tokens"]
    seen["metric_names"] = metric_names(request(port, "/metrics").decode())
    return seen


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from benchmarks.serve_check import make_tokenizer
    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

    root = tmp_path_factory.mktemp("invisible")
    spec = TinyQwen3Spec()
    target = make_tiny_qwen3(str(root / "target"), spec)
    make_tokenizer(target, spec.vocab_size)
    drafter = make_tiny_dflash(str(root / "drafter"), spec)
    template = root / "qwen3_style.jinja"
    template.write_text(QWEN3_STYLE_TEMPLATE)
    return {"root": root, "target": target, "drafter": drafter, "template": str(template)}


def chain_config(drafter: str) -> dict:
    return {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}


@pytest.mark.vllm_engine
@pytest.mark.parametrize("engine", ["target_alone", "dflash_chain"])
def test_serving_without_ddtree_is_vllms_with_the_plugin_installed(tiny_pair, engine, tmp_path):
    target = tiny_pair["target"]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target]
    command += ["--chat-template", tiny_pair["template"], "--dtype", "float32"]
    command += ["--max-model-len", "512", "--max-num-seqs", "2", "--enforce-eager"]
    if engine == "dflash_chain":
        command += ["--speculative-config", json.dumps(chain_config(tiny_pair["drafter"]))]
    seen = {}
    for plugins in ("loaded", "not loaded"):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        if plugins == "not loaded":
            env["VLLM_PLUGINS"] = ""
        port = free_port()
        log = tmp_path / f"server_{plugins.replace(' ', '_')}.log"
        with served([*command, "--port", str(port)], env, port, log):
            seen[plugins] = what_the_server_does(port, target)
    # The check can fail: the template renders the string "false" and the boolean apart.
    assert seen["not loaded"]["prompt_'false'"] != seen["not loaded"]["prompt_False"]
    assert seen["loaded"] == seen["not loaded"]


@pytest.mark.vllm_engine
def test_attention_backends_are_vllms_for_engines_without_ddtree(tiny_pair):
    """The backend vLLM resolves for a plain target, a plain target asking for the CUSTOM
    slot (which no plugin of this engine fills: vLLM-CPU answers with its own backend), and
    the DFlash chain: the same with the plugin loaded as without it."""
    target, drafter = tiny_pair["target"], tiny_pair["drafter"]
    common = {"model": target, "max_model_len": 512, "dtype": "float32"}
    engines = {
        "target_alone": common,
        "target_alone_custom": {**common, "attention_backend": "CUSTOM"},
        "dflash_chain": {**common, "speculative_config": chain_config(drafter)},
    }
    resolved = {}
    for plugins, value in (("loaded", None), ("not loaded", "")):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("VLLM_PLUGINS", None)
        if value is not None:
            env["VLLM_PLUGINS"] = value
        proc = subprocess.run(
            [sys.executable, "tests/helpers/report_attention_backends.py", json.dumps(engines)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, proc.stderr[-3000:]
        resolved[plugins] = json.loads(lines[-1].removeprefix("RESULT "))
    assert not resolved["not loaded"]["target_alone"].startswith("error"), resolved
    assert resolved["loaded"] == resolved["not loaded"]


@pytest.mark.parametrize("in_output", [False, True], ids=["sync", "async"])
def test_engines_without_ddtree_keep_vllms_draft_update(in_output):
    """The wrapped draft updates of an engine without DDTree do what vLLM's do, and nothing
    more: rows zipped as vLLM zips them (no strict length check), requests untouched."""
    from vllm_ddtree.compat.scheduler_grammar import (
        _wrap_update_draft_token_ids,
        _wrap_update_draft_token_ids_in_output,
    )
    from vllm_ddtree.requests.structured_outputs import REQUEST_PARENTS_ATTR

    calls = []
    request = SimpleNamespace(
        is_finished=lambda: False, is_prefill_chunk=False, use_structured_output=True
    )
    setattr(request, REQUEST_PARENTS_ATTR, [[-1]])  # another code path's attribute
    scheduler = SimpleNamespace(
        vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(method="dflash")),
        requests={"a": request, "b": request},
    )
    # One more request id than rows of drafts: vLLM's plain zip reads the rows it has.
    drafts = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[1, 2]])
    if in_output:
        wrapped = _wrap_update_draft_token_ids_in_output(lambda *args: calls.append(args))
        wrapped(scheduler, drafts, SimpleNamespace(scheduled_spec_decode_tokens={}))
    else:
        wrapped = _wrap_update_draft_token_ids(lambda *args: calls.append(args))
        wrapped(scheduler, drafts)
    assert len(calls) == 1 and calls[0][1] is drafts
    assert getattr(request, REQUEST_PARENTS_ATTR) == [[-1]]
