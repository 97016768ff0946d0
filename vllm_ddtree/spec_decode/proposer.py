"""The DDTree proposer: vLLM's DFlash drafter pass, then a draft tree per request.

``DDTreeProposer`` subclasses vLLM 0.26.0's V1 ``DFlashProposer``. vLLM's
``num_speculative_tokens`` is the tree budget (scheduler slots, verify width); the drafter still
runs its ``depth`` mask queries. After the one drafter forward, the mask rows' full-vocabulary
logits ``[R, depth, V]`` go through ``build_trees`` on the device, and the ``budget`` node tokens
(node order, padding as token 0) are what vLLM schedules for verification. The trees are kept,
keyed by request id, for each request's next scheduled step (``proposal_store.RequestTrees``,
read by the runner hooks, ``v1_hooks.py``).

The proposer drafts from the logits its draft source gives (``draft_source.py``): the
drafter's own in serving, the test kit's oracle in tests.
"""

from __future__ import annotations

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree import envs
from vllm_ddtree.budget.acceptance import make_tracker
from vllm_ddtree.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.hybrid import gdn_layer
from vllm_ddtree.metrics.step_ranges import step_range
from vllm_ddtree.ops.keyed_gumbel import couple_draft_logits
from vllm_ddtree.ops.tree_build import build_draft_trees
from vllm_ddtree.requests.structured_outputs import ParentsToHost
from vllm_ddtree.spec_decode import step_checks
from vllm_ddtree.spec_decode.draft_source import draft_source
from vllm_ddtree.spec_decode.proposal_store import RequestTrees
from vllm_ddtree.spec_decode.request_seeds import batch_seeds
from vllm_ddtree.spec_decode.step_state import StepState, runner_step_state


