"""Presence, frequency and repetition penalties on a tree step's rows (V1 runner).

vLLM penalises a chain's ``k``-th row with the request's output tokens and the ``k`` drafts
before it (``Sampler._combine_outputs_with_spec_tokens``). A tree node's row continues the
node's own path, so its tokens are the request's outputs and the tokens of the path from the
root's child down to the node itself (the root's row: the outputs alone). Every row is then
penalised by vLLM's own ``apply_all_penalties`` at its request's values: each node's logits are
the ones target-alone decoding penalises after that path.
"""

from __future__ import annotations

import torch


def tree_row_outputs(
    outputs: list[list[int]],
    token_ids: list[list[int]],
    parents: list[list[int]],
    num_draft: list[int],
) -> list[list[int]]:
    """Per logits row (each request's root, then its ``num_draft[r]`` nodes in tree order):
    the tokens the row's penalties count. ``token_ids`` / ``parents``: each request's nodes
    (host lists; a parent is a tree index, 0 the root, node ``i`` is tree index ``i + 1``;
    best-first order puts every parent before its children)."""
    rows: list[list[int]] = []
    for r, request_outputs in enumerate(outputs):
        paths: list[list[int]] = [[]]  # by tree index: the path's tokens below the root
        for i in range(num_draft[r]):
            parent = parents[r][i]
            # A row without a tree (drafts vLLM padded in) has no parents: its rows are never
            # walked; they count the outputs alone.
            base = paths[parent] if 0 <= parent <= i else []
            paths.append(base + [token_ids[r][i]])
        rows.extend(request_outputs + path for path in paths)
    return rows


def penalize_tree_rows(
    logits: torch.Tensor,
    sampling_metadata,
    trees,
    num_draft: list[int],
    request_of_row: torch.Tensor,
) -> torch.Tensor:
    """``logits`` ``[rows, V]`` (float32, changed in place and returned) with each row's
    penalties (``tree_row_outputs``; ``request_of_row`` long ``[rows]``). Reads the trees on
    the host: a synchronisation, in steps with penalised requests only."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    row_outputs = tree_row_outputs(
        sampling_metadata.output_token_ids,
        trees.token_ids.tolist(),
        trees.parents.tolist(),
        num_draft,
    )
    return apply_all_penalties(
        logits,
        sampling_metadata.prompt_token_ids.index_select(0, request_of_row),
        sampling_metadata.presence_penalties.index_select(0, request_of_row),
        sampling_metadata.frequency_penalties.index_select(0, request_of_row),
        sampling_metadata.repetition_penalties.index_select(0, request_of_row),
        row_outputs,
    )
