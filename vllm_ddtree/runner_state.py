"""What the V1 runner hooks keep on a model runner between their calls: one object, one handle.

vLLM's ``GPUModelRunner`` calls the hooks (``runner_hooks.py``) in order within a step
(``_prepare_inputs`` -> ``_determine_batch_execution_and_padding`` -> ``_sample`` ->
``propose_draft_token_ids``); what one hook leaves for the next, and what the hooks keep across
steps, lives in a ``RunnerState`` at ``runner._ddtree`` (``runner_state(runner)``), the only
attribute the plugin adds to vLLM's runner. A runner that serves neither DDTree nor the chain
``"tree_budget": "auto"`` chose never gets one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HANDLE = "_ddtree"


@dataclass
class RunnerState:
    """Per runner: this step's hand-overs, then what lasts across steps."""

    # This step (reset by _prepare_inputs).
    step: Any = None  # runner_hooks.StepTrees: the trees verified this step
    logits_indices: Any = None  # long [rows]: the sampled rows (keys of their noise)
    rows_without_drafts: bool = False  # read once by the CUDA-graph dispatch
    # Across steps.
    upload: Any = None  # runner_hooks.StepTableUpload: pinned step tables
    seeds: Any = None  # request_seeds.RequestSeeds: each request's sampling seed
    tree_layers: tuple | None = None  # (forward context, its size, the TREE_ATTN layers)
    kv_layers: tuple | None = None  # (quick key, the TREE_ATTN caches as launch tables)


def runner_state(runner) -> RunnerState:
    """The runner's ``RunnerState`` (created on first use)."""
    state = getattr(runner, HANDLE, None)
    if state is None:
        state = RunnerState()
        setattr(runner, HANDLE, state)
    return state
