"""A ``"method": "ddtree"`` speculative config made into vLLM's DFlash request, before vLLM
builds its ``SpeculativeConfig`` (``EngineArgs.create_speculative_config``), and the engine's
config finished for the tree once vLLM has made it (``EngineArgs.create_engine_config``).

``serve_ddtree_request`` is what ``create_speculative_config`` calls: ``ddtree_request``
checks the target and the engine (whatever budget "auto" would choose), chooses the model
runner and splits the dict into vLLM's DFlash request and the tree's settings
(``config.split_speculative_config``); TREE_ATTN is selected for the target
(``select_tree_attention``); ``size_tree_graphs`` gives every verify batch and the drafter's
batches a FULL CUDA graph (``graph_sizes``). ``finish_tree_engine_config`` completes the
capture sizes once vLLM has made them. ``fold_spec_method`` folds ``--spec-method ddtree`` into
the dict the way vLLM folds the flag; ``check_ddtree_drafter`` checks that the drafter vLLM
loaded is a DFlash one. The helpers read and set vLLM's engine arguments and configs only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_ddtree.config import (
    DDTREE_ATTR,
    DDTREE_CHAIN_ATTR,
    DDTREE_METHOD,
    SCHEDULE_KEY,
    DDTreeConfig,
    DDTreeConfigError,
    check_cpu_gdn_state_dtype,
    check_drafter_is_dflash,
    check_engine_is_supported,
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

logger = logging.getLogger("vllm.ddtree")

# The attention backend that verifies draft trees.
TREE_ATTN_NAME = "TREE_ATTN"


@dataclass
class DDTreeRequest:
    """What a ``"method": "ddtree"`` request became."""

    # vLLM's DFlash request: the tree's (``num_speculative_tokens`` = the tree budget) or the
    # chain "tree_budget": "auto" chose.
    speculative_config: dict[str, Any]
    # The tree's settings; None where "auto" chose the chain.
    ddtree: DDTreeConfig | None


@dataclass
class TreeGraphSizing:
    """What ``size_tree_graphs`` decided for a tree engine's CUDA graphs."""

    # A per-batch-size schedule cutting the trees of batches past the largest graph, or None.
    schedule: list | None = None
    # vLLM's sizes were left to vLLM with the largest raised: complete them for every verify
    # width once vLLM has made them (``create_engine_config``).
    sized_graphs: bool = False
    # The sizes the user chose (they stand): fit the schedule to them once the config is made.
    user_graph_sizes: list[int] = field(default_factory=list)


def fold_spec_method(engine_args) -> None:
    """``--spec-method ddtree``: folded into ``speculative_config`` as vLLM folds the flag."""
    if getattr(engine_args, "spec_method", None) != DDTREE_METHOD:
        return
    engine_args.speculative_config = dict(engine_args.speculative_config or {})
    if "method" in engine_args.speculative_config:
        raise DDTreeConfigError(
            "--spec-method and --speculative-config['method'] are mutually exclusive"
        )
    engine_args.speculative_config["method"] = DDTREE_METHOD
    engine_args.spec_method = None


