"""vLLM's V2 sampler on a tree step's rows: penalties and bad words along each row's own path.

vLLM's V2 ``Sampler`` applies each request's logit bias (``allowed_token_ids``,
``min_tokens``), penalties, bad words, temperature, ``min_p``, ``top_k`` / ``top_p`` to every
logits row of a step, in that order. Logit bias reads the row's position, and a tree node's
row has its depth position: it needs nothing. Penalties and bad words read the row's past, and
for a chain's ``k``-th row that is the ``k`` rows before it; a tree node's past is its own
path. So for the tree step's sample, DDTree's stand-ins for the sampler's
``penalties_state`` and ``bad_words_state`` (``PathPenalties``, ``PathBadWords``, installed
once by ``install_path_states``) apply them from each row's path tokens
(``ops/path_tokens.py``, ``ops/tree_penalties.py``, ``ops/tree_bad_words.py``); everything
else, vLLM's order and its states included, stays vLLM's. Outside a tree step (``rows`` not
set) they are vLLM's own.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.ops.tree_bad_words import apply_tree_bad_words
from vllm_ddtree.ops.tree_penalties import apply_tree_penalties


@dataclass
class RowPaths:
    """A tree step's logits rows' path tokens (long ``[rows, L]``, -1 after the path) and
    their number (long ``[rows]``)."""

    tokens: torch.Tensor
    lengths: torch.Tensor


class _PathState:
    """One of vLLM's sampler states, its method that reads a row's past redirected to the
    row's path while ``rows`` is set; every other attribute is the state's own."""

    def __init__(self, inner):
        self.inner = inner
        self.rows: RowPaths | None = None

    def __getattr__(self, name):
        if name == "inner":  # not yet set (copying): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class PathPenalties(_PathState):
    """vLLM's ``PenaltiesState`` whose penalties count each tree row's own path."""

    def apply_penalties(
        self, logits, expanded_idx_mapping, idx_mapping_np, input_ids, expanded_local_pos
    ) -> None:
        inner = self.inner
        if self.rows is None:
            inner.apply_penalties(
                logits, expanded_idx_mapping, idx_mapping_np, input_ids, expanded_local_pos
            )
            return
        if not np.any(inner.use_penalty[idx_mapping_np]):
            return
        apply_tree_penalties(
            logits,
            expanded_idx_mapping,
            self.rows.tokens,
            inner.repetition_penalty.gpu,
            inner.frequency_penalty.gpu,
            inner.presence_penalty.gpu,
            inner.prompt_bin_mask,
            inner.output_bin_counts,
        )


class PathBadWords(_PathState):
    """vLLM's ``BadWordsState`` whose words match each tree row's own past."""

    def apply_bad_words(
        self, logits, expanded_idx_mapping, idx_mapping_np, input_ids, expanded_local_pos
    ) -> None:
        inner = self.inner
        if self.rows is None:
            inner.apply_bad_words(
                logits, expanded_idx_mapping, idx_mapping_np, input_ids, expanded_local_pos
            )
            return
        max_num_words = int(inner.num_bad_words.np[idx_mapping_np].max())
        if max_num_words == 0:
            return
        requests = inner.req_states
        apply_tree_bad_words(
            logits,
            expanded_idx_mapping,
            self.rows.tokens,
            self.rows.lengths,
            inner.bad_word_token_ids.gpu,
            inner.bad_word_offsets.gpu,
            inner.num_bad_words.gpu,
            requests.all_token_ids.gpu,
            requests.prompt_len.gpu,
            requests.total_len.gpu,
            max_num_words,
        )


def install_path_states(sampler) -> None:
    """Give ``sampler`` (vLLM's V2 ``Sampler``) the path-aware stand-ins, once."""
    if not isinstance(sampler.penalties_state, PathPenalties):
        sampler.penalties_state = PathPenalties(sampler.penalties_state)
    if not isinstance(sampler.bad_words_state, PathBadWords):
        sampler.bad_words_state = PathBadWords(sampler.bad_words_state)


def reads_row_paths(sampler, idx_mapping_np: np.ndarray) -> bool:
    """Whether a request of the batch (request states ``idx_mapping_np``) has penalties or
    bad words (host arrays: no synchronisation)."""
    penalties, bad_words = sampler.penalties_state, sampler.bad_words_state
    return bool(np.any(penalties.use_penalty[idx_mapping_np])) or bool(
        np.any(bad_words.num_bad_words.np[idx_mapping_np] > 0)
    )


@contextmanager
def tree_rows(sampler, rows: RowPaths | None):
    """While inside, ``sampler``'s penalties and bad words read ``rows``' paths (None: as
    vLLM's)."""
    install_path_states(sampler)
    states = (sampler.penalties_state, sampler.bad_words_state)
    for state in states:
        state.rows = rows
    try:
        yield
    finally:
        for state in states:
            state.rows = None
