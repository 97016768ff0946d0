"""DDTree verification inside vLLM 0.26.0's V1 model runner (``GPUModelRunner``; the CPU
runner inherits it): plain functions the runner calls at the start or end of its own methods,
each a no-op unless the runner's drafter is a ``DDTreeProposer`` with DDTree configured (in
vLLM's tree the methods call them; the plugin, from its wrappers of the same methods).

Per step, for requests that carry a tree (their scheduled draft tokens are the tree's nodes):

1. ``after_prepare_inputs``: RoPE positions of node tokens become ``root + depth`` (the slot
   mapping keeps one KV slot per node), and the batch's bit-packed ancestor masks are
   published for TREE_ATTN.
2. ``sample`` (in place of vLLM's ``_sample``): the target's token at every node (argmax, or
   one sample per node at T > 0: sample-and-walk), ``follow_tree``, and the accepted path +
   bonus written as vLLM's ``[R, budget + 1]`` sampled-token rows (``-1`` padded), so the
   scheduler's accounting holds; then the accepted nodes' K/V move to contiguous slots in
   every TREE_ATTN layer.
3. ``before_propose``: the accepted path's rows (token, position, target hidden states) move
   to the front of each request's rows, so the DFlash drafter's context is exactly the
   committed tokens in order.

On CUDA each of these is a few Triton launches (DDTree's ``ops``) fed by one non-blocking
copy of the step's per-request tables; nothing waits for the device.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_ddtree import config
from vllm_ddtree.handles import held
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


def ddtree_proposer(runner) -> DDTreeProposer | None:
    """``runner``'s drafter when it drafts DDTree trees, else None."""
    drafter = getattr(runner, "drafter", None)
    if isinstance(drafter, DDTreeProposer) and drafter.ddtree is not None:
        return drafter
    return None


def _upload(runner, state: StepState) -> StepTableUpload:
    if state.upload is None:
        state.upload = StepTableUpload(rows=6, device=runner.positions.device)
    return state.upload


def after_prepare_inputs(
    runner, num_scheduled_tokens, logits_indices, spec_decode_metadata
) -> None:
    """At the end of the runner's ``_prepare_inputs`` (its ``num_scheduled_tokens`` argument
    and the ``logits_indices`` and ``spec_decode_metadata`` it returns): this step's trees
    taken from their requests' proposals, their node positions set, their masks published."""
    drafter = ddtree_proposer(runner)
    # For the graph dispatch after this (in "auto"'s chain too, where the same bug hits).
    if drafter is None and not serves_chain_for_ddtree(runner):
        return
    state = runner_step_state(runner, drafter.state if drafter is not None else None)
    state.step = None
    state.logits_indices = logits_indices  # the sampled rows (keys of their noise)
    state.rows_without_drafts = rows_without_drafts(spec_decode_metadata)
    state.publish(None)
    if drafter is None:
        return
    state.bind_tree_attention(runner.attn_groups)
    if spec_decode_metadata is None:  # no drafts: the step takes its requests' trees
        drafter.proposals.take(runner.input_batch.req_ids[: len(num_scheduled_tokens)])
        return
    with step_range("ddtree::prepare_tree_inputs"):
        _prepare_tree_inputs(runner, drafter, spec_decode_metadata, num_scheduled_tokens)


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


def uniform_decode_choice(runner, force_uniform_decode: bool | None) -> bool | None:
    """The ``force_uniform_decode`` the runner's ``_determine_batch_execution_and_padding``
    goes on with: False for a step with a request that verifies no tree, so that it never
    replays a FULL CUDA graph; else the value it was given.

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
    state = held(runner, StepState)
    if state is None or not state.rows_without_drafts:
        return force_uniform_decode
    state.rows_without_drafts = False  # one step's answer, read once
    return False if force_uniform_decode is None else force_uniform_decode


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


def sample(runner, logits, spec_decode_metadata):
    """In place of the runner's ``_sample``: this step's ``SamplerOutput`` in a DDTree engine,
    or None where vLLM's own sampling serves the step (no DDTree, greedy steps without trees,
    drafts that are not this step's trees)."""
    if ddtree_proposer(runner) is None:
        return None
    state = runner_step_state(runner)
    step = state.step
    if spec_decode_metadata is None:
        return sample_without_trees(runner, logits)
    if step is None:
        return None
    from vllm.v1.outputs import SamplerOutput

    runner.input_batch.update_async_output_token_ids()
    sampling_metadata = runner.input_batch.sampling_metadata
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
    processed_mode = processed_logprobs_mode(runner.sampler)
    with step_range("ddtree::target_tokens"):
        unban = ban_stop_tokens_before_min_tokens(
            logits, sampling_metadata, trees, first_row, step.num_draft
        )
        keyed_rows = seeds_and_keys_of_rows(runner, num_reqs)
        processed = logits
        num_draft = [int(n) for n in spec_decode_metadata.num_draft_tokens]
        thinking = thinking_budget_of(runner, num_reqs)
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
        commit_step_kv(runner, state, step)
        if gdn is not None:
            gdn.watch("in the KV commit")
            roots = runner.positions.index_select(0, step.root_row.long())
            gdn.commit(accepted, num_accepted, step.num_draft, roots)
    logprobs_tensors = None
    if wants_logprobs:
        logprobs_tensors = tree_step_logprobs(
            runner.sampler, scored, first_row, accepted, num_accepted, sampled, sampling_metadata
        )
    return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)