class DDTreeProposer(DFlashProposer):
    """vLLM's DFlash proposer that drafts a DDTree per request when DDTree is configured."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.runner = runner  # vLLM's base proposer does not keep it
        self.ddtree: DDTreeConfig | None = get_ddtree_config(vllm_config.speculative_config)
        if self.ddtree is not None and self.ddtree.depth > self.num_speculative_tokens:
            self._size_query_buffers(1 + self.ddtree.depth)
        self.proposals: RequestTrees | None = None
        self.state: StepState | None = None  # the step's hand-overs (step_state.py)
        # The parents of the trees just proposed, for the scheduler's grammar bitmask.
        self.proposed_parents: torch.Tensor | None = None
        self.parents_to_host = ParentsToHost()
        if self.ddtree is not None:
            self.proposals = RequestTrees(self.ddtree.tree_budget, self.ddtree.depth)
            self.state = StepState(acceptance=make_tracker(vllm_config, torch.device(device)))
            if runner is not None:
                runner_step_state(runner, self.state)
        self.draft_source = draft_source(vllm_config, device)
        if self.ddtree is not None and vllm_config.model_config.is_hybrid:
            # GatedDeltaNet layers verify trees (the state dtypes and layouts it serves were
            # checked before the engine started: config.check_target_is_supported).
            self.state.hybrid = gdn_layer.hybrid_tree_step(
                vllm_config, self.ddtree.tree_budget, device
            )

    def _size_query_buffers(self, queries_per_request: int) -> None:
        """DFlash sizes its query buffers for 1 + num_speculative_tokens (= the budget) queries
        per request; a tree narrower than the drafter's depth needs 1 + depth."""
        device = self.positions.device
        self.max_query_tokens = self.max_batch_size * queries_per_request
        self.max_positions = self.max_num_tokens + self.max_query_tokens
        # vLLM pads a drafter batch up to the next CUDA-graph size, which may lie past
        # max_query_tokens (capture sizes are multiples of 1 + budget, not of 1 + depth).
        capture = self.vllm_config.compilation_config.max_cudagraph_capture_size or 0
        length = max(self.max_query_tokens, capture)
        self._slot_mapping_buffer = torch.zeros(length, dtype=torch.int64, device=device)
        self.positions = torch.zeros(length, dtype=torch.int64, device=device)
        self.arange = torch.arange(self.max_positions + 1, device=device, dtype=torch.int32)

    def propose(self, num_speculative_tokens, *args, **kwargs) -> torch.Tensor:
        """Returns long ``[R, budget]`` node tokens (DDTree) or vLLM's ``[R, k]`` chain."""
        if self.ddtree is None:
            return super().propose(num_speculative_tokens, *args, **kwargs)
        self._tree_tokens: torch.Tensor | None = None
        self._tree_parents: torch.Tensor | None = None
        with step_range("ddtree::draft"):  # the drafter pass and the tree build
            super().propose(self.ddtree.depth, *args, **kwargs)
        tokens, parents = self._tree_tokens, self._tree_parents
        self._tree_tokens = self._tree_parents = None
        if envs.checking_steps():
            self._check_query_slots(tokens.shape[0])
        width = min(num_speculative_tokens, tokens.shape[1])
        self.proposed_parents = parents[:, :width]
        return tokens[:, :width]

    def _check_query_slots(self, num_reqs: int) -> None:
        """Test switch (``step_checks``): each request's last drafter query (its bonus
        position + depth) has a K/V slot in the request's blocks."""
        query_len = 1 + self.ddtree.depth
        last = self.positions[: num_reqs * query_len].view(num_reqs, query_len)[:, -1]
        table = self.runner.input_batch.block_table[self.kv_cache_gid]
        allocated = table.num_blocks_per_row[:num_reqs] * table.block_size
        step_checks.check_slots_allocated("the drafter", last, allocated)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        """``hidden_states`` ``[R * depth, H]`` of the mask rows -> one tree per request."""
        if self.ddtree is None:
            vllm_drafts = super()._sample_draft_tokens
            return self.draft_source.v1_chain_drafts(
                self, hidden_states, sampling_metadata, vllm_drafts
            )
        depth = self.ddtree.depth
        num_reqs = hidden_states.shape[0] // depth
        logits = self.model.compute_logits(hidden_states).view(num_reqs, depth, -1)
        logits = self.draft_source.v1_logits(self, logits, num_reqs, depth)
        if not sampling_metadata.all_greedy and self.runner is not None:
            logits = self._coupled_logits(logits, sampling_metadata, num_reqs, depth)
        with step_range("ddtree::build_trees"):
            trees = build_draft_trees(logits, self.ddtree.tree_budget, self.ddtree.tree_top_k)
        if self.runner is not None:
            self.proposals.forget_all_but(self.runner.requests)
            self.proposals.proposed(list(self.runner.input_batch.req_ids[:num_reqs]), trees)
        self._tree_tokens = trees.token_ids.clamp(min=0)
        self._tree_parents = trees.parents
        # vLLM reshapes what this returns to [R, depth]; the real drafts are the tree tokens.
        placeholder = torch.zeros(num_reqs * depth, dtype=torch.long, device=hidden_states.device)
        return placeholder, None

    def _coupled_logits(self, logits, sampling_metadata, num_reqs: int, depth: int):
        """Sampled requests' draft logits ``[R, depth, V]`` plus the target's keyed noise
        (``ops/keyed_gumbel.py``): depth ``j + 1``'s token is chosen by the target row at the
        bonus position + ``j``, the key of its noise."""
        if not envs.coupled_drafts():
            return logits
        bonus_positions = self._bonus_positions(num_reqs, depth).long()
        keys = bonus_positions.unsqueeze(1) + torch.arange(depth, device=logits.device)
        seeds = batch_seeds(self.runner, num_reqs, logits.device)
        temperature = sampling_metadata.temperature[:num_reqs]
        return couple_draft_logits(logits, temperature, seeds, keys)

    def _bonus_positions(self, num_reqs: int, depth: int) -> torch.Tensor:
        """``[R]``: each request's bonus token position (its drafter query is the bonus row
        then ``depth`` mask rows; mask ``j`` predicts the token at bonus position + 1 + ``j``)."""
        query_len = 1 + depth
        return self.positions[: num_reqs * query_len : query_len]
