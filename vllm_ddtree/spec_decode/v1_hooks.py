"""DDTree verification inside vLLM 0.26.0's V1 model runner (``GPUModelRunner``; the CPU
runner inherits it). Its wrappers are the seam group ``V1_RUNNER`` (``compat/seams.py``),
inert unless the runner's drafter is a ``DDTreeProposer`` with DDTree configured.

Per step, for requests that carry a tree (their scheduled draft tokens are the tree's nodes):

1. ``_prepare_inputs`` (wrapped): RoPE positions of node tokens become ``root + depth`` (the
   slot mapping keeps one KV slot per node), and the batch's bit-packed ancestor masks are
   published for TREE_ATTN.
2. ``_sample`` (wrapped): the target's token at every node (argmax, or one sample per node at
   T > 0: sample-and-walk), ``follow_tree``, and the accepted path + bonus written as vLLM's
   ``[R, budget + 1]`` sampled-token rows (``-1`` padded), so the scheduler's accounting holds;
   then the accepted nodes' K/V move to contiguous slots in every TREE_ATTN layer.
3. ``propose_draft_token_ids`` (wrapped): the accepted path's rows (token, position, target
   hidden states) move to the front of each request's rows, so the DFlash drafter's context is
   exactly the committed tokens in order.

On CUDA each of these is a few Triton launches (``vllm_ddtree/ops``) fed by one non-blocking
copy of the step's per-request tables; nothing waits for the device.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_ddtree import config
from vllm_ddtree.compat import bind_arguments
from vllm_ddtree.compat.handles import held
from vllm_ddtree.hybrid.gdn_layer import prepare_before_capture
from vllm_ddtree.metrics.step_ranges import step_range
from vllm_ddtree.ops.drafter_rows import move_path_rows
from vllm_ddtree.requests.structured_outputs import with_tree_parents
from vllm_ddtree.spec_decode.proposer import DDTreeProposer
from vllm_ddtree.spec_decode.step_state import StepState, runner_step_state
from vllm_ddtree.spec_decode.tree_logits_processors import (
    apply_tree_processors,
    needs_tree_processors,
)
from vllm_ddtree.spec_decode.tree_logprobs import (
    asks_for_logprobs,
    processed_logprobs_mode,
    tree_step_logprobs,
)
from vllm_ddtree.spec_decode.tree_sampling import (
    ban_stop_tokens_before_min_tokens,
    sample_without_trees,
    seeds_and_keys_of_rows,
    target_tokens,
    thinking_budget_of,
)
from vllm_ddtree.spec_decode.tree_step import (
    StepTableUpload,
    TreeStep,
    commit_step_kv,
    start_tree_step,
    walk_tree_step,
)

logger = logging.getLogger("vllm.ddtree")


def _ddtree_proposer(runner):
    drafter = getattr(runner, "drafter", None)
    if isinstance(drafter, DDTreeProposer) and drafter.ddtree is not None:
        return drafter
    return None


def _upload(runner, state: StepState) -> StepTableUpload:
    if state.upload is None:
        state.upload = StepTableUpload(rows=6, device=runner.positions.device)
    return state.upload


def _wrap_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        drafter = _ddtree_proposer(self)
        logits_indices, spec_decode_metadata = result
        # For the graph dispatch after this (in "auto"'s chain too, where the same bug hits).
        if drafter is None and not serves_chain_for_ddtree(self):
            return result
        state = runner_step_state(self, drafter.state if drafter is not None else None)
        state.step = None
        state.logits_indices = logits_indices  # the sampled rows (keys of their noise)
        state.rows_without_drafts = rows_without_drafts(spec_decode_metadata)
        state.publish(None)
        if drafter is None:
            return result
        state.bind_tree_attention(self.attn_groups)
        if spec_decode_metadata is None:  # no drafts: the step takes its requests' trees
            drafter.proposals.take(self.input_batch.req_ids[: len(num_scheduled_tokens)])
            return result
        with step_range("ddtree::prepare_tree_inputs"):
            _prepare_tree_inputs(self, drafter, spec_decode_metadata, num_scheduled_tokens)
        return result

    return _prepare_inputs


def rows_without_drafts(spec_decode_metadata) -> bool:
    """Whether this step has a request that verifies no drafts, no tree (a prefill, or a
    decode without drafts): every request does when ``spec_decode_metadata`` is None (host
    side)."""
    if spec_decode_metadata is None:
        return True
    return min(spec_decode_metadata.num_draft_tokens, default=0) == 0


def serves_chain_for_ddtree(runner) -> bool:
    """Whether ``runner``'s engine was asked for ``"method": "ddtree"`` and ``"tree_budget":
    "auto"`` chose vLLM's DFlash chain for it."""
    return config.serves_chain_for_ddtree(getattr(runner, "speculative_config", None))


