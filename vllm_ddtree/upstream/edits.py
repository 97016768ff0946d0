"""The hand-written changes: edits of vLLM's own files and words of generated ones.

What the generated modules cannot say by themselves: a member of vLLM's attention backend
enum, a pytest marker, a package-data pattern. Each ``Edit`` names the file, the anchor (text
that must occur exactly once in vLLM's file, so an edit never lands in the wrong place of
another version), the text inserted after it and why. ``apply_edit`` refuses an anchor that
is missing or repeated.

Where a plugin module says something only a plugin says (a logger named for vLLM's logging
configuration from outside vLLM's package), a ``Substitution`` gives its in-tree words; its
text must occur exactly once in the module, so a change of the plugin's source that drops it
fails the export rather than leaving the plugin's words in vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class AnchorError(RuntimeError):
    """An edit's anchor does not occur exactly once in vLLM's file."""


@dataclass(frozen=True)
class Edit:
    path: str  # relative to vLLM's source root
    anchor: str
    text: str  # inserted right after the anchor
    why: str


@dataclass(frozen=True)
class Substitution:
    module: str  # the project module, dotted
    old: str
    new: str
    why: str


def substitute(module: str, text: str, substitutions: tuple[Substitution, ...]) -> str:
    """``text`` (the project module ``module``'s source) with its substitutions made."""
    for sub in substitutions:
        if sub.module != module:
            continue
        count = text.count(sub.old)
        if count != 1:
            raise AnchorError(
                f"{module}: the text of the substitution '{sub.why}' occurs {count} times "
                f"(must be once): {sub.old!r}"
            )
        text = text.replace(sub.old, sub.new)
    return text


def apply_edit(root: str, edit: Edit) -> None:
    """Insert ``edit.text`` after ``edit.anchor`` in ``root/edit.path``."""
    path = os.path.join(root, edit.path)
    with open(path) as f:
        source = f.read()
    count = source.count(edit.anchor)
    if count != 1:
        raise AnchorError(
            f"{edit.path}: the anchor of the edit '{edit.why}' occurs {count} times (must be "
            f"once): {edit.anchor!r}"
        )
    at = source.index(edit.anchor) + len(edit.anchor)
    with open(path, "w") as f:
        f.write(source[:at] + edit.text + source[at:])


TREE_ATTN_MEMBER = Edit(
    path="vllm/v1/attention/backends/registry.py",
    anchor='    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"\n',
    text='    TREE_ATTN = "vllm.v1.attention.backends.tree_attn.TreeAttentionBackend"\n',
    why="TREE_ATTN as a member of vLLM's attention backend enum (the plugin aliases CUSTOM)",
)
INTERPRETER_MARKER = Edit(
    path="pyproject.toml",
    anchor='    "cpu_test: mark test as CPU-only test",\n',
    text='    "interpreter: a Triton kernel test that also runs under TRITON_INTERPRET=1",\n',
    why="the marker of the kernel tests that run under Triton's interpreter",
)

COST_PROFILES_DATA = Edit(
    path="setup.py",
    anchor='        "model_executor/layers/quantization/utils/configs/*.json",\n',
    text='        "v1/spec_decode/ddtree/budget/cost_profiles/*.json",\n',
    why='the cost profiles "tree_budget": "auto" reads, in vLLM\'s wheel',
)

SUBSTITUTIONS: tuple[Substitution, ...] = (
    Substitution(
        module="tree_attn_backend.backend",
        old='logger = init_logger("vllm.tree_attn_backend")',
        new="logger = init_logger(__name__)",
        why="in vLLM's package a module's own name is under vLLM's logging configuration",
    ),
)
