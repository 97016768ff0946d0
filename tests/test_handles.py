"""DDTree keeps what it owns per engine on one attribute of a vLLM object (``handles.py``)
and adds no other attribute of its own naming to vLLM's objects."""

from __future__ import annotations

import ast
import os
from types import SimpleNamespace

from vllm_ddtree.compat.installer import ArgsState
from vllm_ddtree.handles import HANDLE, held, hold
from vllm_ddtree.scheduler_state import SchedulerState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Data that rides with vLLM's messages (a request's tree parents, "auto"'s payload on a
# SchedulerStats), named in handles.py's docstring: not a handle.
MESSAGE_DATA = {"_ddtree_tree_parents", "_ddtree_payload"}


def private_ddtree_names(path: str) -> set[str]:
    """The ``_ddtree*`` names a module writes as attributes or spells as strings."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return {name for name in names if name.startswith("_ddtree")}


def test_the_package_adds_only_its_handle_to_vllms_objects():
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "vllm_ddtree")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                extra = private_ddtree_names(path) - {HANDLE} - MESSAGE_DATA
                if extra:
                    found[os.path.relpath(path, ROOT)] = sorted(extra)
    assert found == {}


def test_one_object_per_owner_made_on_first_use():
    scheduler = SimpleNamespace()
    assert held(scheduler, SchedulerState) is None
    state = hold(scheduler, SchedulerState)
    assert hold(scheduler, SchedulerState) is state and getattr(scheduler, HANDLE) is state
    assert held(scheduler, ArgsState) is None  # a handle of another kind is not taken for it
    assert vars(scheduler) == {HANDLE: state}