def _wrap_determine_batch_execution(original):
    """A step with a request that verifies no tree never replays a FULL CUDA graph.

    vLLM calls a batch a uniform decode (and replays the FULL graph captured for
    ``1 + budget``-token verify rows) whenever every request has ``1 + budget`` tokens
    scheduled, which a prompt (or a prefill chunk) of exactly that length also has. The
    GatedDeltaNet layers of such a graph run only the speculative (tree) branch, on state
    indices and parents from persistent buffers that vLLM's builder fills for speculative
    rows alone: the prefill's row then runs as a stale tree on another request's state blocks
    (found on the H200: the one 9-token prompt of the budget-8 hybrid grid; its first token
    wrong, and other requests of its batch written over; vLLM issue #49918, PR #47123 open).
    Such a step runs piecewise instead, in DDTree engines and in engines where "auto" serves
    vLLM's chain, whose 16-token prompts the same bug hits.
    Capture runs (``force_uniform_decode`` given) are left as vLLM asks."""

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        state = held(self, StepState)
        if state is None or not state.rows_without_drafts:
            return original(self, *args, **kwargs)
        state.rows_without_drafts = False  # one step's answer, read once
        bound = bind_arguments(original, self, *args, **kwargs)
        if bound.arguments.get("force_uniform_decode") is None:
            bound.arguments["force_uniform_decode"] = False
        return original(*bound.args, **bound.kwargs)

    return _determine_batch_execution_and_padding


def _prepare_tree_inputs(runner, drafter, spec_decode_metadata, num_scheduled_tokens) -> None:
    """Align the proposed trees with this step's rows, set node positions, publish masks.

    The step's per-request tables reach the device in one non-blocking copy; positions and
    masks are one kernel on CUDA (``ops/tree_inputs.py``); nothing waits for the device.
    """
    num_reqs = len(num_scheduled_tokens)
    num_draft = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
    counts = np.asarray(num_scheduled_tokens, dtype=np.int64)
    starts = np.zeros(num_reqs, dtype=np.int64)
    starts[1:] = np.cumsum(counts)[:-1]
    # The tree occupies the last 1 + num_draft tokens of each request's rows.
    query_start = starts + counts - 1 - num_draft
    # Each request's own proposal, taken by this step; none: it decodes plainly.
    taken = drafter.proposals.take(list(runner.input_batch.req_ids[:num_reqs]), num_draft)
    state = drafter.state
    query_start_d, num_draft_d, counts_d, source_d, num_nodes_d, is_tree_d = _upload(
        runner, state
    ).send(query_start, num_draft, counts, taken.source, taken.num_nodes, num_draft > 0)
    decode_drafts = getattr(runner, "num_decode_draft_tokens", None)
    if state.hybrid is not None and decode_drafts is not None:
        check_gdn_rows_are_tree_rows(decode_drafts.np[:num_reqs], num_draft)
    start_tree_step(
        state,
        taken.trees(source_d, num_nodes_d),
        query_start_d,
        num_draft_d,
        counts_d,
        is_tree_d,
        runner.input_ids.gpu,
        runner.positions,
        int(counts.sum()),
        max_path_end=max_path_end(runner, num_draft, drafter.ddtree.depth),
    )


def max_path_end(runner, num_draft: np.ndarray, depth: int) -> int | None:
    """The longest request's length after this step at most: its scheduled rows less its
    tree, plus the deepest path its tree can accept (``min(num_draft, depth)``); None where the
    runner keeps no host sequence lengths."""
    seq_lens = getattr(runner, "optimistic_seq_lens_cpu", None)
    if seq_lens is None or len(num_draft) == 0:
        return None
    lengths = seq_lens.numpy()[: len(num_draft)].astype(np.int64)
    return int((lengths - num_draft + np.minimum(num_draft, depth)).max())


def check_gdn_rows_are_tree_rows(num_decode_draft_tokens: np.ndarray, num_draft: np.ndarray):
    """Raise unless vLLM's GatedDeltaNet metadata takes as speculative exactly the requests
    that carry a tree this step. vLLM marks a request speculative when
    ``num_decode_draft_tokens`` >= 0 (scheduled as ``1 + drafts`` tokens; -1 otherwise), the
    hooks when ``num_draft`` > 0 (int arrays ``[R]``, host side, no device work). A request in
    one set only would have its tree run through the GDN layers as a chain, or another
    request's tree applied to it: a silent loss of exactness, so a loud error instead."""
    speculative = np.asarray(num_decode_draft_tokens) >= 0
    with_tree = np.asarray(num_draft) > 0
    if not np.array_equal(speculative, with_tree):
        rows = np.flatnonzero(speculative != with_tree).tolist()
        raise RuntimeError(
            "vllm-ddtree: vLLM's GatedDeltaNet metadata and the draft trees disagree on which "
            f"requests are speculative this step (batch rows {rows}: num_decode_draft_tokens "
            f"{np.asarray(num_decode_draft_tokens)[rows].tolist()}, tree nodes "
            f"{np.asarray(num_draft)[rows].tolist()})"
        )


