"""vLLM's request-level logits processors on a tree step's rows (V1 runner): allowed token
ids, bad words, presence / frequency / repetition penalties.

vLLM applies these to a chain's ``k``-th row with the request's output tokens and the ``k``
drafts before it (``Sampler._combine_outputs_with_spec_tokens``). A tree node's row continues
the node's own path, so its tokens are the request's outputs and the tokens of the path from
the root's child down to the node itself (the root's row: the outputs alone,
``tree_row_outputs``). Every row then goes through vLLM's own ``apply_bad_words`` and
``apply_all_penalties`` at its request's values, and its request's allowed-token mask: each
node's logits are the ones target-alone decoding gets after that path.
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
    the tokens before the row's next one. ``token_ids`` / ``parents``: each request's nodes
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


def needs_tree_processors(sampling_metadata) -> bool:
    """Whether any request of the step has allowed token ids, bad words or penalties."""
    return (
        sampling_metadata.allowed_token_ids_mask is not None
        or bool(sampling_metadata.bad_words_token_ids)
        or not sampling_metadata.no_penalties
    )


def apply_tree_processors(
    logits: torch.Tensor,
    sampling_metadata,
    trees,
    num_draft: list[int],
    request_of_row: torch.Tensor,
) -> torch.Tensor:
    """``logits`` ``[rows, V]`` (float32, changed in place and returned) after each row's
    allowed token ids, bad words and penalties, in vLLM's order (``request_of_row`` long
    ``[rows]``). Reads the trees on the host (a synchronisation) when a request has bad words
    or penalties."""
    from vllm.v1.sample.ops.bad_words import apply_bad_words
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    if sampling_metadata.allowed_token_ids_mask is not None:
        disallowed = sampling_metadata.allowed_token_ids_mask.index_select(0, request_of_row)
        logits.masked_fill_(disallowed, float("-inf"))
    bad_words = sampling_metadata.bad_words_token_ids
    if not bad_words and sampling_metadata.no_penalties:
        return logits
    row_outputs = tree_row_outputs(
        sampling_metadata.output_token_ids,
        trees.token_ids.tolist(),
        trees.parents.tolist(),
        num_draft,
    )
    if bad_words:
        first = [0]
        for n in num_draft:
            first.append(first[-1] + 1 + n)
        by_row = {
            row: bad_words[r]
            for r in bad_words
            for row in range(first[r], first[r] + 1 + num_draft[r])
        }
        apply_bad_words(logits, by_row, row_outputs)
    if sampling_metadata.no_penalties:
        return logits
    return apply_all_penalties(
        logits,
        sampling_metadata.prompt_token_ids.index_select(0, request_of_row),
        sampling_metadata.presence_penalties.index_select(0, request_of_row),
        sampling_metadata.frequency_penalties.index_select(0, request_of_row),
        sampling_metadata.repetition_penalties.index_select(0, request_of_row),
        row_outputs,
    )
