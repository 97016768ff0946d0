"""vLLM-CPU: the prefix-caching state copies after a speculative step on a hybrid target.

With prefix caching vLLM 0.26.0 keeps a hybrid's recurrent states in its ``align`` layout: one
state block per ``mamba_block_size`` tokens, each holding the state at the end of its tokens so
that a later request whose prompt starts with them can resume from it. After a speculative step
the V1 runner's ``_update_states_after_model_execute`` calls
``mamba_utils.postprocess_mamba_align_gpu``, whose Triton kernel copies, for each request whose
accepted tokens reached a block boundary, the state at that boundary (the speculative block of
the boundary's token, the conv window shifted to it) into the boundary's block, and tells the
next step to start from its block's first column where that block is the one it runs in.
vLLM-CPU has no Triton there: the launch raises ``TypeError: 'function' object is not
subscriptable``, so on vLLM-CPU no speculative method served a hybrid target with prefix
caching.

``postprocess_align`` is the same decisions and copies on the host, with vLLM's own copy specs
(``collect_mamba_copy_meta``) and batched copy (``do_mamba_copy_block``, which vLLM-CPU ports).
The runner runs it in place of the kernel for DDTree engines on a device without Triton
(``spec_decode.v1_hooks.align_states_on_host``); every other engine keeps vLLM's code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BoundaryCopy:
    """One request's copy: the state at ``bias`` tokens past its running state's first token
    (``src`` block column, speculative columns after it) into block column ``dest``."""

    row: int
    src: int
    dest: int
    bias: int


def boundary_copies(
    num_accepted: list[int],
    state_columns: list[int],
    num_scheduled: list[int],
    num_computed: list[int],
    num_draft: list[int],
    block_size: int,
) -> list[BoundaryCopy]:
    """vLLM's decisions (``postprocess_mamba_fused_kernel``), per request: the tokens through
    the step's first sampled position (``computed + scheduled - draft``) are in the running
    state; after ``num_accepted`` tokens the sequence has ``running + num_accepted - 1``; if a
    multiple of ``block_size`` lies in between, its state goes to the block ending there."""
    copies = []
    for row, accepted in enumerate(num_accepted):
        running = num_computed[row] + num_scheduled[row] - num_draft[row]
        aligned = (running + accepted - 1) // block_size * block_size
        if aligned < running:
            continue
        copies.append(
            BoundaryCopy(row, state_columns[row], aligned // block_size - 1, aligned - running)
        )
    return copies


@dataclass(frozen=True)
class _BlockIds:
    """What vLLM's ``collect_mamba_copy_meta`` reads of a request: its block ids per group."""

    block_ids: dict[int, list[int]]


def postprocess_align(runner, num_reqs: int) -> None:
    """``postprocess_mamba_align_gpu`` for ``runner`` (vLLM's V1 runner on vLLM-CPU) after the
    step's accepted counts are in ``runner.num_accepted_tokens.gpu``: the boundary copies, and
    each request's count for the next step (1 where the boundary's block is the one it runs in)
    into the input batch's host counts, where vLLM's kernel path puts them."""
    from vllm.v1.worker import mamba_utils

    buffers = runner._get_mamba_bufs()
    context = buffers.postprocess_align
    copy_buffers = buffers.preprocess
    accepted = runner.num_accepted_tokens.gpu[:num_reqs].to("cpu", torch.int64).tolist()
    copies = boundary_copies(
        accepted,
        context.mamba_state_idx_buf.np[:num_reqs].tolist(),
        context.num_scheduled_tokens_buf.np[:num_reqs].tolist(),
        context.num_computed_tokens_buf.np[:num_reqs].tolist(),
        context.num_draft_tokens_buf.np[:num_reqs].tolist(),
        context.block_size,
    )
    block_tables = runner.input_batch.block_table
    copy_funcs = runner.model.get_mamba_state_copy_func()
    copy_buffers.offset = 0
    for copy in copies:
        if copy.src == copy.dest:
            accepted[copy.row] = 1
        blocks = _BlockIds(
            {
                group: block_tables[group].block_table.np[copy.row].tolist()
                for group in copy_buffers.mamba_group_ids
            }
        )
        mamba_utils.collect_mamba_copy_meta(
            copy_buffers,
            runner.kv_cache_config,
            copy_funcs,
            copy_buffers.mamba_group_ids,
            copy.src,
            copy.dest,
            copy.bias,
            blocks,
            runner.compilation_config.static_forward_context,
        )
    mamba_utils.do_mamba_copy_block(copy_buffers)
    counts = torch.tensor(accepted, dtype=runner.input_batch.num_accepted_tokens_cpu_tensor.dtype)
    runner.input_batch.num_accepted_tokens_cpu_tensor[:num_reqs].copy_(counts)
