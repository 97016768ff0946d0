"""DDTree on vLLM 0.26.0's V2 model runner (dense single-GPU targets; ``config.choose_runner``).

vLLM runs dense targets on its V2 runner (``vllm/v1/worker/gpu/``), whose DFlash chain step
costs about half the V1 one on the H200
(``benchmarks/results/2026-11-30_bfbb8da_speed-v1/bench_e2e.md``): its drafter runs in a FULL
CUDA graph and its per-step state stays on the GPU. The V1 hooks
(``v1_hooks.py``) serve hybrid, tensor-parallel and CPU engines; this module gives the same
tree step to V2, at the seams ``GPUModelRunner`` reaches in order (docs/design.md, "Model
runners"):

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

Checked on a GPU host only (vLLM-CPU has no V2 runner): ``benchmarks/lossless_gpu.py --runner
v2``. Request features are refused per request as on V1 (``config.check_sampling_params``).
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
from vllm_ddtree.spec_decode.draft_source import draft_source
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

RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"


def _wrap_init_speculator(original):
    def init_speculator(vllm_config, device):
        spec = vllm_config.speculative_config
        if get_ddtree_config(spec) is not None:
            speculator = ddtree_speculator_class()(vllm_config, device)
            if speculator.state.hybrid is not None:  # the GDN layers' calls to the tree path
                from vllm_ddtree.compat.gdn_dispatch import install

                install(device)
            return speculator
        if getattr(spec, "method", None) == "dflash":  # the chain, drafting from its source
            source = draft_source(vllm_config, device)
            return source.v2_chain_speculator(vllm_config, device, original)
        return original(vllm_config, device)

    return init_speculator


def _wrap_capture_model(original):
    """An online "auto" engine times each graph as vLLM captures it (``step_costs.py``): the
    step costs it judges budgets by. Then every DDTree engine compiles vLLM's DFlash input
    kernel for every block size it can take (``drafter_warmup.py``)."""

    def capture_model(self):
        speculator = _ddtree_speculator(self)
        if speculator is None:
            return original(self)
        if speculator.state.hybrid is not None:
            # The GDN layers reach the tree path through TREE_ATTN's metadata, in the captured
            # verify graphs too, whose buffers exist before the first capture.
            prepare_before_capture(speculator.state.hybrid, self.model, "before capture")
            speculator.state.bind_tree_attention(self.attn_groups)
        if speculator.state.acceptance is None:
            captured = original(self)
        elif not times_graphs_at_capture(self.vllm_config.parallel_config):
            logger.info(
                "vllm-ddtree: tree_budget 'auto' judges budgets by its cost profile's step "
                "costs (graphs are timed at capture on one rank only)"
            )
            captured = original(self)
        else:
            timers = time_graphs_as_captured(self, _synchronize_stream)
            captured = original(self)
            _keep_step_costs(speculator.state, timers)
        warm_drafter_inputs(self, speculator)
        return captured

    return capture_model


def _wrap_profile_run(original):
    """A hybrid target's GDN tree buffers exist while vLLM profiles memory, so the KV cache it
    sizes after leaves room for them (as on V1)."""

    def profile_run(self):
        speculator = _ddtree_speculator(self)
        if speculator is not None and speculator.state.hybrid is not None:
            prepare_before_capture(speculator.state.hybrid, self.model, "before memory profiling")
        return original(self)

    return profile_run


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


def _wrap_prepare_attn(original):
    def prepare_attn(self, input_batch):
        block_tables, slot_mappings = original(self, input_batch)
        source = getattr(getattr(self, "speculator", None), "draft_source", None)
        if source is not None:  # (draft_source.py; vLLM's own speculators have none)
            source.v2_bind(self, input_batch)
        speculator = _ddtree_speculator(self)
        if speculator is not None:  # every scheduled step takes its requests' proposals
            num_reqs = input_batch.num_reqs
            has_tree = speculator.proposals.take(
                input_batch.idx_mapping_np[:num_reqs], input_batch.req_ids[:num_reqs]
            )
        if speculator is None:
            return block_tables, slot_mappings
        state = speculator.state
        state.bind_tree_attention(self.attn_groups)
        state.publish(None)
        state.step = None
        if input_batch.num_draft_tokens == 0:
            return block_tables, slot_mappings
        with step_range("ddtree::prepare_tree_inputs"):
            trees, root_row, num_draft, counts, is_tree = _step_trees(
                speculator, input_batch, has_tree
            )
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
        return block_tables, slot_mappings

    return prepare_attn


def _wrap_sample(original):
    def sample(self, hidden_states, input_batch, grammar_output):
        speculator = _ddtree_speculator(self)
        step = speculator.state.step if speculator is not None else None
        if step is None or input_batch.num_draft_tokens == 0:
            return original(self, hidden_states, input_batch, grammar_output)
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        logits = self.model.compute_logits(hidden_states[input_batch.logits_indices])
        if grammar_output is not None:
            # The scheduler filled each tree row's bitmask along the row's own path
            # (structured_outputs.py); the rows are laid out as a chain's.
            self.structured_outputs_worker.apply_grammar_bitmask(
                logits,
                input_batch,
                grammar_output.structured_output_request_ids,
                grammar_output.grammar_bitmask,
            )
        num_reqs = input_batch.num_reqs
        first_row = input_batch.cu_num_logits[:num_reqs].long()
        paths = None
        if reads_row_paths(self.sampler, input_batch.idx_mapping_np):
            tokens, lengths = row_path_tokens(
                step.trees,
                input_batch.cu_num_logits[: num_reqs + 1],
                logits.shape[0],
                speculator.ddtree.depth,
            )
            paths = RowPaths(tokens, lengths)
        returns_logprobs = self.sampler.returns_logprobs(input_batch.idx_mapping_np)
        with step_range("ddtree::target_tokens"), tree_rows(self.sampler, paths):
            # One draw per logits row, keyed by its (depth) position: a node's token is the one
            # target-alone decoding would draw there, after the sampling parameters of its own
            # path.
            chosen, processed_logits = self.sampler.sample(
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
                self.sampler,
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
            self.sampler.req_states.prefill_len.gpu,
        )
        with step_range("ddtree::commit_kv"):
            commit_step_kv(self, speculator.state, step)
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

    return sample


def _wrap_take_draft_token_ids(original):
    """vLLM's ``DraftTokenIds`` for the scheduler (steps with structured outputs) also carries
    the trees' parents (``structured_outputs.TREE_PARENTS_ATTR``), for its grammar bitmask."""

    def take_draft_token_ids(self):
        taken = original(self)
        speculator = _ddtree_speculator(self)
        if speculator is None:
            return taken
        return with_tree_parents(taken, speculator.parents_to_host)

    return take_draft_token_ids
