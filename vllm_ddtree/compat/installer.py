"""The installer: what vllm-ddtree changes in vLLM at run time, and when.

Written against vLLM 0.26.0. Every vLLM symbol the plugin wraps, replaces or builds on is a row
of ``compat/seams.py`` (its target, the parameters it binds by name, its wrapper); ``apply``
installs the engine's rows in every process vLLM starts and arms the model runners' rows for
when vLLM imports a runner. This module holds the engine-level wrappers:

* ``EngineArgs.create_speculative_config`` (in the API / ``LLM`` process, before any engine
  process starts): a ``"method": "ddtree"`` request is validated and rewritten to vLLM's DFlash
  request, the runner chosen, and the ``DDTreeConfig`` attached to the resulting
  ``SpeculativeConfig`` as ``ddtree_config`` (a plain attribute: it pickles with the config
  into engine-core and worker processes). ``create_engine_config``: the checks that need the
  resolved config (GatedDeltaNet tree states must fit the memory vLLM may use).
* ``SpeculativeConfig.max_num_new_slots_for_drafting``: a DDTree drafter runs ``depth`` mask
  queries, not ``num_speculative_tokens`` (= the tree budget) of them.
* ``Scheduler.__init__``: the KV lookahead a request gets each step covers every slot the
  DDTree drafter writes (``DDTreeConfig.kv_lookahead``).
* ``VllmConfig.use_v2_model_runner``: the runner ``config.choose_runner`` chose.
* ``SamplingParams._validate_spec_decode``: with DDTree configured, a request asking for what
  the tree sampler cannot apply yet is refused with an error naming the fields.
* ``CpuPlatform.get_attn_backend_cls``: TREE_ATTN when selected (its PyTorch path).

Every wrapper leaves an engine that does not use DDTree as vLLM makes it. TREE_ATTN takes vLLM's
``CUSTOM`` attention backend slot only in the processes of an engine that uses it
(``compat/tree_attn_slot.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from vllm_ddtree import envs
from vllm_ddtree.compat import (
    DDTREE_ATTR,
    DDTREE_CHAIN_ATTR,
    WRITTEN_FOR_VLLM,
    get_ddtree_config,
    incompatible,
    is_applied,
    seams,
    serves_chain_for_ddtree,
    vllm_version,
)
from vllm_ddtree.compat.handles import ArgsState, held, hold
from vllm_ddtree.compat.tree_attn_slot import (
    TREE_ATTN_NAME,
    TREE_ATTN_PATH,
    CustomSlotTaken,
    add_tree_attn_name,
    is_tree_attention,
    mark_uses_tree_attention,
    names_tree_attention,
    take_slot,
)
from vllm_ddtree.config import (
    DDTREE_METHOD,
    SCHEDULE_KEY,
    DDTreeConfig,
    DDTreeConfigError,
    check_cpu_gdn_state_dtype,
    check_drafter_is_dflash,
    check_engine_is_supported,
    check_sampling_params,
    check_target_is_supported,
    choose_runner,
    gives_batch_size_schedule,
    split_speculative_config,
)
from vllm_ddtree.graph_sizes import (
    largest_graph_for,
    schedule_within_graphs,
    verify_graph_sizes,
    vllm_largest_graph,
)
from vllm_ddtree.requests.options import check_request_options, install_stats_book

logger = logging.getLogger("vllm.ddtree")


def _speculative_config_fields() -> list[str]:
    from vllm.config import SpeculativeConfig

    return [f.name for f in dataclasses.fields(SpeculativeConfig)]


def _check_vllm_shape() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if "speculative_config" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        raise incompatible("EngineArgs has no speculative_config field")


def _as_backend(value):
    from vllm.config.attention import AttentionConfig

    return AttentionConfig.validate_backend_before(value) if isinstance(value, str) else value


def _choose_target_attention_backend(engine_args) -> None:
    """DDTree verifies with TREE_ATTN: select it for the target when none was chosen, and
    refuse a backend that cannot do tree attention. The (non-causal) DFlash drafter's backend
    stays vLLM's choice, as for the DFlash chain: vLLM selects one for the drafter
    independently of the target's unless ``speculative_config['attention_backend']`` names one
    (on an H200 in bf16: FLASH_ATTN, whose KV writes are one C++ launch per layer)."""
    config_backend = getattr(engine_args.attention_config, "backend", None)
    chosen = _as_backend(engine_args.attention_backend) or _as_backend(config_backend)
    if chosen is None:
        engine_args.attention_backend = TREE_ATTN_NAME
        chosen = _as_backend(TREE_ATTN_NAME)
    if chosen is _as_backend(TREE_ATTN_NAME):  # TREE_ATTN, or the CUSTOM slot it fills
        _take_custom_slot()
    if not is_tree_attention(chosen):
        raise DDTreeConfigError(
            f"method 'ddtree' verifies draft trees with the TREE_ATTN attention backend; the "
            f"target's attention backend {chosen.name} cannot do tree attention. Use "
            "--attention-backend TREE_ATTN or leave it unset (speculative_config"
            "['attention_backend'] chooses the drafter's backend)."
        )


def _take_custom_slot() -> None:
    """TREE_ATTN in vLLM's CUSTOM slot for this engine, or a config error naming the holder."""
    try:
        take_slot()
    except CustomSlotTaken as error:
        message = f"method 'ddtree' verifies draft trees with TREE_ATTN: {error}"
        raise DDTreeConfigError(message) from error


