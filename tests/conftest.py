"""Shared fixtures: tiny random-weight checkpoints written once per session."""

import os

import pytest
import torch

from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Engines the tests start run without torch.compile: vLLM-CPU compiles its sampler's random
# sample at every engine start, about 13 s on a 2-core machine, and the suite starts about a
# hundred engines. The tests compare DDTree with the target alone, both run alike. Tests of
# vLLM's defaults (the README's serve command, a hybrid served with nothing but the speculative
# config) take it out of their servers' environment (``COMPILED``).
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


@pytest.fixture(scope="session")
def tiny_spec() -> TinyQwen3Spec:
    return TinyQwen3Spec()


@pytest.fixture(scope="session")
def tiny_target_path(tmp_path_factory, tiny_spec) -> str:
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("models") / "tiny-qwen3"), tiny_spec)


@pytest.fixture(scope="session")
def tiny_drafter_path(tmp_path_factory, tiny_spec) -> str:
    return make_tiny_dflash(str(tmp_path_factory.mktemp("models") / "tiny-dflash"), tiny_spec)


@pytest.fixture(scope="session")
def tiny_target(tiny_target_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_path, dtype=torch.float32)
    return model.eval()
