"""The package's import graph (every import that runs, at module level or inside a function,
read from the source with ``ast``; ``if TYPE_CHECKING:`` imports for annotations excepted) has
no circle, and only ``compat`` reaches into the installer's helpers: each module is imported
for what it provides, never to break a cycle."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("vllm_ddtree", "tree_attn_backend")


def module_files() -> dict[str, str]:
    """Dotted module name -> file, for every module of the project's packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports_of(path: str, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from package import submodule`` counts as the
    submodule)."""
    tree = ast.parse(open(path).read())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }
    targets = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue  # an annotation's import: never runs, so it makes no circle
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            targets |= (submodules & modules) or {node.module}
    return {t for t in targets if t in modules}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    names = set(files)
    return {name: imports_of(path, names) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert graph["vllm_ddtree.spec_decode.v1_hooks"] and graph["vllm_ddtree.spec_decode.v2_hooks"]
    assert find_cycle(graph) is None, find_cycle(graph)


def test_only_the_package_entry_point_imports_the_installer():
    """``compat.installer`` installs everything; nothing it installs imports it back (they share
    what they need through ``compat``)."""
    graph = import_graph()
    importers = sorted(
        name for name, targets in graph.items() if "vllm_ddtree.compat.installer" in targets
    )
    assert importers == ["vllm_ddtree"], importers


def module_level_imports(path: str, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports when it is imported (not inside functions)."""
    tree = ast.parse(open(path).read())
    top = ast.Module(
        body=[n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))],
        type_ignores=[],
    )
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    body = top.body + [n for c in classes for n in c.body if not isinstance(n, ast.FunctionDef)]
    found = set()
    for statement in body:
        sub = ast.Module(body=[statement], type_ignores=[])
        for node in ast.walk(sub):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = {f"{node.module}.{alias.name}" for alias in node.names}
                found |= (names & modules) or {node.module}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
    return {name for name in found if name in modules}


def test_production_modules_load_no_test_kit():
    """``vllm_ddtree/testing/`` (tiny checkpoints, the oracle drafter, the float32 GDN prefill)
    is imported by tests and benchmarks, and by production code only behind its test switch
    (inside the function that found the switch set)."""
    files = module_files()
    names = set(files)
    loading = {
        name: sorted(
            t for t in module_level_imports(path, names) if t.startswith("vllm_ddtree.testing")
        )
        for name, path in files.items()
        if not name.startswith("vllm_ddtree.testing")
    }
    assert {name: kit for name, kit in loading.items() if kit} == {}


# Process-wide by nature: the plugin registers once per process; the phase timer is a
# benchmark's switch for the whole process (``benchmarks/step_split.py``).
PROCESS_WIDE = {"vllm_ddtree": {"_registered"}, "vllm_ddtree.metrics.step_ranges": {"_PHASE_TIMES"}}


def test_no_step_state_in_module_globals():
    """A step's state lives in its ``StepState`` (``spec_decode/step_state.py``): no module
    rebinds a global (``global name``) but the process-wide switches above, and no module
    writes the process environment to carry a choice to the engine's processes."""
    rebinding = {}
    writes_environment = []
    for name, path in module_files().items():
        tree = ast.parse(open(path).read())
        names = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
        if names - PROCESS_WIDE.get(name, set()):
            rebinding[name] = sorted(names)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Subscript) and "environ" in ast.unparse(target.value):
                    writes_environment.append(f"{name}: {ast.unparse(node)}")
    assert rebinding == {}, rebinding
    assert writes_environment == [], writes_environment


def test_annotation_only_imports_make_no_edge(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nimport a\nif TYPE_CHECKING:\n    import b\n"
    )
    assert imports_of(str(module), {"a", "b"}) == {"a"}


def test_the_budget_package_never_reaches_into_the_step():
    """``budget/`` is handed what the step knows (``online.WorkerReaders``); it imports
    nothing of ``spec_decode``."""
    graph = import_graph()
    reaching = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("vllm_ddtree.budget")
        for target in targets
        if target.startswith("vllm_ddtree.spec_decode")
    }
    assert reaching == set()


# What each subpackage may import of the rest of the project (its ``__init__`` docstring says
# the same); the root modules ``config``, ``envs``, ``handles``, ``scheduler_state`` and
# ``tree`` are open to all.
MAY_IMPORT = {
    "vllm_ddtree.hybrid": ("vllm_ddtree.ops",),
    "vllm_ddtree.requests": ("vllm_ddtree.compat",),
    "vllm_ddtree.metrics": ("vllm_ddtree.compat", "vllm_ddtree.requests", "vllm_ddtree.budget"),
    "vllm_ddtree.budget": ("vllm_ddtree.compat",),
    "vllm_ddtree.ops": ("tree_attn_backend.ops",),
    "vllm_ddtree.upstream": (),  # reads the project's files as text
}
OPEN_TO_ALL = (
    "vllm_ddtree.config",
    "vllm_ddtree.envs",
    "vllm_ddtree.handles",
    "vllm_ddtree.scheduler_state",
    "vllm_ddtree.tree",
)


def test_each_subpackage_imports_only_what_its_docstring_allows():
    graph = import_graph()
    outside = {
        (module, target)
        for package, allowed in MAY_IMPORT.items()
        for module, targets in graph.items()
        if module == package or module.startswith(package + ".")
        for target in targets
        if not target.startswith(package)
        and not target.startswith(allowed + OPEN_TO_ALL)
        and target not in ("vllm_ddtree",)
    }
    assert outside == set(), sorted(outside)
    for package in MAY_IMPORT:
        assert import_graph_has(graph, package), package


def import_graph_has(graph: dict[str, set[str]], package: str) -> bool:
    return any(module.startswith(package + ".") for module in graph)