def _wrap_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        if _ddtree_proposer(self) is None:
            return original(self, logits, spec_decode_metadata)
        state = runner_step_state(self)
        step = state.step
        if spec_decode_metadata is None:
            return sample_without_trees(self, original, logits)
        if step is None:
            return original(self, logits, spec_decode_metadata)
        from vllm.v1.outputs import SamplerOutput

        self.input_batch.update_async_output_token_ids()
        sampling_metadata = self.input_batch.sampling_metadata
        trees = step.trees
        num_reqs = trees.num_requests
        device = logits.device
        # Logit rows: request r's rows are cu_sampled[r] - (1 + num_draft[r]) .. cu_sampled[r].
        cu_sampled = spec_decode_metadata.cu_num_sampled_tokens.to(device).long()
        first_row = cu_sampled - 1 - step.num_draft

        def request_of_row() -> torch.Tensor:
            return torch.repeat_interleave(
                torch.arange(num_reqs, device=device),
                1 + step.num_draft,
                output_size=logits.shape[0],
            )

        gdn = state.hybrid
        if gdn is not None:  # a no-op unless VLLM_DDTREE_CHECK_INDICES=1 (debugging)
            gdn.watch("in the target's forward after its last GDN layer, or its logits")
        wants_logprobs = asks_for_logprobs(sampling_metadata)
        processed_mode = processed_logprobs_mode(self.sampler)
        with step_range("ddtree::target_tokens"):
            unban = ban_stop_tokens_before_min_tokens(
                logits, sampling_metadata, trees, first_row, step.num_draft
            )
            keyed_rows = seeds_and_keys_of_rows(self, num_reqs)
            processed = logits
            num_draft = [int(n) for n in spec_decode_metadata.num_draft_tokens]
            thinking = thinking_budget_of(self, num_reqs)
            if needs_tree_processors(sampling_metadata) or thinking is not None:
                processed = logits.to(torch.float32, copy=True)  # logprobs stay raw
            if needs_tree_processors(sampling_metadata):
                processed = apply_tree_processors(
                    processed, sampling_metadata, trees, num_draft, request_of_row()
                )
            if thinking is not None:  # after penalties, as vLLM's sampler
                budget, requests = thinking
                budget.apply(
                    processed,
                    requests,
                    sampling_metadata.output_token_ids,
                    trees.token_ids.tolist(),
                    trees.parents.tolist(),
                    num_draft,
                )
            chosen, scored = target_tokens(processed, sampling_metadata, request_of_row, keyed_rows)
            if not processed_mode:
                scored = logits  # raw: the target's logits as they came
                if unban is not None and wants_logprobs:
                    unban()
        if gdn is not None:
            gdn.watch("in choosing the target's tokens")
        # vLLM's row format: accepted drafted tokens, then the bonus, then -1.
        out_width = int(max(spec_decode_metadata.num_draft_tokens, default=0)) + 1
        with step_range("ddtree::follow_tree"):
            sampled = walk_tree_step(state, step, chosen, first_row, out_width, torch.int32)
        accepted, num_accepted = step.accepted, step.num_accepted
        if gdn is not None:
            gdn.watch("in the walk")
        with step_range("ddtree::commit_kv"):
            commit_step_kv(self, state, step)
            if gdn is not None:
                gdn.watch("in the KV commit")
                roots = self.positions.index_select(0, step.root_row.long())
                gdn.commit(accepted, num_accepted, step.num_draft, roots)
        logprobs_tensors = None
        if wants_logprobs:
            logprobs_tensors = tree_step_logprobs(
                self.sampler, scored, first_row, accepted, num_accepted, sampled, sampling_metadata
            )
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    return _sample


def _wrap_propose(original):
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = _ddtree_proposer(self)
        step = drafter.state.step if drafter is not None else None
        if step is not None and step.accepted is not None:
            bound = bind_arguments(original, self, *args, **kwargs)
            aux_hidden_states = bound.arguments.get("aux_hidden_states")
            with step_range("ddtree::move_path_rows_first"):
                _move_path_rows_first(self, step, aux_hidden_states)
        return original(self, *args, **kwargs)

    return propose_draft_token_ids


def _wrap_copy_draft_token_ids_to_cpu(original):
    """Where vLLM copies the drafts to the host (for the scheduler's grammar bitmask and
    penalties), the trees' parents go along (``structured_outputs.ParentsToHost``)."""

    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only=False):
        original(self, scheduler_output, zeros_only)
        drafter = _ddtree_proposer(self)
        if drafter is None:
            return
        parents = drafter.proposed_parents
        copied = self._draft_token_req_ids is not None and torch.is_tensor(self._draft_token_ids)
        if zeros_only or not copied or parents is None:
            drafter.parents_to_host.clear()
            return
        drafter.parents_to_host.start(parents, getattr(self, "draft_token_ids_copy_stream", None))

    return _copy_draft_token_ids_to_cpu


