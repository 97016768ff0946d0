"""CUDA-graph sizes for tree verifies: which graphs a DDTree engine needs and where vLLM's
own sizes leave a verify batch without a FULL graph.

vLLM sizes an engine's graphs for ``1 + num_speculative_tokens`` tokens per request (for
DDTree the tree budget) and captures, on the V2 runner, one FULL graph per size rounded up to a
multiple of the verify width. These functions say what to add: the largest graph a tree engine
needs (``largest_graph_for``), the sizes that give every uniform verify batch a FULL graph
(``verify_graph_sizes``), and, where the user chose the sizes, the budget per batch size that
fits them (``schedule_within_graphs``).
"""

from __future__ import annotations

import bisect

from vllm_ddtree.budget.cost_model import ONLINE_CANDIDATES, VERIFY_GRAPH_TOKENS


def vllm_largest_graph(max_num_seqs: int, width: int) -> int:
    """vLLM's own largest CUDA graph (tokens) for ``width`` tokens per request."""
    return min(2 * max_num_seqs * width, 512)


def largest_graph_for(max_num_seqs: int, tree_budget: int, depth: int) -> int:
    """The largest CUDA graph (tokens) a DDTree engine needs: the verify batch of
    ``max_num_seqs`` trees (``1 + tree_budget`` tokens each) and the DFlash drafter's batch
    (``1 + depth`` each), by vLLM's own rule (twice the batch, at most 512), raised to the whole
    batch (up to ``VERIFY_GRAPH_TOKENS``) rounded up to a size vLLM's rule lists."""
    width = 1 + max(tree_budget, depth)
    batch = min(max_num_seqs * width, VERIFY_GRAPH_TOKENS)
    # vLLM's sizes step by 16 past 256 tokens (by 8 below) and stop at the largest of them.
    return max(vllm_largest_graph(max_num_seqs, width), -(-batch // 16) * 16)


def verify_graph_sizes(sizes: list[int], widths, max_num_seqs: int) -> list[int]:
    """``sizes`` (CUDA-graph capture sizes, tokens) with ``requests x width`` added for every
    uniform verify batch of a ``width`` in ``widths`` that would have no FULL graph in vLLM's
    V2 graph manager: it captures one per size rounded up to a multiple of the width, so the
    batch of ``k`` requests has one only where some size lies in ``(width x (k - 1), width x
    k]``. vLLM's default sizes step by 8 tokens, then 16, so only widths below 16 can miss.
    Batches past ``max_num_seqs`` or the largest size get nothing."""
    if not sizes:
        return list(sizes)
    largest = max(sizes)
    chosen = sorted(set(sizes))
    for width in sorted(set(widths)):
        for requests in range(1, min(max_num_seqs, largest // width) + 1):
            low, high = width * (requests - 1), width * requests
            above = bisect.bisect_right(chosen, low)  # the first size past ``low``
            if above == len(chosen) or chosen[above] > high:
                chosen.insert(above, high)
    return chosen


def has_full_graph(sizes: list[int], width: int, requests: int) -> bool:
    """Whether vLLM's V2 graph manager has a FULL graph for a uniform verify batch of
    ``requests`` x ``width`` tokens, given capture ``sizes``: it captures one per size
    rounded up to a multiple of the width (``verify_graph_sizes``), none past the largest."""
    low, high = width * (requests - 1), width * requests
    return high <= max(sizes) and any(low < size <= high for size in sizes)


def schedule_within_graphs(
    schedule, tree_budget: int, sizes: list[int], max_num_seqs: int
) -> list[tuple[int, int, int]]:
    """Tree nodes per batch size (vLLM's inclusive ranges) for batch sizes 1..``max_num_seqs``:
    at each the scheduled budget (``schedule``, or ``tree_budget`` everywhere), else the
    largest smaller budget of the schedule or of "auto"'s online candidates whose verify has a
    FULL graph among ``sizes`` (``has_full_graph``), else 0: no drafts (the batch decodes as
    the target alone does with those sizes)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    if schedule:
        lookup = build_dynamic_sd_schedule_lookup(schedule, max_num_seqs, tree_budget)
    else:
        lookup = [tree_budget] * (max_num_seqs + 1)
    smaller = {entry[2] for entry in schedule or []} | {tree_budget} | set(ONLINE_CANDIDATES)
    fitted: list[tuple[int, int, int]] = []
    for requests in range(1, max_num_seqs + 1):
        choices = sorted((b for b in smaller if 0 < b <= lookup[requests]), reverse=True)
        nodes = next((b for b in choices if has_full_graph(sizes, 1 + b, requests)), 0)
        if fitted and fitted[-1][2] == nodes:
            fitted[-1] = (fitted[-1][0], requests, nodes)
        else:
            fitted.append((requests, requests, nodes))
    return fitted