def ddtree_request(
    engine_args, target_model_config, target_parallel_config
) -> DDTreeRequest | None:
    """The DFlash request and tree settings a ``"method": "ddtree"`` speculative config gives
    (None for any other config). The target is checked first: refused whatever budget
    "auto" would choose."""
    raw = engine_args.speculative_config
    if not isinstance(raw, dict):
        return None
    merged = dict(raw)
    if getattr(engine_args, "spec_model", None) is not None and "model" not in merged:
        merged["model"] = engine_args.spec_model
    if getattr(engine_args, "spec_tokens", None) is not None:
        merged.setdefault("num_speculative_tokens", engine_args.spec_tokens)
    if merged.get("method") != DDTREE_METHOD:
        # Refuses DDTree's keys without "method": "ddtree"; the dict stays the user's.
        split_speculative_config(merged, speculative_config_fields())
        return None
    check_target_is_supported(
        getattr(target_model_config.hf_config, "architectures", None),
        has_recurrent_layers(target_model_config),
        ssm_state_dtype(getattr(engine_args, "mamba_ssm_cache_dtype", None), target_model_config),
        getattr(engine_args, "mamba_cache_mode", None),
    )
    check_engine_is_supported(
        getattr(target_model_config.hf_config, "layer_types", None),
        getattr(target_parallel_config, "pipeline_parallel_size", 1),
        getattr(engine_args, "logits_processors", None),
    )
    if gives_batch_size_schedule(merged):
        check_batch_size_schedule(merged)
    vllm_dict, ddtree = split_speculative_config(
        merged,
        speculative_config_fields(),
        max_num_seqs=engine_max_num_seqs(engine_args),
        runner=choose_engine_runner(target_model_config, target_parallel_config),
        tensor_parallel_size=getattr(target_parallel_config, "tensor_parallel_size", 1),
        target=getattr(target_model_config, "model", None),
        data_parallel_size=data_parallel_size(target_parallel_config),
    )
    return DDTreeRequest(speculative_config=vllm_dict, ddtree=ddtree)


def serve_ddtree_request(
    engine_args,
    target_model_config,
    target_parallel_config,
    is_tree_attention: Callable[[Any], bool],
) -> tuple[DDTreeRequest, TreeGraphSizing] | None:
    """Make ``engine_args.speculative_config``, a ``"method": "ddtree"`` dict, into vLLM's
    DFlash request (``ddtree_request``); for a tree (not the chain "auto" may choose), select
    TREE_ATTN for the target (``is_tree_attention`` says whether a backend of vLLM's is it) and
    size the CUDA graphs (``size_tree_graphs``). Returns the request and the sizing decided,
    or None (``engine_args`` untouched) for any other config."""
    request = ddtree_request(engine_args, target_model_config, target_parallel_config)
    if request is None:
        return None
    sizing = TreeGraphSizing()
    if request.ddtree is not None:
        select_tree_attention(engine_args, is_tree_attention)
        sizing = size_tree_graphs(
            engine_args,
            request.ddtree,
            request.speculative_config.get(SCHEDULE_KEY),
            data_parallel_size(target_parallel_config),
        )
        if sizing.schedule is not None:
            request.speculative_config[SCHEDULE_KEY] = [list(e) for e in sizing.schedule]
    # vLLM gets the DFlash request (a tree's, or the chain "tree_budget": "auto" chose); flags
    # folded into it must not be applied twice by vLLM.
    engine_args.spec_model = None
    engine_args.spec_tokens = None
    engine_args.speculative_config = request.speculative_config
    return request, sizing


def select_tree_attention(engine_args, is_tree_attention: Callable[[Any], bool]) -> None:
    """DDTree verifies with TREE_ATTN: select it for the target when none was chosen, and
    refuse a backend that cannot do tree attention. The (non-causal) DFlash drafter's backend
    stays vLLM's choice, as for the DFlash chain: vLLM selects one for the drafter
    independently of the target's unless ``speculative_config['attention_backend']`` names one
    (on an H200 in bf16: FLASH_ATTN, whose KV writes are one C++ launch per layer)."""
    config_backend = getattr(engine_args.attention_config, "backend", None)
    chosen = attention_backend(engine_args.attention_backend) or attention_backend(config_backend)
    if chosen is None:
        engine_args.attention_backend = TREE_ATTN_NAME
        chosen = attention_backend(TREE_ATTN_NAME)
    if not is_tree_attention(chosen):
        raise DDTreeConfigError(
            f"method 'ddtree' verifies draft trees with the TREE_ATTN attention backend; the "
            f"target's attention backend {chosen.name} cannot do tree attention. Use "
            "--attention-backend TREE_ATTN or leave it unset (speculative_config"
            "['attention_backend'] chooses the drafter's backend)."
        )


def attention_backend(value):
    """vLLM's ``AttentionBackendEnum`` member an ``attention_backend`` setting names."""
    from vllm.config.attention import AttentionConfig

    return AttentionConfig.validate_backend_before(value) if isinstance(value, str) else value


