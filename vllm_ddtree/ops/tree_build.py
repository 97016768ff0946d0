"""Draft-tree construction, the best-first search in one launch: Triton kernel, launcher and
PyTorch reference (each depth's candidates before it: ``ops/top_candidates.py``).

The reference (``vllm_ddtree.tree.build_trees``) runs a per-depth beam of width ``budget`` and
one sort, ~70 tensor ops at depth 15; at small batches their launches cost more than their
work. The kernel runs the paper's best-first search directly, one program per request:

* the frontier holds, for every node already chosen, at most one pending sibling (its
  parent's next-ranked token at the same depth) and one pending first child (the best token
  one depth below), ``budget + 1`` slots at most;
* ``budget`` times: pop the best-scoring frontier entry as the next node (scores never
  increase, so nodes come out in the reference's order), replace it by its next sibling and
  add its first child.

Scores are the same float32 sums as the reference's (parent score + the token's log-prob), so
the trees are equal whenever no two prefixes tie. Probability-0 tokens (``-inf``) are never
drafted; a request gets fewer than ``budget`` nodes only when fewer such prefixes exist.

``max_nodes`` (a long ``[1]`` tensor on the device, read when the kernel runs, so a CUDA graph
replays with its current value) stops the search after that many nodes: the first
``max_nodes`` nodes of the budget's tree (a best-first prefix is a tree), the rest of the
``budget`` slots padding. An "auto" engine builds its trees at the budget it serves, not at its
largest candidate: the search is sequential, one pop per node.

Shapes: ``draft_logits`` float ``[R, L, V]``; the tree tensors as in ``DDTreeBatch``.
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops import use_triton
from vllm_ddtree.ops.top_candidates import MAX_FUSED_CAP, top_candidates_triton
from vllm_ddtree.tree import (
    DDTreeBatch,
    candidate_cap,
    depth_candidates,
    empty_batch,
    select_trees,
    token_log_probs,
)
from vllm_ddtree.tree import build_trees as build_trees_ref

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

__all__ = [
    "build_draft_trees",
    "build_trees_cut_ref",
    "build_trees_ref",
    "build_trees_triton",
    "device_log_probs",
]


if HAS_TRITON:

    @triton.jit
    def _build_tree_kernel(
        log_probs_ptr,
        tokens_ptr,
        out_tokens_ptr,
        out_parents_ptr,
        out_depths_ptr,
        out_scores_ptr,
        out_num_nodes_ptr,
        max_nodes_ptr,
        stride_lp_req,
        stride_lp_depth,
        stride_tok_req,
        stride_tok_depth,
        stride_out,
        depth_limit,
        cap,
        tree_budget,
        FRONTIER: tl.constexpr,
        HAS_MAX_NODES: tl.constexpr,
    ):
        req = tl.program_id(0)
        offs = tl.arange(0, FRONTIER)
        neg_inf = float("-inf")
        lp_row = log_probs_ptr + req * stride_lp_req
        tok_row = tokens_ptr + req * stride_tok_req
        # Frontier slot: candidate score, its parent's score, parent tree index, depth, rank.
        first = tl.load(lp_row)
        score = tl.where(offs == 0, first, neg_inf)
        parent_score = tl.zeros((FRONTIER,), dtype=tl.float32)
        parent = tl.zeros((FRONTIER,), dtype=tl.int64)
        depth = tl.where(offs == 0, 1, 0).to(tl.int64)
        rank = tl.zeros((FRONTIER,), dtype=tl.int64)
        used = 1
        count = tl.zeros((), dtype=tl.int64)
        num_pops = tree_budget
        if HAS_MAX_NODES:
            num_pops = tl.minimum(tl.load(max_nodes_ptr).to(tl.int32), tree_budget)
            num_pops = tl.maximum(num_pops, 0)
            # The slots past the search are padding, as the reference's cut trees.
            tail = (offs >= num_pops) & (offs < tree_budget)
            tail_out = req * stride_out + offs
            tl.store(out_tokens_ptr + tail_out, tl.full((FRONTIER,), -1, tl.int64), mask=tail)
            tl.store(out_parents_ptr + tail_out, tl.zeros((FRONTIER,), tl.int64), mask=tail)
            tl.store(out_depths_ptr + tail_out, tl.zeros((FRONTIER,), tl.int64), mask=tail)
            tl.store(
                out_scores_ptr + tail_out, tl.full((FRONTIER,), neg_inf, tl.float32), mask=tail
            )
        for i in range(num_pops):
            best_score = tl.max(score, axis=0)
            best = tl.argmax(score, axis=0)
            chosen = offs == best
            valid = best_score > neg_inf
            b_parent_score = tl.sum(tl.where(chosen, parent_score, 0.0), axis=0)
            b_parent = tl.sum(tl.where(chosen, parent, 0), axis=0)
            b_depth = tl.sum(tl.where(chosen, depth, 0), axis=0)
            b_rank = tl.sum(tl.where(chosen, rank, 0), axis=0)
            token = tl.load(
                tok_row + (b_depth - 1) * stride_tok_depth + b_rank, mask=valid, other=-1
            )
            out = req * stride_out + i
            tl.store(out_tokens_ptr + out, tl.where(valid, token, -1))
            tl.store(out_parents_ptr + out, tl.where(valid, b_parent, 0))
            tl.store(out_depths_ptr + out, tl.where(valid, b_depth, 0))
            tl.store(out_scores_ptr + out, best_score)
            count += valid.to(tl.int64)
            # The popped slot becomes its next sibling (same parent and depth, next rank).
            has_sibling = valid & (b_rank + 1 < cap)
            sibling_lp = tl.load(
                lp_row + (b_depth - 1) * stride_lp_depth + b_rank + 1,
                mask=has_sibling,
                other=neg_inf,
            )
            score = tl.where(chosen, b_parent_score + sibling_lp, score)
            rank = tl.where(chosen, b_rank + 1, rank)
            # A new slot holds its first child (one depth below, best token there).
            has_child = valid & (b_depth < depth_limit)
            child_lp = tl.load(lp_row + b_depth * stride_lp_depth, mask=has_child, other=neg_inf)
            fresh = offs == used
            score = tl.where(fresh, best_score + child_lp, score)
            parent_score = tl.where(fresh, best_score, parent_score)
            parent = tl.where(fresh, i + 1, parent)
            depth = tl.where(fresh, b_depth + 1, depth)
            rank = tl.where(fresh, 0, rank)
            used += 1
        tl.store(out_num_nodes_ptr + req, count)


def device_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``tree.token_log_probs`` on CUDA through vLLM's kernel (one program per row: max and
    log-sum-exp over the vocabulary in float32, read in the logits' dtype, then the gather);
    the reference elsewhere (vLLM's Triton kernels need a GPU driver, also under the
    interpreter)."""
    if not logits.is_cuda:
        return token_log_probs(logits, token_ids)
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    vocab, cap = logits.shape[-1], token_ids.shape[-1]
    rows = logits.reshape(-1, vocab).contiguous()
    return compute_token_logprobs(rows, token_ids.reshape(-1, cap)).view(token_ids.shape)


