"""DDTree verification inside vLLM 0.26.0's V1 model runner (``GPUModelRunner``; the CPU
runner inherits it). Installed by ``vllm_patches.apply``; inert unless the runner's drafter is
a ``DDTreeProposer`` with DDTree configured.

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
import os
from dataclasses import dataclass

import numpy as np
import torch

from tree_attn_backend import tree_verify
from vllm_ddtree import compat, hybrid_gdn, step_checks
from vllm_ddtree.compat import wrap_function
from vllm_ddtree.ops import use_triton
from vllm_ddtree.ops.keyed_gumbel import keyed_gumbel_noise
from vllm_ddtree.ops.kv_commit import (
    PagedKVLayers,
    commit_accepted_kv_at,
    commit_accepted_kv_torch,
)
from vllm_ddtree.ops.path_rows import move_path_rows
from vllm_ddtree.ops.tree_inputs import tree_step_inputs_ref, tree_step_inputs_triton
from vllm_ddtree.ops.tree_walk import walk_and_emit
from vllm_ddtree.profiling import step_range
from vllm_ddtree.proposer import DDTreeProposer
from vllm_ddtree.request_seeds import batch_seeds
from vllm_ddtree.runner_state import HANDLE, runner_state
from vllm_ddtree.tree import DDTreeBatch


@dataclass
class StepTrees:
    """The trees being verified this step, aligned with the runner's batch rows."""

    trees: DDTreeBatch  # [R, budget] (empty rows for requests without drafts)
    query_start: torch.Tensor  # long [R]: first token of each request in the batch
    num_draft: torch.Tensor  # long [R]: scheduled draft tokens (tree nodes) per request
    accepted: torch.Tensor | None = None  # long [R, L + 1] after the walk
    num_accepted: torch.Tensor | None = None


logger = logging.getLogger("vllm.ddtree")
RANK_CHECK_ENV = "VLLM_DDTREE_CHECK_RANKS"


def step_fingerprint(step: StepTrees) -> torch.Tensor:
    """long ``[4]``: order-sensitive sums of the step's tree tokens, parents, accepted paths
    and accepted counts; equal on two ranks when they built and walked the same trees."""
    trees = step.trees

    def weighted(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1).long()
        return (flat * torch.arange(1, flat.numel() + 1, device=flat.device)).sum()

    return torch.stack(
        [
            weighted(trees.token_ids),
            weighted(trees.parents),
            weighted(step.accepted),
            weighted(step.num_accepted),
        ]
    )


FINGERPRINT_CHUNK_BITS = 16  # int64 words sent as float32 chunks of 16 bits (exact)


def fingerprint_to_float_chunks(fingerprint: torch.Tensor) -> torch.Tensor:
    """long ``[k]`` -> float32 ``[k, 4]``: each word's 16-bit chunks, low first, every one an
    exact float32. vLLM-CPU's shared-memory all-gather takes floating tensors only."""
    shifts = torch.arange(0, 64, FINGERPRINT_CHUNK_BITS, device=fingerprint.device)
    mask = (1 << FINGERPRINT_CHUNK_BITS) - 1
    return ((fingerprint.unsqueeze(-1) >> shifts) & mask).to(torch.float32)


