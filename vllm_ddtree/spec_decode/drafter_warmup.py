"""Compile vLLM's DFlash input kernel at start for every block size it can take (V2 runner).

vLLM's ``prepare_dflash_inputs`` (before each drafter pass) launches a Triton kernel whose block
size follows the step's widest request: ``min(256, next_pow2(query tokens + the drafter's
query))``. vLLM's warm-up compiles it for the shapes its dummy runs schedule, the engine's
configured verify width among them. An engine that serves several widths ("auto", or a budget
halved to fit the largest graph) compiled it at the first step of each other one instead: a
stall in its first requests, with vLLM's warning "Triton kernel JIT compilation during
inference" (five in the 8B grid's "auto" engine,
benchmarks/results/2026-12-04_ed73855_scale-8b-grid).
``warm_drafter_inputs`` launches it once per block size (32 to 256 for a drafter query of 16:
every verify width and prefill length lands on one of them), each on a dummy batch of one
request, after the CUDA graphs are captured: what it writes lands in the drafter's input
buffers, which every drafter pass rewrites before reading.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.ddtree")

MAX_BLOCK = 256  # vLLM's cap on the kernel's block size


def drafter_block_size(width: int, drafter_query: int) -> int:
    """The kernel's block size for a step whose widest request has ``width`` query tokens
    (vLLM's rule in ``prepare_dflash_inputs``)."""
    return min(MAX_BLOCK, 1 << max(0, width + drafter_query - 1).bit_length())


def widths_to_warm(drafter_query: int, max_tokens: int) -> list[int]:
    """One request width per block size the kernel can take, narrowest first: each block size
    less the drafter's query (a width of that block size), those of 1 to ``max_tokens``
    tokens."""
    widths = []
    block = drafter_block_size(1, drafter_query)
    while True:
        if 1 <= block - drafter_query <= max_tokens:
            widths.append(block - drafter_query)
        if block >= MAX_BLOCK:
            return widths
        block *= 2


def warm_drafter_inputs(runner, speculator) -> list[int]:
    """Launch vLLM's ``prepare_dflash_inputs`` through ``speculator`` (vLLM's V2
    ``DFlashSpeculator``) once for each width of ``widths_to_warm`` (up to the ``runner``'s
    token budget) on a dummy batch of one request of that many tokens. Returns the widths
    launched; on a failure, logs a warning and returns those launched before it (the kernel
    then compiles when first needed)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash

    warmed: list[int] = []
    try:
        device = runner.input_buffers.device
        num_sampled = torch.ones(1, dtype=torch.int32, device=device)
        num_rejected = torch.zeros(1, dtype=torch.int32, device=device)
        widths = widths_to_warm(speculator.num_query_per_req, runner.max_num_tokens)
        for width in widths:
            batch = InputBatch.make_dummy(1, width, runner.input_buffers)
            for i, group in enumerate(speculator.draft_kv_cache_group_ids):
                dflash.prepare_dflash_inputs(
                    speculator.input_buffers,
                    speculator.block_tables.slot_mappings[group],
                    speculator.context_positions,
                    speculator._context_slot_mappings[i],
                    speculator.sample_indices,
                    speculator.sample_pos,
                    speculator.sample_idx_mapping,
                    batch,
                    num_sampled,
                    num_rejected,
                    runner.req_states.last_sampled_tokens,
                    runner.req_states.next_prefill_tokens,
                    speculator.block_tables.input_block_tables[group],
                    speculator.block_tables.kernel_block_sizes[group],
                    speculator.parallel_drafting_token_id,
                    speculator.num_query_per_req,
                    speculator.num_speculative_steps,
                    speculator.max_num_reqs,
                    speculator.max_num_tokens,
                    speculator.max_model_len,
                    speculator.sample_from_anchor,
                )
            warmed.append(width)
        logger.info(
            "vllm-ddtree: vLLM's DFlash input kernel launched at start for requests of %s tokens",
            warmed,
        )
    except Exception as exc:  # a warm-up: the engine serves without it
        logger.warning(
            "vllm-ddtree: compiling vLLM's DFlash input kernel at start failed (%s: %s); it "
            "compiles at the first step that needs each block size instead",
            type(exc).__name__,
            exc,
        )
    return warmed
