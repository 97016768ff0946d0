"""The DDTree speculator for vLLM 0.26.0's V2 model runner: one draft tree per request.

``DDTreeSpeculator`` is vLLM's V2 DFlash speculator at the drafter's depth. Its
``sample_draft`` (inside the speculator's FULL CUDA graph) builds the trees from the mask rows'
full-vocabulary logits (``ops/tree_build.py``, no host synchronisation) and keeps them per
request state (``ProposalStore``); ``propose`` first puts the accepted path's rows first with
fresh positions (``ops/drafter_rows.py``), then returns the node tokens ``[R, budget]`` vLLM
schedules next. It owns the worker's ``StepState``, which the V2 runner hooks
(``v2_hooks.py``) fill and read.
"""

from __future__ import annotations

import copy
import inspect

import torch

from vllm_ddtree import envs
from vllm_ddtree.budget.acceptance import make_tracker
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.hybrid.gdn_layer import hybrid_tree_step
from vllm_ddtree.metrics.step_ranges import step_range
from vllm_ddtree.ops.drafter_rows import move_path_rows
from vllm_ddtree.ops.keyed_gumbel import perturb_like_vllm_v2
from vllm_ddtree.ops.tree_build import build_draft_trees
from vllm_ddtree.requests.structured_outputs import ParentsToHost
from vllm_ddtree.spec_decode.draft_source import draft_source
from vllm_ddtree.spec_decode.proposal_store import ProposalStore
from vllm_ddtree.spec_decode.step_state import StepState


def drafter_vllm_config(vllm_config, depth: int):
    """The config DDTree's drafter is built from: ``vllm_config`` with the drafter's ``depth``
    as ``num_speculative_tokens`` and no per-batch-size schedule. The drafter drafts
    ``depth`` mask queries per request whatever tree budget a batch size is served; with the
    schedule, vLLM's V2 graph manager captured its graphs at the schedule's verify widths
    (``1 + budget`` tokens per request) and no drafter batch ever replayed one (an 8B "auto"
    engine's step at batch 1 took 12 ms where fixed budgets took 8). Shallow copies: no
    config validation runs again, and the model configs and everything else are shared."""
    drafter_spec = copy.copy(vllm_config.speculative_config)
    drafter_spec.num_speculative_tokens = depth
    drafter_spec.num_speculative_tokens_per_batch_size = None
    drafter_config = copy.copy(vllm_config)
    drafter_config.speculative_config = drafter_spec
    return drafter_config