def _wrap_take_draft_token_ids(original):
    """vLLM's ``DraftTokenIds`` for the scheduler also carries the trees' parents
    (``structured_outputs.TREE_PARENTS_ATTR``)."""

    def take_draft_token_ids(self):
        taken = original(self)
        drafter = _ddtree_proposer(self)
        return taken if drafter is None else with_tree_parents(taken, drafter.parents_to_host)

    return take_draft_token_ids


def _move_path_rows_first(runner, step: TreeStep, aux_hidden_states) -> None:
    """Rows root + accepted[j] of each request move to rows root + j (j = 0..num_accepted) in
    the token ids and feature-layer hidden states the drafter reads next, and every row after
    the root gets the next position in turn, so that no other branch's row shares a path row's
    position (and drafter KV slot) (``ops/drafter_rows.py``; no host synchronisation)."""
    move_path_rows(
        runner.input_ids.gpu,
        runner.positions,
        list(aux_hidden_states or []),
        step.root_row,
        step.accepted,
        step.num_accepted,
        step.num_draft,
        step.trees.token_ids.shape[1],
    )


def _wrap_update_states_after_model_execute(original):
    """A DDTree engine serving a hybrid target with prefix caching on a device without Triton
    (vLLM-CPU): vLLM's step end, its ``align`` state copies done on the host
    (``compat.cpu_mamba_align``; vLLM's own is a Triton kernel). Everywhere else vLLM's."""

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        if not _copies_align_states_on_host(self):
            return original(self, output_token_ids, scheduler_output)
        from vllm_ddtree.compat.cpu_mamba_align import postprocess_align

        # vLLM's align branch, with its kernel's decisions and copies made on the host.
        num_reqs = output_token_ids.size(0)
        self.num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)
        postprocess_align(self, num_reqs)
        self.num_accepted_tokens_event.record()

    return _update_states_after_model_execute


def _copies_align_states_on_host(runner) -> bool:
    """Whether ``runner`` is a DDTree engine's on a hybrid target in vLLM's prefix-caching
    ``align`` layout, on a device vLLM's Triton kernels do not run on."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or _ddtree_proposer(runner) is None:
        return False
    speculating = runner.speculative_config is not None and runner.model_config.is_hybrid
    return speculating and runner.cache_config.mamba_cache_mode == "align"


def _wrap_input_fits_in_drafter(original):
    """vLLM skips the drafter for a step when a request's drafter queries would pass the
    drafter's length limit, from the end of the step's rows and counting ``1 +
    num_speculative_tokens`` (= the budget) queries. A DDTree drafter runs ``1 + depth``
    queries from the end of the accepted path, which drops the tree's other rows: the longest
    path this step can commit (``TreeStep.max_path_end``) is where they start."""

    def _input_fits_in_drafter(self, common_attn_metadata):
        drafter = _ddtree_proposer(self)
        if drafter is None or common_attn_metadata is None:
            return original(self, common_attn_metadata)
        queries = 1 + drafter.ddtree.depth
        limit = self.effective_drafter_max_model_len
        step = drafter.state.step
        end = common_attn_metadata.max_seq_len
        if step is not None and step.max_path_end is not None:
            end = step.max_path_end
        return end + queries <= limit

    return _input_fits_in_drafter


def _prepare_gdn_buffers(runner, when: str) -> None:
    """Hybrid targets: the GDN tree path's per-layer buffers (``gdn_layer``), allocated once."""
    drafter = _ddtree_proposer(runner)
    if drafter is not None:
        prepare_before_capture(drafter.state.hybrid, runner.get_model(), when)


def _wrap_profile_run(original):
    """The GDN tree buffers exist while vLLM profiles memory, so the KV cache it sizes after
    leaves room for them (allocated later, a server at a high ``gpu_memory_utilization`` could
    run out of memory at capture or under load)."""

    def profile_run(self, *args, **kwargs):
        _prepare_gdn_buffers(self, "before memory profiling")
        return original(self, *args, **kwargs)

    return profile_run


def _wrap_capture_model(original):
    def capture_model(self, *args, **kwargs):
        # The buffers exist before the first capture (inside one they would come from the
        # graph pool, which replays overwrite); profile_run made them unless it did not run.
        _prepare_gdn_buffers(self, "before capture")
        drafter = _ddtree_proposer(self)
        if drafter is not None:  # captured forwards reach the step through TREE_ATTN
            drafter.state.bind_tree_attention(self.attn_groups)
        return original(self, *args, **kwargs)

    return capture_model
