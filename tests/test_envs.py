"""``vllm_ddtree/envs.py`` is the one place the package reads its environment variables: every
``VLLM_DDTREE_*`` name the code uses is declared there, no other module reads one from
``os.environ``, the README's table lists the user and debugging switches with their values,
and a value a switch does not allow stops a DDTree engine's config naming the allowed ones."""

import ast
import os
import re

import pytest

from vllm_ddtree import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = ("vllm_ddtree", "tree_attn_backend", "benchmarks")
NAME = re.compile(r"VLLM_DDTREE_[A-Z0-9_]+")


def python_files():
    for package in CODE:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def test_every_variable_the_code_names_is_declared():
    named = set()
    for path in python_files():
        named |= set(NAME.findall(open(path).read()))
    assert named - set(envs.VARIABLES) == set()


def reads_environ(path: str) -> list[int]:
    """Lines of ``path`` that read ``os.environ`` (``.get``, ``[...]``) or ``os.getenv``."""
    lines = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment():
    """The package reads the environment in ``envs`` alone, besides vLLM's own
    ``VLLM_USE_V2_MODEL_RUNNER`` (passed to the runner choice), the demo setting the
    offline hub for the engines it starts, and the series export handing git its environment
    with a fixed identity."""
    allowed = {
        "vllm_ddtree/envs.py",
        "vllm_ddtree/spec_request.py:VLLM_USE_V2_MODEL_RUNNER",
        "vllm_ddtree/demo.py:HF_HUB_OFFLINE",
        "vllm_ddtree/upstream/export.py:GIT_IDENTITY",
    }
    found = []
    for package in ("vllm_ddtree", "tree_attn_backend"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(path, ROOT)
                source = open(path).read().splitlines()
                for line in reads_environ(path):
                    text = source[line - 1]
                    key = next((a for a in allowed if a.startswith(rel + ":")), None)
                    if rel in allowed or (key and key.split(":")[1] in text):
                        continue
                    found.append(f"{rel}:{line}: {text.strip()}")
    assert found == []


def readme_rows() -> dict[str, str]:
    """The README's environment table: variable -> its row."""
    rows = {}
    for line in open(os.path.join(ROOT, "README.md")).read().splitlines():
        match = re.match(r"\| `(VLLM_DDTREE_[A-Z0-9_]+)", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_the_readme_lists_the_user_and_debugging_switches_with_their_values():
    rows = readme_rows()
    switches = {v.name for v in envs.VARIABLES.values() if v.audience in ("user", "debug")}
    assert set(rows) == switches
    for name in switches:
        variable = envs.VARIABLES[name]
        for value in variable.choices or ():
            if value and value not in envs.FLAG and value not in ("false", "true"):
                assert f"`{value}`" in rows[name] or f"={value}" in rows[name], (name, value)


def test_a_value_a_switch_does_not_allow_is_named_with_the_allowed_ones(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    envs.check_all()
    assert envs.runner() is None and envs.tree_attn_context() == "auto"
    assert envs.coupled_drafts() and not envs.checking_steps() and not envs.torch_ops()
    monkeypatch.setenv(envs.RUNNER, " V2 ")
    assert envs.runner() == "v2"
    monkeypatch.setenv(envs.CHECK_STEPS, "yes")
    named = r"VLLM_DDTREE_CHECK_STEPS='yes': allowed values are '0' or '1'"
    with pytest.raises(ValueError, match=named):
        envs.check_all()
    monkeypatch.delenv(envs.CHECK_STEPS)
    monkeypatch.setenv(envs.RUNNER, "v3")
    with pytest.raises(ValueError, match="'v1' or 'v2', or unset"):
        envs.runner()


def test_a_ddtree_engine_with_a_bad_switch_is_refused_before_it_starts(monkeypatch):
    from vllm_ddtree.config import DDTreeConfigError, check_engine_is_supported

    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    check_engine_is_supported(["full_attention"])
    monkeypatch.setenv(envs.TREE_ATTN_CONTEXT, "fa3")
    with pytest.raises(DDTreeConfigError, match="VLLM_DDTREE_TREE_ATTN_CONTEXT='fa3'"):
        check_engine_is_supported(["full_attention"])