def finish_tree_engine_config(vllm_config, sizing: TreeGraphSizing | None) -> None:
    """Once vLLM has made the config of an engine asked for DDTree (a tree's, or the chain
    "auto" chose): check a GatedDeltaNet target's states (``check_cpu_hybrid_states``,
    ``check_hybrid_state_memory``), then, for a tree, complete the capture sizes DDTree raised
    for every verify width (``complete_verify_graph_sizes``) or fit the batch-size schedule to
    the user's sizes (``fit_schedule_to_users_graphs``), as ``sizing`` (what
    ``serve_ddtree_request`` decided) says. Any other engine's config is left alone."""
    speculative = vllm_config.speculative_config
    ddtree = getattr(speculative, DDTREE_ATTR, None)
    if ddtree is None and not getattr(speculative, DDTREE_CHAIN_ATTR, False):
        return
    if ddtree is not None:
        check_hybrid_state_memory(vllm_config, ddtree)
    check_cpu_hybrid_states(vllm_config)
    if ddtree is None or sizing is None:
        return
    if sizing.sized_graphs:
        complete_verify_graph_sizes(vllm_config, ddtree)
    elif sizing.user_graph_sizes:
        fit_schedule_to_users_graphs(vllm_config, ddtree, sizing.user_graph_sizes)


def check_hybrid_state_memory(vllm_config, ddtree: DDTreeConfig) -> None:
    """A tree engine on a GatedDeltaNet target: its tree states must fit the memory vLLM may
    use (``gdn_state.check_slot_layout_fits``), checked on the final config (``max_num_seqs``
    is resolved after the speculative config). (Its state blocks get their final size only when
    the engine starts: ``gdn_layer.hybrid_tree_step`` checks them there.)"""
    model_config = vllm_config.model_config
    if model_config is None or not model_config.is_hybrid:
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
    ssm_dtype = ssm_state_dtype(cache.mamba_ssm_cache_dtype, model_config)
    check_slot_layout_fits(
        shapes,
        vllm_config.scheduler_config.max_num_seqs,
        ddtree.tree_budget,
        available,
        ssm_bytes=2 if ssm_dtype == "bfloat16" else 4,
        extra_blocks=1 if aligned else 0,
    )


