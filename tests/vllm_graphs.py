"""vLLM 0.26.0's CUDA-graph sizing rules, run on stand-in configs (no GPU, no engine): which
sizes vLLM picks by default, and which drafter batches its V2 graph manager captures from them.
"""

from __future__ import annotations

from types import SimpleNamespace


def vllm_default_sizes(max_num_seqs: int, num_speculative_tokens: int, largest=None):
    """vLLM 0.26.0's default CUDA-graph sizes (``VllmConfig._set_cudagraph_sizes`` on a
    stand-in config: default graphs, no sequence parallelism) for ``largest`` (None: its own)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.vllm import VllmConfig

    compilation = SimpleNamespace(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        max_cudagraph_capture_size=largest,
        cudagraph_capture_sizes=None,
        pass_config=SimpleNamespace(enable_sp=False),
        post_init_cudagraph_sizes=lambda: None,
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        compilation_config=compilation,
        num_speculative_tokens=num_speculative_tokens,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        performance_mode="balanced",
    )
    VllmConfig._set_cudagraph_sizes(config)
    return compilation.cudagraph_capture_sizes


def _graph_manager(
    sizes: list[int],
    max_num_seqs: int,
    width: int,
    mode_name: str,
    schedule=None,
    vllm_config=None,
):
    """A stand-in for vLLM 0.26.0's V2 ``CudaGraphManager`` (graphs in ``mode_name``, capture
    ``sizes``, ``width`` query tokens per request in a uniform decode; with vLLM's
    per-batch-size ``schedule`` of draft tokens, ``width`` is the widest) with its candidates
    built by its own ``_init_candidates``: no GPU, no graphs captured. ``vllm_config``: a
    real engine config in place of the stand-in (its speculative config decides)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    speculative = None
    if schedule:
        speculative = SimpleNamespace(
            uses_dynamic_speculative_decoding=lambda: True,
            num_speculative_tokens_per_batch_size=schedule,
        )

    manager = SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=max(sizes)
        ),
        cudagraph_mode=CUDAGraphMode[mode_name],
        max_num_reqs=max_num_seqs,
        decode_query_len=width,
        vllm_config=vllm_config
        or SimpleNamespace(speculative_config=speculative, num_speculative_tokens=width - 1),
        lora_capture_cases=[0],
        _candidates={},
        _capture_descs={},
        use_breakable_cg=False,
        _graphs_captured=True,
        _resolve_effective_loras=lambda loras: loras,
    )
    CudaGraphManager._init_candidates(manager)
    return manager


def vllm_v2_drafter_graphs(sizes: list[int], max_num_seqs: int, width: int = 16) -> list[int]:
    """The batch sizes (requests) vLLM 0.26.0's V2 graph manager captures FULL graphs for, for
    a DFlash drafter of ``width`` query tokens per request, given capture ``sizes`` (its own
    ``_init_candidates``, run on a stand-in manager: no GPU needed)."""
    from vllm.config.compilation import CUDAGraphMode

    manager = _graph_manager(sizes, max_num_seqs, width, "FULL_DECODE_ONLY")
    return sorted(d.num_reqs for d in manager._capture_descs.get(CUDAGraphMode.FULL, []))


def vllm_v2_drafter_modes(sizes: list[int], drafter_config, width: int = 16) -> dict[int, str]:
    """The mode vLLM 0.26.0's V2 DFlash speculator dispatches a drafter batch of ``b``
    requests x ``width`` query tokens to (its graph manager built from ``drafter_config``,
    the config the speculator was made with, in FULL_DECODE_ONLY as DFlash asks), for every
    ``b`` up to its ``max_num_seqs``. ``{b: "FULL" | "NONE"}``."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    max_num_seqs = drafter_config.scheduler_config.max_num_seqs
    manager = _graph_manager(
        sizes, max_num_seqs, width, "FULL_DECODE_ONLY", vllm_config=drafter_config
    )
    return {
        b: CudaGraphManager.dispatch(manager, b, b * width, width, 0).cg_mode.name
        for b in range(1, max_num_seqs + 1)
    }


def vllm_v2_verify_modes(sizes: list[int], max_num_seqs: int, width: int) -> dict[int, str]:
    """The CUDA-graph mode vLLM 0.26.0's V2 graph manager (vLLM's default FULL_AND_PIECEWISE)
    dispatches a uniform verify batch of ``b`` requests x ``width`` tokens to, for every ``b``
    up to ``max_num_seqs``, given capture ``sizes`` (its own ``_init_candidates`` and
    ``dispatch``, run on a stand-in manager: no GPU needed). ``{b: "FULL" | "PIECEWISE" |
    "NONE"}``."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    manager = _graph_manager(sizes, max_num_seqs, width, "FULL_AND_PIECEWISE")
    return {
        b: CudaGraphManager.dispatch(manager, b, b * width, width, 0).cg_mode.name
        for b in range(1, max_num_seqs + 1)
    }


def vllm_v2_scheduled_verify_modes(
    sizes: list[int], max_num_seqs: int, schedule, tree_budget: int, served=None
) -> dict[int, tuple[int, str]]:
    """Like ``vllm_v2_verify_modes`` under vLLM's per-batch-size ``schedule`` (ranges of
    draft tokens, at most ``tree_budget``): for every ``b`` up to ``max_num_seqs``, the verify
    width vLLM's scheduler gives it (its own lookup) and the mode the V2 graph manager
    dispatches ``b`` requests of that width to. ``{b: (width, mode)}``. ``served``: the
    schedule the scheduler serves, when not the one the graphs were captured for (an online
    "auto" moving its budgets)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    nodes = build_dynamic_sd_schedule_lookup(served or schedule, max_num_seqs, tree_budget)
    manager = _graph_manager(sizes, max_num_seqs, 1 + tree_budget, "FULL_AND_PIECEWISE", schedule)
    modes = {}
    for b in range(1, max_num_seqs + 1):
        width = 1 + nodes[b]
        modes[b] = (width, CudaGraphManager.dispatch(manager, b, b * width, width, 0).cg_mode.name)
    return modes


def vllm_v1_verify_modes(sizes: list[int], max_num_seqs: int, width: int) -> dict[int, str]:
    """The CUDA-graph mode vLLM 0.26.0's V1 runner dispatches a uniform verify batch of ``b``
    requests x ``width`` tokens to, for every ``b`` up to ``max_num_seqs``, given capture
    ``sizes`` (vLLM's default FULL_AND_PIECEWISE): the sizes rounded to multiples of the
    width as its ``adjust_cudagraph_sizes_for_spec_decode`` does for V1, then its
    ``CudagraphDispatcher`` keys and ``dispatch`` (on stand-in configs: no GPU needed).
    ``{b: "FULL" | "PIECEWISE" | "NONE"}``."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    compilation = SimpleNamespace(
        cudagraph_capture_sizes=list(sizes),
        max_cudagraph_capture_size=max(sizes),
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        compile_sizes=None,
        cudagraph_specialize_lora=False,
        pass_config=SimpleNamespace(enable_sp=False),
        is_attention_compiled_piecewise=lambda: True,
    )
    CompilationConfig.adjust_cudagraph_sizes_for_spec_decode(compilation, width, 1)
    config = SimpleNamespace(
        compilation_config=compilation,
        num_speculative_tokens=width - 1,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        lora_config=None,
    )
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, width)
    return {
        b: dispatcher.dispatch(b * width, uniform_decode=True)[0].name
        for b in range(1, max_num_seqs + 1)
    }
