"""The benchmarks (the ``benchmarks`` package), imported for tests."""

import importlib
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks.<name>`` (its ``main`` is not run)."""
    return importlib.import_module(f"benchmarks.{name}")