def check_cpu_hybrid_states(vllm_config) -> None:
    """An engine asked for DDTree on a GatedDeltaNet target on the CPU platform: the SSM state
    dtype vLLM-CPU's prefill kernel takes (``config.check_cpu_gdn_state_dtype``), read after
    vLLM's platform settled it."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    if not current_platform.is_cpu() or model_config is None:
        return
    if has_recurrent_layers(model_config):
        cache_dtype = vllm_config.cache_config.mamba_ssm_cache_dtype
        check_cpu_gdn_state_dtype(ssm_state_dtype(cache_dtype, model_config))


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
    schedule = getattr(vllm_config.speculative_config, SCHEDULE_KEY, None)
    completed = verify_graph_sizes(
        sizes, ddtree.served_verify_widths(schedule), vllm_config.scheduler_config.max_num_seqs
    )
    if completed != sorted(sizes):
        compilation.cudagraph_capture_sizes = completed
        compilation.post_init_cudagraph_sizes()


def fit_schedule_to_users_graphs(vllm_config, ddtree: DDTreeConfig, given: list[int]) -> None:
    """On the V2 runner with the user's CUDA-graph sizes (kept as given): every batch size
    verifies a tree whose verify has a FULL graph, or drafts nothing (``schedule_within_graphs``
    of the sizes vLLM captures, else those given), and "auto" does not move online (its other
    widths may have no graph). Said in one line at start."""
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
        setattr(speculative, DDTREE_ATTR, dataclasses.replace(ddtree, online_budgets=()))
    logger.info(
        "vllm-ddtree: with the CUDA-graph sizes given, trees are verified where a FULL graph "
        "holds them, tree nodes per batch size (requests: budget): %s%s",
        format_schedule(fitted),
        "; tree_budget 'auto' does not move online" if ddtree.online_budgets else "",
    )


def check_ddtree_drafter(speculative_config) -> None:
    """The drafter vLLM loaded for a tree engine is a DFlash one
    (``config.check_drafter_is_dflash``)."""
    draft_model_config = speculative_config.draft_model_config
    hf_config = draft_model_config.hf_config if draft_model_config else None
    if hf_config is None:
        return
    check_drafter_is_dflash(
        {
            "dflash_config": getattr(hf_config, "dflash_config", None),
            "architectures": getattr(hf_config, "architectures", None),
        },
        speculative_config.model,
    )


def log_tree_engine(ddtree: DDTreeConfig) -> None:
    logger.info(
        "vllm-ddtree: method 'ddtree' (tree_budget=%d, tree_top_k=%d, depth=%d) on the %s model "
        "runner with TREE_ATTN",
        ddtree.tree_budget,
        ddtree.tree_top_k,
        ddtree.depth,
        ddtree.runner.upper(),
    )


def speculative_config_fields() -> list[str]:
    from vllm.config import SpeculativeConfig

    return [f.name for f in dataclasses.fields(SpeculativeConfig)]


def data_parallel_size(parallel_config) -> int:
    return int(getattr(parallel_config, "data_parallel_size", 1) or 1)


def size_tree_graphs(
    engine_args, ddtree: DDTreeConfig, schedule=None, data_parallel_size: int = 1
) -> TreeGraphSizing:
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
    batches are named in one warning and run without a FULL graph. Returns what was decided
    (``TreeGraphSizing``)."""
    compilation = getattr(engine_args, "compilation_config", None)
    chosen = (
        getattr(engine_args, "cudagraph_capture_sizes", None),
        getattr(engine_args, "max_cudagraph_capture_size", None),
        getattr(compilation, "cudagraph_capture_sizes", None),
        getattr(compilation, "max_cudagraph_capture_size", None),
    )
    if any(value is not None for value in chosen):
        # The user's sizes stand; the schedule is fitted to them once the config is made.
        return TreeGraphSizing(user_graph_sizes=list(chosen[0] or chosen[2] or []))
    sized = TreeGraphSizing(sized_graphs=True)
    max_num_seqs = engine_max_num_seqs(engine_args) or 1
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
        return sized
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
        return dataclasses.replace(sized, schedule=fitted)
    logger.warning(
        "vllm-ddtree: verify batches of %d to %d requests (%s tokens each) exceed the "
        "largest CUDA graph (%d tokens) and run without a FULL graph; lower tree_budget "
        "or max_num_seqs, or set max_cudagraph_capture_size",
        exceeding[0],
        exceeding[-1],
        "/".join(map(str, widths)),
        largest,
    )
    return sized


def engine_max_num_seqs(engine_args) -> int | None:
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


def check_batch_size_schedule(raw: dict) -> None:
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


def choose_engine_runner(target_model_config, target_parallel_config) -> str:
    """Choose the DDTree engine's model runner (``config.choose_runner``), "v1" or "v2",
    before its config is made (the cost profile of ``"tree_budget": "auto"`` is the runner's).
    The choice travels with the engine's config (``DDTreeConfig.runner``) to its processes."""
    from vllm.platforms import current_platform

    return choose_runner(
        on_gpu=current_platform.is_cuda(),
        has_recurrent_layers=has_recurrent_layers(target_model_config),
        tensor_parallel_size=getattr(target_parallel_config, "tensor_parallel_size", 1),
        pipeline_parallel_size=getattr(target_parallel_config, "pipeline_parallel_size", 1),
        vllm_runner_env=os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
    )


def ssm_state_dtype(cache_dtype: str | None, model_config) -> str | None:
    """The SSM state dtype name a ``mamba_ssm_cache_dtype`` setting gives ("auto": the model's
    dtype, as vLLM resolves it for GatedDeltaNet layers)."""
    if cache_dtype in (None, "auto"):
        return str(getattr(model_config, "dtype", "")).removeprefix("torch.") or cache_dtype
    return cache_dtype


def has_recurrent_layers(model_config) -> bool:
    return bool(
        model_config.is_hybrid or model_config.has_inner_state or model_config.is_attention_free
    )