def ddtree_speculator_class():
    """``DDTreeSpeculator`` (made on first use: it subclasses vLLM's V2 DFlash speculator,
    imported only where the V2 runner runs)."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    class DDTreeSpeculator(DFlashSpeculator):
        """vLLM's V2 DFlash speculator at the drafter's depth, drafting one tree per request.

        vLLM's ``num_speculative_tokens`` is the tree budget (the runner's verify width); the
        drafter is built from a copy of the config whose ``num_speculative_tokens`` is the
        depth, so its query block, sample rows and CUDA graphs are DFlash's own.
        """

        _speculator_name = "DDTree"
        # vLLM's arguments to ``propose``, read by name however they were passed.
        _propose_signature = inspect.signature(DFlashSpeculator.propose)

        def __init__(self, vllm_config, device: torch.device):
            ddtree = get_ddtree_config(vllm_config.speculative_config)
            assert ddtree is not None
            super().__init__(drafter_vllm_config(vllm_config, ddtree.depth), device)
            self.ddtree = ddtree
            rows, tree_budget = self.max_num_reqs, ddtree.tree_budget
            # The last proposals, per batch row (written inside the drafter's graph) and per
            # request state (vLLM's req_state index), read at each request's next step.
            self.proposals = ProposalStore(rows, tree_budget, ddtree.depth, device)
            # The step's hand-overs (step_state.py); an online "auto" engine's acceptance.
            self.state = StepState(acceptance=make_tracker(vllm_config, torch.device(device)))
            if vllm_config.model_config.is_hybrid:  # GatedDeltaNet layers verify the trees
                self.state.hybrid = hybrid_tree_step(vllm_config, tree_budget, device)
            # An online "auto" engine searches its trees to the widest tree the last step
            # verified (the budget served at this batch size; long [1], read inside the
            # drafter's graph), not to its largest candidate: a steady step's next verify has
            # that width, and a wider one after a change verifies the smaller tree once.
            self.search_nodes = None
            self.searched = tree_budget  # what search_nodes holds (host), to fill it on change
            if self.state.acceptance is not None:
                self.search_nodes = torch.full(
                    (1,), tree_budget, dtype=torch.long, device=torch.device(device)
                )
            # The parents of the trees just proposed, for the scheduler's grammar bitmask.
            self.parents_to_host = ParentsToHost()
            self.draft_source = draft_source(vllm_config, device)  # (draft_source.py)

        def sample_draft(
            self, hidden_states, positions, idx_mapping, temperature, seeds, *args, **kwargs
        ):
            """``hidden_states`` ``[R * depth, H]`` of the mask rows -> the trees of the batch
            rows (kept in ``proposals.batch``); returns placeholder drafts ``[R * depth]``.
            ``positions`` (long ``[R * depth]``) are vLLM's Gumbel keys, each mask row's
            predicted position minus 2; ``idx_mapping`` its request state (-1: padding);
            ``temperature``, ``seeds``: by request state. Sampled requests' trees are built
            from logits coupled to the noise vLLM's sampler will draw at each depth
            (``ops/keyed_gumbel.py``)."""
            depth = self.ddtree.depth
            num_reqs = hidden_states.shape[0] // depth
            logits = self.model.compute_logits(hidden_states)
            logits = self.draft_source.v2_logits(logits, positions, idx_mapping, depth)
            if envs.coupled_drafts() and logits.is_cuda:  # (V2 runs on CUDA only)
                logits = logits.float().contiguous()
                # The target row choosing the predicted token sits one position before it.
                perturb_like_vllm_v2(
                    logits, idx_mapping, temperature, seeds, positions + 1, self.use_fp64_gumbel
                )
            logits = logits.view(num_reqs, depth, -1)
            trees = build_draft_trees(
                logits, self.ddtree.tree_budget, self.ddtree.tree_top_k, self.search_nodes
            )
            self.proposals.write_batch(trees)
            return torch.zeros(num_reqs * depth, dtype=torch.long, device=hidden_states.device)

        def propose(self, input_batch, *args, **kwargs) -> torch.Tensor:
            """vLLM's DFlash proposal (its arguments: ``input_batch, attn_metadata,
            slot_mappings, last_hidden_states, aux_hidden_states, num_sampled, ...``) on the
            accepted path's rows; returns the node tokens ``[R, budget]`` (padding: token 0),
            keeping each request's tree for its next step."""
            bound = self._propose_signature.bind(self, input_batch, *args, **kwargs)
            dummy_run = bound.arguments.get("dummy_run", False)
            step, self.state.step = self.state.step, None
            if not dummy_run and step is not None and step.accepted is not None:
                last = bound.arguments["last_hidden_states"]
                aux = bound.arguments["aux_hidden_states"]
                move_path_rows(
                    input_batch.input_ids,
                    input_batch.positions,
                    list(aux or [last]),
                    step.root_row,
                    step.accepted,
                    step.num_accepted,
                    step.num_draft,
                    self.ddtree.tree_budget,
                )
            if not dummy_run:
                self._set_search_nodes(step)
            self.proposals.flush()  # the drafter run overwrites the per-row trees
            with step_range("ddtree::draft"):  # the drafter's graph: its pass and the trees
                super().propose(input_batch, *args, **kwargs)
            num_reqs = input_batch.num_reqs
            self.parents_to_host.clear()
            if not dummy_run:
                self.proposals.proposed(
                    input_batch.idx_mapping_np[:num_reqs],
                    input_batch.idx_mapping[:num_reqs],
                    input_batch.req_ids[:num_reqs],
                )
                if input_batch.has_structured_output_reqs:  # vLLM copies the drafts too
                    self.parents_to_host.start(self.proposals.batch.parents[:num_reqs])
            return self.proposals.batch.token_ids[:num_reqs].clamp(min=0)

        def _set_search_nodes(self, step) -> None:
            """``search_nodes`` for the trees about to be drafted: the most nodes a request
            was scheduled in ``step`` (the step just verified), or the budget after a step
            without trees (a fill where it changed, no host read of the device)."""
            if self.search_nodes is None:
                return
            widest = (step.widest if step is not None else None) or self.ddtree.tree_budget
            if widest != self.searched:
                self.search_nodes.fill_(widest)
                self.searched = widest

    return DDTreeSpeculator