def build_trees_triton(
    draft_logits: torch.Tensor,
    tree_budget: int,
    top_k: int | None = None,
    max_nodes: torch.Tensor | None = None,
    fused_candidates: bool = True,
) -> DDTreeBatch:
    """``build_trees`` with the best-first search in one kernel launch (``R`` programs).

    Args and returns as ``build_trees_ref``: ``draft_logits`` float ``[R, L, V]`` -> a
    ``DDTreeBatch`` of width ``budget``, searched to ``max_nodes`` nodes (long ``[1]`` on the
    device; None: the budget). Before the kernel, each depth's top-``cap`` tokens and their
    log-probabilities come from ``ops/top_candidates.py`` in one read of the logits, for caps
    up to ``MAX_FUSED_CAP`` (the default cap is 16) unless ``fused_candidates`` is False;
    otherwise from PyTorch's top-k and vLLM's fused log-softmax gather
    (``device_log_probs``).
    """
    device = draft_logits.device
    cap = candidate_cap(draft_logits, tree_budget, top_k)
    if cap is None:
        num_reqs, depth_limit, _ = draft_logits.shape
        return empty_batch(num_reqs, tree_budget, depth_limit, device)
    if fused_candidates and cap <= MAX_FUSED_CAP:
        top_log_probs, top_tokens = top_candidates_triton(draft_logits, cap)
    else:
        candidates = depth_candidates(draft_logits, tree_budget, top_k, device_log_probs)
        top_log_probs, top_tokens = (t.contiguous() for t in candidates)  # [R, L, K], sorted
    num_reqs, depth_limit, cap = top_log_probs.shape
    token_ids = torch.empty((num_reqs, tree_budget), dtype=torch.long, device=device)
    parents = torch.empty_like(token_ids)
    depths = torch.empty_like(token_ids)
    scores = torch.empty((num_reqs, tree_budget), dtype=torch.float32, device=device)
    num_nodes = torch.empty(num_reqs, dtype=torch.long, device=device)
    frontier = max(16, triton.next_power_of_2(tree_budget + 1))
    _build_tree_kernel[(num_reqs,)](
        top_log_probs,
        top_tokens,
        token_ids,
        parents,
        depths,
        scores,
        num_nodes,
        num_nodes if max_nodes is None else max_nodes,  # unused without max_nodes
        top_log_probs.stride(0),
        top_log_probs.stride(1),
        top_tokens.stride(0),
        top_tokens.stride(1),
        token_ids.stride(0),
        depth_limit,
        cap,
        tree_budget,
        FRONTIER=frontier,
        HAS_MAX_NODES=max_nodes is not None,
        num_warps=4 if frontier <= 256 else 8,
    )
    return DDTreeBatch(
        token_ids=token_ids,
        parents=parents,
        depths=depths,
        scores=scores,
        num_nodes=num_nodes,
        max_depth=depth_limit,
    )


def build_trees_cut_ref(
    draft_logits: torch.Tensor, tree_budget: int, top_k: int | None, max_nodes: torch.Tensor
) -> DDTreeBatch:
    """``build_trees_triton``'s ``max_nodes`` on the reference: the budget's trees, each cut to
    its first ``max_nodes`` nodes (long ``[1]``), the slots past them padding."""
    trees = build_trees_ref(draft_logits, tree_budget, top_k)
    rows = torch.arange(trees.token_ids.shape[0], device=trees.token_ids.device)
    return select_trees(trees, rows, max_nodes.to(trees.num_nodes).expand_as(rows))


def build_draft_trees(
    draft_logits: torch.Tensor,
    tree_budget: int,
    top_k: int | None = None,
    max_nodes: torch.Tensor | None = None,
):
    """``build_trees_triton`` on CUDA, ``build_trees_ref`` elsewhere (same arguments: float
    ``[R, L, V]`` -> a ``DDTreeBatch`` of width ``budget``; ``max_nodes``, long ``[1]`` on the
    device or None, stops each search at that many nodes)."""
    if use_triton(draft_logits.device):
        return build_trees_triton(draft_logits, tree_budget, top_k, max_nodes)
    if max_nodes is None:
        return build_trees_ref(draft_logits, tree_budget, top_k)
    return build_trees_cut_ref(draft_logits, tree_budget, top_k, max_nodes)
