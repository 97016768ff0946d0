"""Where a DDTree step's draft logits come from: the drafter's own, or the test kit's.

The proposer (V1) and the speculator (V2) are given a ``DrafterLogits`` when they are built
(``draft_source``) and draft from whatever it returns; they never test for a test switch. In
serving it hands the drafter's own logits through and vLLM's chain drafts unchanged. The test
kit's oracle (``testing/oracle.py``, ``OracleDraftSource``) has the same methods and replaces the
logits with target-future ones (after the drafter's, so that their cost is paid), for trees and,
on engines serving the DFlash chain, for the chain: this module is the one seam it enters by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_ddtree import envs


class DrafterLogits:
    """Serving: the drafter's own logits, vLLM's chain drafting unchanged."""

    def v1_logits(self, proposer, logits: torch.Tensor, num_reqs: int, depth: int):
        """The ``[R, depth, V]`` logits the V1 proposer builds the trees from."""
        return logits

    def v1_chain_drafts(self, proposer, hidden_states, sampling_metadata, vllm_drafts: Callable):
        """A V1 chain engine's drafts: vLLM's (``vllm_drafts``)."""
        return vllm_drafts(hidden_states, sampling_metadata)

    def v2_bind(self, runner, input_batch) -> None:
        """Before a V2 step's proposal: nothing to bind."""

    def v2_logits(self, logits, positions, idx_mapping, depth: int):
        """The ``[R * depth, V]`` logits the V2 speculator builds the trees from."""
        return logits

    def v2_chain_speculator(self, vllm_config, device, vllm_speculator: Callable) -> Any:
        """A V2 chain engine's speculator: vLLM's (``vllm_speculator``)."""
        return vllm_speculator(vllm_config, device)


def draft_source(vllm_config, device) -> DrafterLogits:
    """The draft logits a proposer or speculator of ``vllm_config`` is given: the drafter's own,
    or the test kit's oracle where ``VLLM_DDTREE_TEST_ORACLE`` names its file."""
    path = envs.test_oracle()
    if not path:
        return DrafterLogits()
    from vllm_ddtree.testing.oracle import OracleDraftSource

    return OracleDraftSource(
        path,
        vllm_config.model_config.get_vocab_size(),
        vllm_config.scheduler_config.max_num_seqs,
        torch.device(device),
    )