def fingerprint_from_float_chunks(chunks: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., k, 4]`` from ``fingerprint_to_float_chunks`` -> long ``[..., k]``."""
    shifts = torch.arange(0, 64, FINGERPRINT_CHUNK_BITS, device=chunks.device)
    return (chunks.long() << shifts).sum(-1)


def check_ranks_agree(step: StepTrees) -> None:
    """Under ``VLLM_DDTREE_CHECK_RANKS=1`` (a check for tests; one all-gather and one host sync
    per step; off, one environment lookup): every tensor-parallel rank built and walked the same
    trees. Raises otherwise."""
    if os.environ.get(RANK_CHECK_ENV) != "1":
        return
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
    )

    world = get_tensor_model_parallel_world_size()
    if world < 2:
        return
    if not getattr(check_ranks_agree, "announced", False):
        check_ranks_agree.announced = True
        logger.info("vllm-ddtree: checking that the %d tensor-parallel ranks agree", world)
    mine = fingerprint_to_float_chunks(step_fingerprint(step))  # [4, 4] float32
    gathered = tensor_model_parallel_all_gather(mine.unsqueeze(0), dim=0)  # [world, 4, 4]
    every = fingerprint_from_float_chunks(gathered)  # [world, 4] long
    if not bool((every == every[0]).all()):
        raise RuntimeError(
            f"vllm-ddtree: tensor-parallel rank {get_tensor_model_parallel_rank()} built or "
            f"walked different trees than rank 0 (fingerprints {every.tolist()})"
        )


def _ddtree_proposer(runner):
    drafter = getattr(runner, "drafter", None)
    if isinstance(drafter, DDTreeProposer) and drafter.ddtree is not None:
        return drafter
    return None


class StepTableUpload:
    """Per-step int64 tables ``[rows, R]`` sent to the device in one non-blocking copy.

    A pageable host-to-device copy makes the host wait for the device's whole queue; these go
    from pinned memory instead. Two host/device buffer pairs alternate, and a buffer is
    rewritten only after its previous copy has finished (an event, normally long done), so no
    step waits on the device.
    """

    def __init__(self, rows: int, device: torch.device):
        self.rows, self.device = rows, device
        self.width = 0
        self.turn = 0

    def _allocate(self, width: int) -> None:
        pin = self.device.type == "cuda"
        self.width = max(64, width)
        shape = (self.rows, self.width)
        self.host = [torch.zeros(shape, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.on_device = [
            torch.zeros(shape, dtype=torch.int64, device=self.device) for _ in range(2)
        ]
        self.copied: list = [None, None]

    def send(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """``arrays``: ``rows`` int arrays of one length ``R`` -> long ``[R]`` device views."""
        assert len(arrays) == self.rows
        length = len(arrays[0])
        if length > self.width:
            self._allocate(length)
        turn, self.turn = self.turn, self.turn ^ 1
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()
        host = self.host[turn].numpy()
        for row, values in enumerate(arrays):
            host[row, :length] = values
        on_device = self.on_device[turn]
        on_device.copy_(self.host[turn], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.copied[turn] = event
        return [on_device[row, :length] for row in range(self.rows)]


def _upload(runner) -> StepTableUpload:
    state = runner_state(runner)
    if state.upload is None:
        state.upload = StepTableUpload(rows=6, device=runner.positions.device)
    return state.upload


def _wrap_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        drafter = _ddtree_proposer(self)
        logits_indices, spec_decode_metadata = result
        # For the graph dispatch after this (in "auto"'s chain too, where the same bug hits).
        if drafter is not None or serves_chain_for_ddtree(self):
            state = runner_state(self)
            state.step = None
            state.logits_indices = logits_indices  # the sampled rows (keys of their noise)
            state.rows_without_drafts = rows_without_drafts(spec_decode_metadata)
        if drafter is None:
            tree_verify.publish(None)
            return result
        if spec_decode_metadata is None:  # no drafts: the step takes its requests' trees
            drafter.proposals.take(self.input_batch.req_ids[: len(num_scheduled_tokens)])
            tree_verify.publish(None)
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
    return compat.serves_chain_for_ddtree(getattr(runner, "speculative_config", None))


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
        state = getattr(self, HANDLE, None)
        without_tree = state is not None and state.rows_without_drafts
        if state is not None:
            state.rows_without_drafts = False  # one step's answer, read once
        positional_force = len(args) >= 8  # vLLM 0.26.0 passes it by keyword
        if without_tree and not positional_force and kwargs.get("force_uniform_decode") is None:
            kwargs["force_uniform_decode"] = False
        return original(self, *args, **kwargs)

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
    query_start_d, num_draft_d, counts_d, source_d, num_nodes_d, is_tree_d = _upload(runner).send(
        query_start, num_draft, counts, taken.source, taken.num_nodes, num_draft > 0
    )
    trees = taken.trees(source_d, num_nodes_d)
    step_checks.check_tree_tokens(runner.input_ids.gpu, trees, query_start_d)
    step = StepTrees(trees=trees, query_start=query_start_d, num_draft=num_draft_d)
    runner_state(runner).step = step

    set_tree_step_inputs(
        trees,
        query_start_d,
        num_draft_d,
        counts_d,
        runner.positions,
        int(counts.sum()),
        is_tree=is_tree_d,
    )
    gdn = hybrid_gdn.active_step()
    if gdn is not None:  # hybrid target: the GDN layers read the same trees
        decode_drafts = getattr(runner, "num_decode_draft_tokens", None)
        if decode_drafts is not None:
            check_gdn_rows_are_tree_rows(decode_drafts.np[:num_reqs], num_draft)
        gdn.publish(trees.parents, trees.num_nodes, num_draft_d)


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


def set_tree_step_inputs(
    trees: DDTreeBatch,
    root_row: torch.Tensor,
    num_draft: torch.Tensor,
    num_scheduled: torch.Tensor,
    positions: torch.Tensor,
    total_tokens: int,
    is_tree: torch.Tensor,
) -> None:
    """Before a verify forward (V1 or V2 runner): depth-based RoPE positions for the node
    tokens, in ``positions`` in place (slots stay one per node), and one packed ancestor row
    per query token published for TREE_ATTN. ``root_row``, ``num_draft``, ``num_scheduled``:
    long ``[R]``; ``total_tokens``: the step's unpadded token count; ``is_tree`` int ``[R]``:
    ``num_draft > 0`` (uploaded with the caller's step tables)."""
    fill = tree_step_inputs_triton if use_triton(root_row.device) else tree_step_inputs_ref
    tree_mask = fill(trees, root_row, num_draft, num_scheduled, positions, total_tokens)
    tree_verify.publish(tree_verify.TreeVerifyBatch(is_tree=is_tree, tree_mask=tree_mask))


def _refuse_unsupported(sampling_metadata) -> None:
    """Sampling features the tree path does not apply yet fail loudly instead of silently."""
    unsupported = []
    if not sampling_metadata.no_penalties:
        unsupported.append("presence/frequency/repetition penalties")
    if sampling_metadata.allowed_token_ids_mask is not None:
        unsupported.append("allowed_token_ids")
    if sampling_metadata.bad_words_token_ids:
        unsupported.append("bad_words")
    if sampling_metadata.max_num_logprobs is not None:
        unsupported.append("logprobs")
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        unsupported.append("thinking_token_budget")
    if unsupported:
        raise NotImplementedError(
            "vllm-ddtree: " + ", ".join(unsupported) + " are not supported yet with method "
            "'ddtree' (see README, 'Sampling with trees')"
        )


def _target_tokens(logits: torch.Tensor, sampling_metadata, request_of_row, row_seeds_and_keys):
    """long ``[rows]``: argmax, or at each request's temperature, top-k and top-p the Gumbel-max
    sample ``argmax(logits / T + G(seed, key))`` with the request's keyed noise
    (``ops/keyed_gumbel.py``; an exact sample per row, the one target-alone decoding with that
    noise draws at the row's position). ``request_of_row()``: long ``[rows]``, each row's
    request; ``row_seeds_and_keys(request_of_row)``: int64 ``[rows]`` twice, each row's seed
    and key (``_keyed_rows``); both called only when sampling."""
    _refuse_unsupported(sampling_metadata)
    if sampling_metadata.all_greedy:
        return logits.argmax(dim=-1)
    rows = request_of_row()
    temperature = sampling_metadata.temperature.index_select(0, rows)
    greedy = temperature <= 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if sampling_metadata.top_k is not None or sampling_metadata.top_p is not None:
        # vLLM's own top-k / top-p masks, per row at its request's values (after temperature,
        # as vLLM's sampler): each node samples from the target's exact distribution.
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        scaled = apply_top_k_top_p(
            scaled,
            top_k.index_select(0, rows) if top_k is not None else None,
            top_p.index_select(0, rows) if top_p is not None else None,
        )
    chosen = logits.argmax(dim=-1)
    sampled_rows = (~greedy).nonzero().squeeze(1)
    seeds, keys = row_seeds_and_keys(rows)
    noise = keyed_gumbel_noise(
        seeds[sampled_rows], keys[sampled_rows].unsqueeze(1), logits.shape[-1]
    ).squeeze(1)
    chosen[sampled_rows] = (scaled[sampled_rows] + noise).argmax(dim=-1)
    return chosen


def _ban_stop_tokens_before_min_tokens(
    logits: torch.Tensor, sampling_metadata, trees: DDTreeBatch, first_row, num_draft
) -> None:
    """``min_tokens`` on trees (vLLM's ``MinTokensLogitsProcessor``, which assumes chains):
    at tree index ``i`` of request ``r`` the request has ``len(outputs) + depth(i)`` tokens, so
    its stop tokens get ``-inf`` there while that is below ``min_tokens``. In place on
    ``logits`` ``[rows, V]``; costs nothing unless a request in the batch has ``min_tokens``."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    entries = []
    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor):
            for req, (min_tokens, outputs, stop_ids) in processor.min_toks.items():
                left = min_tokens - len(outputs)
                entries += [(req, token, left) for token in sorted(stop_ids) if left > 0]
    if not entries:
        return
    device = logits.device
    req, token, left = (
        torch.tensor(c, dtype=torch.long, device=device) for c in zip(*entries, strict=True)
    )
    num_reqs, width = trees.token_ids.shape
    depth = torch.cat(
        [torch.zeros((num_reqs, 1), dtype=torch.long, device=device), trees.depths.long()], 1
    )
    index = torch.minimum(
        torch.arange(width + 1, device=device).unsqueeze(0), num_draft[req].unsqueeze(1)
    )  # past a request's drafts: its last row again (same depth rule, same value)
    rows = first_row[req].unsqueeze(1) + index  # [P, N + 1]
    banned = depth[req].gather(1, index) < left.unsqueeze(1)
    columns = token.unsqueeze(1).expand_as(rows)
    logits[rows, columns] = torch.where(banned, float("-inf"), logits[rows, columns])


def _keyed_rows(runner, num_reqs: int):
    """``row_seeds_and_keys`` for ``_target_tokens`` in this step: given each logits row's
    request (long ``[rows]``), the row's request seed and its key, the row's position (a tree
    node's depth position), both int64 ``[rows]``."""

    def row_seeds_and_keys(request_of_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = request_of_row.device
        seeds = batch_seeds(runner, num_reqs, device).index_select(0, request_of_row)
        rows = runner_state(runner).logits_indices.to(device)
        return seeds, runner.positions.index_select(0, rows).long()

    return row_seeds_and_keys


def _sample_without_trees(runner, original, logits):
    """A DDTree engine's step in which no request verifies a tree (prefills, the first step):
    greedy batches as vLLM samples them; otherwise one keyed sample per request
    (``_target_tokens``, after vLLM's ``min_tokens`` processor), as in steps with trees, so a
    seeded request's tokens do not depend on which of its steps carried other requests' trees.
    Everything else vLLM's sampler would apply is refused for DDTree requests
    (``_refuse_unsupported``)."""
    sampling_metadata = runner.input_batch.sampling_metadata
    if logits is None or sampling_metadata.all_greedy:
        return original(runner, logits, None)
    from vllm.v1.outputs import SamplerOutput

    runner.input_batch.update_async_output_token_ids()
    for processor in sampling_metadata.logitsprocs.non_argmax_invariant:
        logits = processor.apply(logits)
    num_reqs, device = logits.shape[0], logits.device

    def request_of_row() -> torch.Tensor:
        return torch.arange(num_reqs, device=device)

    with step_range("ddtree::target_tokens"):
        keyed_rows = _keyed_rows(runner, num_reqs)
        chosen = _target_tokens(logits, sampling_metadata, request_of_row, keyed_rows)
    sampled = chosen.to(torch.int32).view(num_reqs, 1)
    return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)


def _wrap_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        if _ddtree_proposer(self) is None:
            return original(self, logits, spec_decode_metadata)
        step = runner_state(self).step
        if spec_decode_metadata is None:
            return _sample_without_trees(self, original, logits)
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

        gdn = hybrid_gdn.active_step()
        if gdn is not None:  # a no-op unless VLLM_DDTREE_CHECK_INDICES=1 (debugging)
            gdn.watch("in the target's forward after its last GDN layer, or its logits")
        with step_range("ddtree::target_tokens"):
            _ban_stop_tokens_before_min_tokens(
                logits, sampling_metadata, trees, first_row, step.num_draft
            )
            keyed_rows = _keyed_rows(self, num_reqs)
            chosen = _target_tokens(logits, sampling_metadata, request_of_row, keyed_rows)
        if gdn is not None:
            gdn.watch("in choosing the target's tokens")
        # vLLM's row format: accepted drafted tokens, then the bonus, then -1.
        out_width = int(max(spec_decode_metadata.num_draft_tokens, default=0)) + 1
        with step_range("ddtree::follow_tree"):
            accepted, num_accepted, _, sampled = walk_and_emit(
                trees, chosen, first_row, step.num_draft, out_width
            )
        step.accepted, step.num_accepted = accepted, num_accepted
        check_ranks_agree(step)
        if gdn is not None:
            gdn.watch("in the walk")
        with step_range("ddtree::commit_kv"):
            _commit_kv(self, step)
            if gdn is not None:
                gdn.watch("in the KV commit")
                gdn.commit(accepted, num_accepted, step.num_draft)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)

    return _sample


def _tree_attention_layers(runner) -> list:
    """The target's TREE_ATTN layers (vLLM's ``Attention`` modules), found once per forward
    context (the model's layers do not change while it serves)."""
    from tree_attn_backend.backend import TreeAttentionImpl

    context = runner.compilation_config.static_forward_context
    state = runner_state(runner)
    cached = state.tree_layers
    if cached is not None and cached[0] is context and cached[1] == len(context):
        return cached[2]
    layers = [
        layer
        for layer in context.values()
        if isinstance(getattr(layer, "impl", None), TreeAttentionImpl)
    ]
    state.tree_layers = (context, len(context), layers)
    return layers


def _kv_cache_of(layer) -> torch.Tensor | None:
    kv_cache = layer.kv_cache
    if isinstance(kv_cache, (list, tuple)):
        kv_cache = kv_cache[0]
    return kv_cache


def _tree_attention_kv_caches(runner) -> list[torch.Tensor]:
    """KV cache tensors ``[2, num_blocks, block_size, Hkv, D]`` of the target's TREE_ATTN layers."""
    caches = [_kv_cache_of(layer) for layer in _tree_attention_layers(runner)]
    return [c for c in caches if c is not None and c.numel()]


def _kv_layer_groups(runner) -> list[PagedKVLayers]:
    """The TREE_ATTN layers' caches as launch tables, one per cache layout (usually one),
    rebuilt only when vLLM's cache tensors change: a step checks the layers' cache objects and
    the first and last cache's addresses (a few microseconds), not every cache's layout."""
    objects = [_kv_cache_of(layer) for layer in _tree_attention_layers(runner)]
    live = [c for c in objects if c is not None]
    quick_key = (
        tuple(map(id, objects)),
        (live[0].data_ptr(), live[-1].data_ptr()) if live else (),
    )
    state = runner_state(runner)
    cached = state.kv_layers
    if cached is not None and cached[0] == quick_key:
        return cached[1]
    caches = [c for c in live if c.numel()]
    by_layout: dict[tuple, list[torch.Tensor]] = {}
    for cache in caches:
        by_layout.setdefault((tuple(cache.shape), tuple(cache.stride()), cache.dtype), []).append(
            cache
        )
    groups = [
        PagedKVLayers.of([c[0] for c in group], [c[1] for c in group])
        for group in by_layout.values()
    ]
    if len(caches) == len(objects):  # every cache allocated: keep the tables
        state.kv_layers = (quick_key, groups)
    return groups


def commit_tree_kv(
    runner,
    slot_mapping: torch.Tensor,
    root_row: torch.Tensor,
    width: int,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Move accepted nodes' K/V to contiguous slots in every TREE_ATTN layer of ``runner``
    (V1 or V2): ``slot_mapping`` ``[T]`` the step's KV slots, ``root_row`` long ``[R]`` each
    request's root row, ``width`` the trees' width, ``accepted`` / ``num_accepted`` the walk's."""
    if use_triton(slot_mapping.device):
        # The kernel reads each node's slot at slot_mapping[root_row + node]: no index tensors.
        slots = slot_mapping if slot_mapping.stride(0) == 1 else slot_mapping.contiguous()
        for layers in _kv_layer_groups(runner):
            commit_accepted_kv_at(layers, slots, root_row, accepted, num_accepted)
        return
    rows = root_row.unsqueeze(1) + torch.arange(width + 1, device=slot_mapping.device)
    rows = rows.clamp(max=slot_mapping.shape[0] - 1)
    verify_slots = slot_mapping[rows].long()
    for kv_cache in _tree_attention_kv_caches(runner):
        key_cache, value_cache = kv_cache.unbind(0)
        commit_accepted_kv_torch(key_cache, value_cache, verify_slots, accepted, num_accepted)


def _commit_kv(runner, step: StepTrees) -> None:
    """Move accepted nodes' K/V to contiguous slots (the slots TREE_ATTN's builder saw)."""
    recorded = tree_verify.last_step()
    if recorded is None:
        return
    commit_tree_kv(
        runner,
        recorded.slot_mapping,
        step.query_start,
        step.trees.width,
        step.accepted,
        step.num_accepted,
    )


def _wrap_propose(original):
    def propose_draft_token_ids(self, *args, **kwargs):
        # vLLM 0.26.0 signature: (scheduler_output, sampled_token_ids, sampling_metadata,
        # hidden_states, sample_hidden_states, aux_hidden_states, ...): aux is the 6th.
        drafter = _ddtree_proposer(self)
        step = runner_state(self).step if drafter is not None else None
        if step is not None and step.accepted is not None:
            aux_hidden_states = kwargs.get("aux_hidden_states", args[5] if len(args) > 5 else None)
            with step_range("ddtree::move_path_rows_first"):
                _move_path_rows_first(self, step, aux_hidden_states)
        return original(self, *args, **kwargs)

    return propose_draft_token_ids


def _move_path_rows_first(runner, step: StepTrees, aux_hidden_states) -> None:
    """Rows root + accepted[j] of each request move to rows root + j (j = 0..num_accepted) in
    the token ids and feature-layer hidden states the drafter reads next, and every row after
    the root gets the next position in turn, so that no other branch's row shares a path row's
    position (and drafter KV slot) (``ops/path_rows.py``; no host synchronisation)."""
    move_path_rows(
        runner.input_ids.gpu,
        runner.positions,
        list(aux_hidden_states or []),
        step.query_start,
        step.accepted,
        step.num_accepted,
        step.num_draft,
        step.trees.token_ids.shape[1],
    )


def _wrap_input_fits_in_drafter(original):
    """vLLM skips the drafter for a step when a request's drafter queries would pass the
    drafter's length limit, counting ``1 + num_speculative_tokens`` (= the budget) queries; a
    DDTree drafter runs ``1 + depth``."""

    def _input_fits_in_drafter(self, common_attn_metadata):
        drafter = _ddtree_proposer(self)
        if drafter is None or common_attn_metadata is None:
            return original(self, common_attn_metadata)
        queries = 1 + drafter.ddtree.depth
        limit = self.effective_drafter_max_model_len
        return common_attn_metadata.max_seq_len + queries <= limit

    return _input_fits_in_drafter


def _prepare_gdn_buffers(runner, when: str) -> None:
    """Hybrid targets: the GDN tree path's per-layer buffers (``hybrid_gdn``), allocated once."""
    gdn = hybrid_gdn.active_step()
    if gdn is not None and _ddtree_proposer(runner) is not None:
        found = gdn.prepare_layers(runner.get_model())
        logger.info("vllm-ddtree: buffers for %d GatedDeltaNet layers %s", found, when)


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
        return original(self, *args, **kwargs)

    return capture_model


EXPECTED_SIGNATURES = {
    "capture_model": ["self"],
    "profile_run": ["self"],
    "_determine_batch_execution_and_padding": [
        "self",
        "num_tokens",
        "num_reqs",
        "num_scheduled_tokens_np",
        "max_num_scheduled_tokens",
        "use_cascade_attn",
        "allow_microbatching",
        "force_eager",
        "force_uniform_decode",
    ],
    "_prepare_inputs": ["self", "scheduler_output", "num_scheduled_tokens"],
    "_sample": ["self", "logits", "spec_decode_metadata"],
    "_input_fits_in_drafter": ["self", "common_attn_metadata"],
    "propose_draft_token_ids": [
        "self",
        "scheduler_output",
        "sampled_token_ids",
        "sampling_metadata",
        "hidden_states",
        "sample_hidden_states",
        "aux_hidden_states",
    ],
}


def install() -> None:
    """Wrap the V1 runner methods once per process (fails loudly if vLLM changed them)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name, wrap in (
        ("capture_model", _wrap_capture_model),
        ("profile_run", _wrap_profile_run),
        ("_determine_batch_execution_and_padding", _wrap_determine_batch_execution),
        ("_prepare_inputs", _wrap_prepare_inputs),
        ("_sample", _wrap_sample),
        ("_input_fits_in_drafter", _wrap_input_fits_in_drafter),
        ("propose_draft_token_ids", _wrap_propose),
    ):
        wrap_function(GPUModelRunner, name, "GPUModelRunner", wrap, EXPECTED_SIGNATURES[name])