def _wrap_create_speculative_config(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        kept = held(self, ArgsState)  # an earlier call's, for DDTree engines only
        ddtree: DDTreeConfig | None = kept.config if kept is not None else None
        if getattr(self, "spec_method", None) == DDTREE_METHOD:
            # `--spec-method ddtree`: fold it into the dict the way vLLM folds the flag.
            self.speculative_config = dict(self.speculative_config or {})
            if "method" in self.speculative_config:
                raise DDTreeConfigError(
                    "--spec-method and --speculative-config['method'] are mutually exclusive"
                )
            self.speculative_config["method"] = DDTREE_METHOD
            self.spec_method = None
        raw = self.speculative_config
        asked_for_ddtree = False
        if isinstance(raw, dict):
            merged = dict(raw)
            if getattr(self, "spec_model", None) is not None and "model" not in merged:
                merged["model"] = self.spec_model
            if getattr(self, "spec_tokens", None) is not None:
                merged.setdefault("num_speculative_tokens", self.spec_tokens)
            runner = None
            asked_for_ddtree = merged.get("method") == DDTREE_METHOD
            if asked_for_ddtree:
                # The target first: refused whatever budget "auto" would choose.
                check_target_is_supported(
                    getattr(target_model_config.hf_config, "architectures", None),
                    _has_recurrent_layers(target_model_config),
                    _ssm_state_dtype(
                        getattr(self, "mamba_ssm_cache_dtype", None), target_model_config
                    ),
                    getattr(self, "mamba_cache_mode", None),
                )
                check_engine_is_supported(
                    getattr(target_model_config.hf_config, "layer_types", None),
                    getattr(target_parallel_config, "pipeline_parallel_size", 1),
                    getattr(self, "logits_processors", None),
                )
                if gives_batch_size_schedule(merged):
                    _check_batch_size_schedule(merged)
                runner = _choose_runner(target_model_config, target_parallel_config)
            vllm_dict, parsed = split_speculative_config(
                merged,
                _speculative_config_fields(),
                max_num_seqs=_max_num_seqs(self),
                runner=runner,
                tensor_parallel_size=getattr(target_parallel_config, "tensor_parallel_size", 1),
                target=getattr(target_model_config, "model", None),
                data_parallel_size=_data_parallel_size(target_parallel_config),
            )
            if parsed is not None:
                ddtree = parsed
                _choose_target_attention_backend(self)
                fitted = _size_graphs(
                    self,
                    ddtree,
                    vllm_dict.get(SCHEDULE_KEY),
                    _data_parallel_size(target_parallel_config),
                )
                if fitted is not None:
                    vllm_dict[SCHEDULE_KEY] = [list(entry) for entry in fitted]
                hold(self, ArgsState).config = ddtree
            if asked_for_ddtree:
                # vLLM gets the DFlash request (a tree's, or the chain "tree_budget": "auto"
                # chose); flags folded above must not be applied twice by vLLM.
                self.spec_model = None
                self.spec_tokens = None
                self.speculative_config = vllm_dict
        spec = original(self, target_model_config, target_parallel_config)
        if ddtree is None and spec is not None:
            # "auto" chose the chain (now or in an earlier call with these arguments, after
            # which they hold vLLM's DFlash request).
            if asked_for_ddtree or (kept is not None and kept.served_chain):
                hold(self, ArgsState).served_chain = True
                setattr(spec, DDTREE_CHAIN_ATTR, True)
        if ddtree is not None and spec is not None:
            hf_config = spec.draft_model_config.hf_config if spec.draft_model_config else None
            if hf_config is not None:
                check_drafter_is_dflash(
                    {
                        "dflash_config": getattr(hf_config, "dflash_config", None),
                        "architectures": getattr(hf_config, "architectures", None),
                    },
                    spec.model,
                )
            setattr(spec, DDTREE_ATTR, ddtree)
            logger.info(
                "vllm-ddtree: method 'ddtree' (tree_budget=%d, tree_top_k=%d, depth=%d) on the "
                "%s model runner with TREE_ATTN",
                ddtree.tree_budget,
                ddtree.tree_top_k,
                ddtree.depth,
                ddtree.runner.upper(),
            )
        return spec

    return create_speculative_config


def check_hybrid_state_memory(vllm_config) -> None:
    """A DDTree engine on a GatedDeltaNet target: its tree states must fit the memory vLLM may
    use (``gdn_state.check_slot_layout_fits``), checked on the final config (``max_num_seqs``
    is resolved after the speculative config). (Its state blocks get their final size only when
    the engine starts: ``gdn_layer.hybrid_tree_step`` checks them there.)"""
    ddtree = get_ddtree_config(vllm_config.speculative_config)
    model_config = vllm_config.model_config
    if ddtree is None or model_config is None or not model_config.is_hybrid:
        return
    from vllm_ddtree.hybrid.gdn_state import GDNStateShapes, check_slot_layout_fits

    cache = vllm_config.cache_config
    aligned = cache.mamba_cache_mode == "align"
    available = cache.kv_cache_memory_bytes
    if not available:
        from vllm.platforms import current_platform

        available = int(current_platform.get_device_total_memory() * cache.gpu_memory_utilization)
    shapes = GDNStateShapes.from_hf_config(
        model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size
    )
    ssm_dtype = _ssm_state_dtype(cache.mamba_ssm_cache_dtype, model_config)
    check_slot_layout_fits(
        shapes,
        vllm_config.scheduler_config.max_num_seqs,
        ddtree.tree_budget,
        available,
        ssm_bytes=2 if ssm_dtype == "bfloat16" else 4,
        extra_blocks=1 if aligned else 0,
    )


def _wrap_create_engine_config(original):
    """``EngineArgs.create_engine_config``: the checks that need the resolved config; an
    engine that attends with TREE_ATTN (a DDTree engine, or one naming it) is marked so."""

    def create_engine_config(self, *args, **kwargs):
        named_tree_attention = names_tree_attention(getattr(self, "attention_backend", None))
        config = original(self, *args, **kwargs)
        check_hybrid_state_memory(config)
        ddtree = get_ddtree_config(config.speculative_config)
        if ddtree is not None or serves_chain_for_ddtree(config.speculative_config):
            _check_cpu_hybrid_states(config)
        if ddtree is not None or named_tree_attention:
            # Its processes take vLLM's CUSTOM slot for TREE_ATTN (compat/tree_attn_slot.py).
            take_slot()
            mark_uses_tree_attention(config)
        held_args = held(self, ArgsState)
        if ddtree is not None and held_args is not None and held_args.sized_graphs:
            complete_verify_graph_sizes(config, ddtree)
        elif ddtree is not None and held_args is not None and held_args.user_graph_sizes:
            fit_schedule_to_users_graphs(config, ddtree, held_args.user_graph_sizes)
        return config

    return create_engine_config


def _check_cpu_hybrid_states(vllm_config) -> None:
    """A DDTree engine on a GatedDeltaNet target on the CPU platform: the SSM state dtype
    vLLM-CPU's prefill kernel takes (``config.check_cpu_gdn_state_dtype``), read after vLLM's
    platform settled it."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    if not current_platform.is_cpu() or model_config is None:
        return
    if _has_recurrent_layers(model_config):
        cache_dtype = vllm_config.cache_config.mamba_ssm_cache_dtype
        check_cpu_gdn_state_dtype(_ssm_state_dtype(cache_dtype, model_config))


def _wrap_drafting_slots(original):
    """A DDTree drafter runs ``depth`` mask queries, not ``num_speculative_tokens`` (the tree
    budget) of them."""

    def max_num_new_slots_for_drafting(self) -> int:
        ddtree = getattr(self, DDTREE_ATTR, None)
        if ddtree is None:
            return original(self)
        # One new slot per mask query but the first, as for DFlash, at the drafter's depth.
        return ddtree.depth - 1 + (1 if self.uses_draft_model() else 0)

    return max_num_new_slots_for_drafting


def _wrap_scheduler_init(original):
    """The scheduler reserves KV slots for everything the DDTree drafter writes
    (``DDTreeConfig.kv_lookahead``) and keeps each request's tree statistics
    (``requests.options.RequestStatsBook``)."""

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        ddtree = get_ddtree_config(vllm_config.speculative_config)
        if ddtree is not None:
            self.num_lookahead_tokens = max(self.num_lookahead_tokens, ddtree.kv_lookahead)
            install_stats_book(self)
        elif serves_chain_for_ddtree(vllm_config.speculative_config):
            install_stats_book(self, serves_chain=True)

    return __init__


def _wrap_use_v2_model_runner(original):
    """The runner ``choose_runner`` chose, carried by the config (V2 where vLLM can run it)."""

    def use_v2_model_runner(self) -> bool:
        ddtree = get_ddtree_config(self.speculative_config)
        if ddtree is not None:
            return ddtree.runner == "v2" and original(self)
        return original(self)

    return use_v2_model_runner


def _wrap_validate_spec_decode(original):
    """Requests asking for what the tree sampler cannot apply, or for DDTree options outside
    their allowed values (``requests.options``), are refused naming the fields."""

    def _validate_spec_decode(self, speculative_config, *args, **kwargs):
        original(self, speculative_config, *args, **kwargs)
        ddtree = get_ddtree_config(speculative_config)
        if ddtree is not None:
            check_sampling_params(self, ddtree.runner)
            check_request_options(self, ddtree.tree_budget)
        elif serves_chain_for_ddtree(speculative_config):  # "auto" chose the chain
            check_request_options(self, None)

    return _validate_spec_decode


def _wrap_get_attn_backend_cls(original):
    """vLLM-CPU always answers CPU_ATTN; it answers TREE_ATTN when that is selected."""

    def get_attn_backend_cls(cls, selected_backend, *args, **kwargs):
        if is_tree_attention(selected_backend):
            return TREE_ATTN_PATH
        return original(cls, selected_backend, *args, **kwargs)

    return get_attn_backend_cls


def complete_verify_graph_sizes(vllm_config, ddtree: DDTreeConfig) -> None:
    """On the V2 runner, once vLLM has made the engine's capture sizes, add what every verify
    width the engine can serve needs (``verify_graph_sizes`` of
    ``DDTreeConfig.served_verify_widths``). The V1 runner's dispatcher rounds the sizes to the
    width itself."""
    compilation = vllm_config.compilation_config
    pass_config = getattr(compilation, "pass_config", None)
    if ddtree.runner != "v2" or getattr(pass_config, "enable_sp", False):
        return  # (sequence parallelism keeps sizes that are multiples of its world size)
    sizes = list(compilation.cudagraph_capture_sizes or [])
    schedule = getattr(
        vllm_config.speculative_config, "num_speculative_tokens_per_batch_size", None
    )
    completed = verify_graph_sizes(
        sizes, ddtree.served_verify_widths(schedule), vllm_config.scheduler_config.max_num_seqs
    )
    if completed != sorted(sizes):
        compilation.cudagraph_capture_sizes = completed
        compilation.post_init_cudagraph_sizes()


def _data_parallel_size(parallel_config) -> int:
    return int(getattr(parallel_config, "data_parallel_size", 1) or 1)


def fit_schedule_to_users_graphs(vllm_config, ddtree: DDTreeConfig, given: list[int]) -> None:
    """On the V2 runner with the user's CUDA-graph sizes (kept as given): every batch size
    verifies a tree whose verify has a FULL graph, or drafts nothing (``schedule_within_graphs``
    of the sizes vLLM captures, else those given), and "auto" does not move online (its other
    widths may have no graph). Said in one line at start."""
    from dataclasses import replace

    from vllm_ddtree.budget.cost_model import format_schedule

    speculative = vllm_config.speculative_config
    sizes = list(vllm_config.compilation_config.cudagraph_capture_sizes or given)
    if ddtree.runner != "v2" or not sizes or vllm_config.parallel_config.data_parallel_size > 1:
        return
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    schedule = getattr(speculative, SCHEDULE_KEY, None)
    fitted = schedule_within_graphs(schedule, ddtree.tree_budget, sizes, max_num_seqs)
    setattr(speculative, SCHEDULE_KEY, [tuple(entry) for entry in fitted])
    if ddtree.online_budgets:
        setattr(speculative, DDTREE_ATTR, replace(ddtree, online_budgets=()))
    logger.info(
        "vllm-ddtree: with the CUDA-graph sizes given, trees are verified where a FULL graph "
        "holds them, tree nodes per batch size (requests: budget): %s%s",
        format_schedule(fitted),
        "; tree_budget 'auto' does not move online" if ddtree.online_budgets else "",
    )


def _size_graphs(engine_args, ddtree: DDTreeConfig, schedule=None, data_parallel_size: int = 1):
    """Give every verify batch and the DFlash drafter's batches a FULL CUDA graph.

    vLLM sizes its graphs for ``1 + num_speculative_tokens`` (here ``1 + tree_budget``) tokens
    per request: its largest is ``min(2 * max_num_seqs * (1 + budget), 512)`` tokens, and its
    graph managers keep only the FULL graphs of whole batches within it. A verify batch past
    it runs without a FULL graph (16 requests x 33 tokens = 528: the engine ran at 0.36x the
    chain), and so does a drafter batch when the tree is narrower than the drafter is deep
    (budget 4, one request: largest graph 10 tokens, drafter batch 16). Unless the user chose
    the graph sizes, the largest is set to ``largest_graph_for`` (``EngineArgs.
    max_cudagraph_capture_size``, read when vLLM builds its compilation config). On the V2
    runner, whose graphs cover every width of a per-batch-size schedule, an explicit budget
    without a schedule of the user's whose verify batches would still exceed it is returned as
    a schedule cutting those batches' trees to fit (``cost_model.fitting_schedule``), named in
    one warning at start; elsewhere (the V1 runner's graphs have one width, the user's
    schedule, or data parallelism, under which vLLM drops per-batch-size schedules) such
    batches are named in one warning and run without a FULL graph. Returns the schedule to
    serve, or None to keep the engine's."""
    compilation = getattr(engine_args, "compilation_config", None)
    chosen = (
        getattr(engine_args, "cudagraph_capture_sizes", None),
        getattr(engine_args, "max_cudagraph_capture_size", None),
        getattr(compilation, "cudagraph_capture_sizes", None),
        getattr(compilation, "max_cudagraph_capture_size", None),
    )
    if any(value is not None for value in chosen):
        # The user's sizes stand; the schedule is fitted to them once the config is made.
        hold(engine_args, ArgsState).user_graph_sizes = list(chosen[0] or chosen[2] or [])
        return None
    hold(engine_args, ArgsState).sized_graphs = True  # create_engine_config completes them
    max_num_seqs = _max_num_seqs(engine_args) or 1
    width = 1 + ddtree.tree_budget
    largest = largest_graph_for(max_num_seqs, ddtree.tree_budget, ddtree.depth)
    if largest != vllm_largest_graph(max_num_seqs, width):  # vLLM's own choice otherwise
        engine_args.max_cudagraph_capture_size = largest
    nodes = [ddtree.tree_budget] * (max_num_seqs + 1)
    if schedule:
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        nodes = build_dynamic_sd_schedule_lookup(schedule, max_num_seqs, ddtree.tree_budget)
    exceeding = [b for b in range(1, max_num_seqs + 1) if b * (1 + nodes[b]) > largest]
    if not exceeding:
        return None
    widths = sorted({1 + nodes[b] for b in exceeding})
    fits_by_schedule = ddtree.runner == "v2" and not schedule and data_parallel_size == 1
    if fits_by_schedule and not getattr(engine_args, "enforce_eager", False):
        from vllm_ddtree.budget.cost_model import fitting_schedule, format_schedule

        fitted = fitting_schedule(max_num_seqs, ddtree.tree_budget, largest)
        logger.warning(
            "vllm-ddtree: verify batches of %d to %d requests (%s tokens each) would exceed the "
            "largest CUDA graph (%d tokens); their trees are cut to fit it, tree nodes per "
            "batch size (requests: budget): %s",
            exceeding[0],
            exceeding[-1],
            "/".join(map(str, widths)),
            largest,
            format_schedule(fitted),
        )
        return fitted
    logger.warning(
        "vllm-ddtree: verify batches of %d to %d requests (%s tokens each) exceed the "
        "largest CUDA graph (%d tokens) and run without a FULL graph; lower tree_budget "
        "or max_num_seqs, or set max_cudagraph_capture_size",
        exceeding[0],
        exceeding[-1],
        "/".join(map(str, widths)),
        largest,
    )
    return None


def _max_num_seqs(engine_args) -> int | None:
    """The engine's request limit: the user's ``max_num_seqs``, else the largest of vLLM's
    defaults on this platform (vLLM sets its default after the speculative config is made;
    ``"tree_budget": "auto"`` must choose for as many concurrent requests as it may get)."""
    if getattr(engine_args, "max_num_seqs", None) is not None:
        return engine_args.max_num_seqs
    try:
        world_size = engine_args.pipeline_parallel_size * engine_args.tensor_parallel_size
        _, defaults = engine_args.get_batch_defaults(world_size)
        return max(defaults.values())
    except Exception:  # noqa: BLE001 - another vLLM: choose for batch 1 as before
        return None


def _check_batch_size_schedule(raw: dict) -> None:
    """vLLM's own check of ``SCHEDULE_KEY`` (ranges from batch size 1, not overlapping, nodes
    >= 0), before any engine process starts: vLLM runs it only when its scheduler starts."""
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    schedule = next(v for k, v in raw.items() if str(k).replace("-", "_") == SCHEDULE_KEY)
    try:
        validate_and_normalize_dynamic_sd_schedule(schedule)
    except (TypeError, ValueError) as error:
        raise DDTreeConfigError(
            f"speculative_config['{SCHEDULE_KEY}'] = {schedule!r}: {error} (allowed: a list of "
            "[first batch size, last batch size, tree nodes] ranges, the first from 1)"
        ) from error


def _choose_runner(target_model_config, target_parallel_config) -> str:
    """Choose the DDTree engine's model runner (``config.choose_runner``), "v1" or "v2",
    before its config is made (the cost profile of ``"tree_budget": "auto"`` is the runner's).
    The choice travels with the engine's config (``DDTreeConfig.runner``) to its processes."""
    from vllm.platforms import current_platform

    return choose_runner(
        on_gpu=current_platform.is_cuda(),
        has_recurrent_layers=_has_recurrent_layers(target_model_config),
        tensor_parallel_size=getattr(target_parallel_config, "tensor_parallel_size", 1),
        pipeline_parallel_size=getattr(target_parallel_config, "pipeline_parallel_size", 1),
        vllm_runner_env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
    )


def _ssm_state_dtype(cache_dtype: str | None, model_config) -> str | None:
    """The SSM state dtype name a ``mamba_ssm_cache_dtype`` setting gives ("auto": the model's
    dtype, as vLLM resolves it for GatedDeltaNet layers)."""
    if cache_dtype in (None, "auto"):
        return str(getattr(model_config, "dtype", "")).removeprefix("torch.") or cache_dtype
    return cache_dtype


def _has_recurrent_layers(model_config) -> bool:
    return bool(
        model_config.is_hybrid or model_config.has_inner_state or model_config.is_attention_free
    )


def apply() -> None:
    """Install the plugin in this process (idempotent): TREE_ATTN's registration, the engine
    seams now, the model runners' seams when vLLM imports a runner (``compat.seams``)."""
    from vllm.engine.arg_utils import EngineArgs

    add_tree_attn_name()
    if is_applied(EngineArgs.create_speculative_config):
        return
    version = vllm_version()
    if not version.startswith(WRITTEN_FOR_VLLM):
        logger.warning(
            "vllm-ddtree was written for vLLM %s; running on %s", WRITTEN_FOR_VLLM, version
        )
    _check_vllm_shape()
    seams.install(seams.ENGINE)
    seams.install_when_imported(seams.V1_RUNNER, seams.V1_RUNNER_MODULE)
    seams.install_when_imported(seams.CPU_RUNNER, seams.CPU_RUNNER_MODULE)
    # The V2 hooks are inert unless the engine's speculator is DDTree's (the runner choice
    # travels with the engine's config, ``DDTreeConfig.runner``).
    seams.install_when_imported(seams.V2_RUNNER, seams.V2_RUNNER_MODULE)
    if envs.test_float32_gdn():  # a test switch, see testing/float32_gdn_prefill.py
        seams.install_when_imported(seams.FLOAT32_GDN, seams.GDN_MODULE)