def before_propose(runner, aux_hidden_states) -> None:
    """At the start of the runner's ``propose_draft_token_ids`` (its ``aux_hidden_states``
    argument): the accepted paths' rows first in the rows the drafter reads."""
    drafter = ddtree_proposer(runner)
    step = drafter.state.step if drafter is not None else None
    if step is not None and step.accepted is not None:
        with step_range("ddtree::move_path_rows_first"):
            _move_path_rows_first(runner, step, aux_hidden_states)


def after_copy_draft_token_ids_to_cpu(runner, zeros_only: bool) -> None:
    """At the end of the runner's ``_copy_draft_token_ids_to_cpu``: where vLLM copies the
    drafts to the host (for the scheduler's grammar bitmask and penalties), the trees'
    parents go along (``structured_outputs.ParentsToHost``)."""
    drafter = ddtree_proposer(runner)
    if drafter is None:
        return
    parents = drafter.proposed_parents
    copied = runner._draft_token_req_ids is not None and torch.is_tensor(runner._draft_token_ids)
    if zeros_only or not copied or parents is None:
        drafter.parents_to_host.clear()
        return
    drafter.parents_to_host.start(parents, getattr(runner, "draft_token_ids_copy_stream", None))


def with_tree_parents_of(runner, taken):
    """What the runner's ``take_draft_token_ids`` returns (vLLM's ``DraftTokenIds`` for the
    scheduler), carrying the trees' parents in a DDTree engine
    (``structured_outputs.TREE_PARENTS_ATTR``)."""
    drafter = ddtree_proposer(runner)
    return taken if drafter is None else with_tree_parents(taken, drafter.parents_to_host)


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


def drafter_input_fits(runner, common_attn_metadata) -> bool | None:
    """In place of the runner's ``_input_fits_in_drafter`` in a DDTree engine (None: vLLM's
    answer). vLLM skips the drafter for a step when a request's drafter queries would pass
    the drafter's length limit, from the end of the step's rows and counting ``1 +
    num_speculative_tokens`` (= the budget) queries. A DDTree drafter runs ``1 + depth``
    queries from the end of the accepted path, which drops the tree's other rows: the longest
    path this step can commit (``TreeStep.max_path_end``) is where they start."""
    drafter = ddtree_proposer(runner)
    if drafter is None or common_attn_metadata is None:
        return None
    queries = 1 + drafter.ddtree.depth
    limit = runner.effective_drafter_max_model_len
    step = drafter.state.step
    end = common_attn_metadata.max_seq_len
    if step is not None and step.max_path_end is not None:
        end = step.max_path_end
    return end + queries <= limit


def before_profile_run(runner) -> None:
    """At the start of the runner's ``profile_run``: a hybrid target's GDN tree buffers
    (``gdn_layer``) exist while vLLM profiles memory, so the KV cache it sizes after leaves
    room for them (allocated later, a server at a high ``gpu_memory_utilization`` could run
    out of memory at capture or under load)."""
    _prepare_gdn_buffers(runner, "before memory profiling")


def before_capture_model(runner) -> None:
    """At the start of the runner's ``capture_model``: the GDN tree buffers exist before the
    first capture (inside one they would come from the graph pool, which replays overwrite;
    ``profile_run`` made them unless it did not run), and captured forwards reach the step
    through TREE_ATTN."""
    _prepare_gdn_buffers(runner, "before capture")
    drafter = ddtree_proposer(runner)
    if drafter is not None:
        drafter.state.bind_tree_attention(runner.attn_groups)


def _prepare_gdn_buffers(runner, when: str) -> None:
    """Hybrid targets: the GDN tree path's per-layer buffers (``gdn_layer``), allocated once."""
    drafter = ddtree_proposer(runner)
    if drafter is not None:
        prepare_before_capture(drafter.state.hybrid, runner.get_model(), when)


def copies_align_states_on_host(runner) -> bool:
    """Whether ``runner`` is a DDTree engine's on a hybrid target in vLLM's prefix-caching
    ``align`` layout, on a device vLLM's Triton kernels do not run on (vLLM-CPU)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or ddtree_proposer(runner) is None:
        return False
    speculating = runner.speculative_config is not None and runner.model_config.is_hybrid
    return speculating and runner.cache_config.mamba_cache_mode == "align"


def align_states_on_host(runner, num_reqs: int) -> None:
    """In the runner's ``_update_states_after_model_execute``, where
    ``copies_align_states_on_host``: the ``align`` layout's state copies after the step and
    each request's count for the next one, made on the host (``hybrid/cpu_mamba_align.py``)
    in place of vLLM's Triton kernel, once ``runner.num_accepted_tokens.gpu`` holds the
    step's accepted counts."""
    from vllm_ddtree.hybrid.cpu_mamba_align import postprocess_align

    postprocess_align(runner, num_reqs)
