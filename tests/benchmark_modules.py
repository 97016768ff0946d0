"""The scripts in ``benchmarks/`` (a folder of scripts, not a package), imported for tests."""

import importlib.util
import os
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (its ``main`` is not run)."""
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
