"""The benchmarks are one package with one command line: every command names a module of
``benchmarks/`` that runs as ``python -m benchmarks COMMAND``, and no benchmark edits
``sys.path`` to find its siblings or the plugin."""

import ast
import os
import subprocess
import sys

from benchmarks.__main__ import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def test_every_command_is_a_benchmark_module_with_a_main():
    modules = {name[:-3] for name in os.listdir(BENCHMARKS) if name.endswith(".py")}
    for command, (module, _) in COMMANDS.items():
        assert module in modules, command
        tree = ast.parse(open(os.path.join(BENCHMARKS, f"{module}.py")).read())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), module


def test_no_benchmark_edits_sys_path():
    edits = []
    for name in sorted(os.listdir(BENCHMARKS)):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(BENCHMARKS, name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
                    edits.append(f"{name}:{node.lineno}")
    assert edits == []


def test_the_command_line_lists_its_commands_and_runs_one():
    listed = subprocess.run(
        [sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    )
    assert listed.returncode == 2 and all(c in listed.stdout for c in COMMANDS)
    helped = subprocess.run(
        [sys.executable, "-m", "benchmarks", "pad-heads", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert helped.returncode == 0 and "--tp" in helped.stdout, helped.stderr[-2000:]
