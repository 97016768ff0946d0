"""One worker's DDTree step state: what each stage of a step hands to the next, in one object.

A step passes through vLLM's runner in order (V1: ``_prepare_inputs`` ->
``_determine_batch_execution_and_padding`` -> the forward -> ``_sample`` ->
``propose_draft_token_ids``; V2: ``prepare_attn`` -> the forward -> ``sample`` -> the
speculator's ``propose``). Everything one stage leaves for a later one lives in a ``StepState``:

* the proposer (V1) or speculator (V2) owns it (``.state``);
* vLLM's TREE_ATTN metadata builders are handed it (``bind_tree_attention``) and read the
  step's trees from it, and report the slots they built back to it;
* the GatedDeltaNet layers of a hybrid target reach it through the TREE_ATTN metadata of the
  forward they run in (``gdn_layer``);
* the V1 runner holds it on DDTree's one handle (``handles.py``, ``runner_step_state``):
  its CUDA-graph dispatch needs it where no proposer is asked, and an engine whose ``"auto"``
  chose vLLM's chain keeps one too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tree_attn_backend.tree_verify import TreeVerifyBatch, bind_tree_source
from vllm_ddtree.handles import HANDLE, held, hold

if TYPE_CHECKING:
    from vllm_ddtree.budget.acceptance import OnlineAcceptance
    from vllm_ddtree.budget.step_costs import MeasuredStepCosts
    from vllm_ddtree.hybrid.gdn_layer import HybridTreeStep
    from vllm_ddtree.spec_decode.request_seeds import RequestSeeds
    from vllm_ddtree.spec_decode.tree_step import StepTableUpload, TreeStep
    from vllm_ddtree.spec_decode.tree_thinking_budget import TreeThinkingBudget


@dataclass
class StepState:
    """Per worker engine: this step's hand-overs, then what lasts across steps."""

    # This step.
    trees: TreeVerifyBatch | None = None  # the ancestor masks TREE_ATTN's builders read
    built_slot_mapping: torch.Tensor | None = None  # int64 [T]: slots TREE_ATTN's builder saw
    step: TreeStep | None = None  # the trees verified this step
    logits_indices: torch.Tensor | None = None  # V1, long [rows]: the sampled rows
    rows_without_drafts: bool = False  # V1: read once by the CUDA-graph dispatch
    # Across steps.
    hybrid: HybridTreeStep | None = None  # GDN node states (hybrid targets)
    upload: StepTableUpload | None = None  # pinned step tables
    seeds: RequestSeeds | None = None  # each request's sampling seed (V1)
    thinking_budget: TreeThinkingBudget | None = None  # thinking budgets on tree rows (V1)
    acceptance: OnlineAcceptance | None = None  # an online "auto" engine's acceptance
    step_costs: MeasuredStepCosts | None = None  # an online "auto" V2 engine's step costs
    tree_layers: tuple | None = None  # (forward context, its size, the TREE_ATTN layers)
    kv_layers: tuple | None = None  # (quick key, the TREE_ATTN caches as launch tables)
    bound_builders: list = field(default_factory=list)  # the TREE_ATTN builders handed self

    # tree_verify.TreeVerifySource
    def published_trees(self) -> TreeVerifyBatch | None:
        return self.trees

    def record_slot_mapping(self, slot_mapping: torch.Tensor) -> None:
        self.built_slot_mapping = slot_mapping

    def publish(self, trees: TreeVerifyBatch | None) -> None:
        """The tree structure of the step about to run (None: every request plain causal)."""
        self.trees = trees

    def bind_tree_attention(self, attn_groups) -> None:
        """Hand this state to the TREE_ATTN builders of vLLM's ``attn_groups`` (a runner's),
        when they are not the ones handed it last (vLLM makes them once per KV-cache setup)."""
        builders = [b for groups in attn_groups for g in groups for b in g.metadata_builders]
        if len(builders) != len(self.bound_builders) or any(
            a is not b for a, b in zip(builders, self.bound_builders, strict=True)
        ):
            bind_tree_source(attn_groups, self)
            self.bound_builders = builders


def runner_step_state(runner, state: StepState | None = None) -> StepState:
    """The V1 runner's ``StepState`` (``handles.py``): ``state`` when given (the
    proposer's), else the one the runner holds, made on first use (a runner serving vLLM's
    chain for ``"auto"``)."""
    if state is not None and held(runner, StepState) is not state:
        setattr(runner, HANDLE, state)
        return state
    return hold(runner, StepState)


def worker_step_state(worker) -> StepState | None:
    """A worker's ``StepState`` (V1: the runner's handle; V2: the speculator's), or None."""
    worker = getattr(worker, "worker", worker)  # vLLM's wrapper around the worker
    runner = getattr(worker, "model_runner", None)
    state = held(runner, StepState)
    if state is None:
        state = getattr(getattr(runner, "speculator", None), "state", None)
    return state


def worker_acceptance(worker) -> dict[int, tuple[float, float]] | None:
    """Run in each worker (``collective_rpc``): its ``OnlineAcceptance`` snapshot, or None
    when it keeps none."""
    tracker = getattr(worker_step_state(worker), "acceptance", None)
    return tracker.snapshot() if tracker is not None else None


def worker_step_costs(worker) -> MeasuredStepCosts | None:
    """Run in each worker (``collective_rpc``): the ``MeasuredStepCosts`` it timed at start, or
    None (V1, no graphs, or the timing failed)."""
    return getattr(worker_step_state(worker), "step_costs", None)
