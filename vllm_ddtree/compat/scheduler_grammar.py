"""The plugin's wrappers of vLLM's structured-output path in the scheduler (the seam group
``ENGINE``): in a DDTree engine each calls the function of ``requests/structured_outputs.py``
that vLLM's tree calls from the same method."""

from __future__ import annotations

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.requests.structured_outputs import (
    after_update_draft_token_ids,
    after_update_draft_token_ids_in_output,
    tree_grammar_bitmask,
)


def _is_ddtree_engine(vllm_config) -> bool:
    return get_ddtree_config(getattr(vllm_config, "speculative_config", None)) is not None


def _wrap_grammar_bitmask(original):
    """``StructuredOutputManager.grammar_bitmask``: a DDTree engine's rows follow its trees."""

    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_tokens):
        if not structured_output_request_ids or not _is_ddtree_engine(self.vllm_config):
            return original(self, requests, structured_output_request_ids, scheduled_tokens)
        return tree_grammar_bitmask(self, requests, structured_output_request_ids, scheduled_tokens)

    return grammar_bitmask


def _wrap_update_draft_token_ids(original):
    """``Scheduler.update_draft_token_ids`` (synchronous scheduling)."""

    def update_draft_token_ids(self, draft_token_ids):
        original(self, draft_token_ids)
        if _is_ddtree_engine(self.vllm_config):
            after_update_draft_token_ids(self, draft_token_ids)

    return update_draft_token_ids


def _wrap_update_draft_token_ids_in_output(original):
    """``Scheduler.update_draft_token_ids_in_output`` (asynchronous scheduling)."""

    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output):
        original(self, draft_token_ids, scheduler_output)
        if _is_ddtree_engine(self.vllm_config):
            after_update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output)

    return update_draft_token_ids_in_output
