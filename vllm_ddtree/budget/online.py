"""``"tree_budget": "auto"`` that follows the acceptance this engine reaches.

``budget.choice.choose`` picks the start from a cost profile measured on another pair. Once
trees run, every verified tree tells what each smaller budget would have accepted
(``acceptance.py``, kept by each worker). Every ``REFRESH_STEPS`` engine steps the engine core
reads the first worker's estimates and sets vLLM's per-batch-size budget lookup (the scheduler's
``dynamic_sd_lookup``) to the budget predicted fastest at each batch size
(``cost_model.choose_live_schedule``), from the live acceptance where enough trees stand behind
it, and this engine's step costs: on V2 its CUDA graphs timed at start (``step_costs.py``) plus
the profile's host cost, scaled by what served steps realised (``step_costs.RealisedStepTimes``).
A batch size keeps its budget while that is predicted within ``cost_model.HOLD_MARGIN`` of the
fastest. A budget above the one served is learned only by serving it: every
``EXPLORE_EVERY``-th refresh serves it where predicted close, and the next refresh comes as soon
as its estimates can stand (``OnlineBudget.exploration_steps``).

Near ``max_model_len`` the scheduler cuts a request's tree, which leaves the FULL CUDA graph:
while a running request is that close, an engine with graphs drafts with the largest candidate
whose tree fits (``OnlineBudget.fit_trees``), and such steps are not timed.

Engines whose ``DDTreeConfig.online_budgets`` lists several budgets move: on V2 those of the
per-batch-size schedule (each verify width a FULL graph), on V1 the candidates up to the start
choice when its verify batches run without CUDA graphs. Every move is logged; the predicted
tokens per verify step go to vLLM's spec-decode log line and /metrics (``metrics.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm_ddtree.budget.acceptance import moves_online
from vllm_ddtree.budget.metrics import set_predictions
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.handles import hold
from vllm_ddtree.scheduler_state import SchedulerState

if TYPE_CHECKING:
    from vllm_ddtree.budget.step_costs import MeasuredStepCosts

logger = logging.getLogger("vllm.ddtree")

REFRESH_STEPS = 32  # engine steps between reads of the workers' acceptance
MIN_TREES = 16.0  # decayed trees behind a live estimate before it replaces the profile's
EXPLORE_EVERY = 8  # every 8th refresh tries the next larger budget without an estimate
# Realised step times (step_costs.RealisedStepTimes): an engine's costs drift less than its
# workload, so a step's weight halves only after this many more steps, and a budget's ratio
# stands once this many decayed steps are behind it.
REALISED_HALF_LIFE_STEPS = 2048.0
MIN_REALISED_STEPS = 8.0
SETTLE_STEPS = 2  # intervals not counted after the batch or the budget changed
# Steps a worker's acceptance snapshot may trail the engine core (its host copies finish
# behind the device's queue).
SNAPSHOT_LAG_STEPS = 2


@dataclass(frozen=True)
class WorkerReaders:
    """What the engine core reads from its first worker (each function runs there, through
    ``collective_rpc``): ``acceptance``, the worker's ``OnlineAcceptance`` snapshot (None
    when it keeps none); ``step_costs``, the ``MeasuredStepCosts`` it timed at start (None:
    V1, no graphs, or the timing failed). The step hands them in
    (``spec_decode/engine_step.py``): this package never reads the step's state itself."""

    acceptance: Callable[[Any], dict[int, tuple[float, float]] | None]
    step_costs: Callable[[Any], MeasuredStepCosts | None]


def max_verify_tokens(vllm_config) -> int:
    """The widest verify batch a budget may be given: the step's token budget, and with CUDA
    graphs the largest graph (a wider batch would run without a FULL one)."""
    from vllm.config import CUDAGraphMode

    limit = vllm_config.scheduler_config.max_num_batched_tokens
    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode != CUDAGraphMode.NONE:
        limit = min(limit, compilation.max_cudagraph_capture_size)
    return limit


def tree_room(scheduler, request) -> int:
    """Tokens past ``request``'s scheduled ones that vLLM's scheduler still gives it before
    ``max_model_len`` (its rule: a running request is scheduled at most ``max_model_len``
    less its computed tokens less the tokens a step samples; with async scheduling the
    tokens in flight count as computed); below 0: its next tree is cut."""
    tokens = request.num_tokens_with_spec + request.num_output_placeholders
    return scheduler.max_model_len - scheduler.num_sampled_tokens_per_step - tokens


def tightest_room(scheduler) -> int | None:
    """The least ``tree_room`` of the scheduler's running requests (below 0: vLLM cuts a
    tree of the next step), or None when none runs."""
    return min((tree_room(scheduler, request) for request in scheduler.running), default=None)


def fit_budget(budget: int, room: int, candidates) -> int:
    """The budget to draft with where the tightest running request has ``room`` tokens
    (``tree_room``): ``budget`` when its verify (``1 + budget`` tokens, at the next step)
    fits, else the largest smaller candidate that fits, else the smallest candidate (a cut
    tree either way, the narrower the cheaper)."""
    if budget <= 0 or 1 + budget <= room:
        return budget
    fitting = [c for c in candidates if c < budget and 1 + c <= room]
    return max(fitting) if fitting else min(budget, *candidates)


class OnlineBudget:
    """One engine core's online budget: reads the workers' acceptance, sets the scheduler's
    per-batch-size budgets."""

    def __init__(self, engine_core, ddtree, profile, readers: WorkerReaders, measured=None):
        self.engine_core = engine_core
        self.readers = readers
        self.candidates = list(ddtree.online_budgets)
        # The profile's step costs for the host, plus what this engine's device measured at
        # start (step_costs.py) where it did.
        self.profile = profile
        if measured is not None:
            from vllm_ddtree.budget.step_costs import TreeStepCost

            self.profile = replace(profile, tree=TreeStepCost(profile.tree, measured))
        config = engine_core.vllm_config
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_verify_tokens = max_verify_tokens(config)
        self.steps = 0
        self.refreshes = 0
        self.next_refresh = REFRESH_STEPS  # the engine step of the next refresh
        self.schedule: list[tuple[int, int, int]] | None = None
        from vllm_ddtree.budget.step_costs import RealisedStepTimes

        self.realised = RealisedStepTimes(
            REALISED_HALF_LIFE_STEPS, MIN_REALISED_STEPS, settle_steps=SETTLE_STEPS
        )
        self._predicted: dict[tuple[int, int], float] = {}
        # The per-batch-size budgets served (vLLM's lookup list; from the config until the
        # first refresh), and whether verifies replay CUDA graphs (trees kept from a cut).
        self.lookup: list[int] | None = None
        from vllm.config import CUDAGraphMode

        self.fits_trees = config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE

    def before_step(self) -> None:
        room = tightest_room(self.engine_core.scheduler)
        self.fit_trees(room)
        self._time_step(cut=room is not None and room < 0)
        self.steps += 1
        if self.steps >= self.next_refresh:
            self.refresh()
            self.fit_trees(room)

    def fit_trees(self, room: int | None) -> None:
        """Give the scheduler the served budgets, each lowered where needed so that the
        next tree of every running request fits before ``max_model_len`` (``fit_budget``;
        ``room``: ``tightest_room``): vLLM would cut it, and a cut tree's verify leaves the
        FULL CUDA graph, while a smaller candidate budget has its graphs. Engines without
        CUDA graphs keep them."""
        scheduler = self.engine_core.scheduler
        if self.lookup is None:
            self.lookup = scheduler.dynamic_sd_lookup
        if self.lookup is None:
            return
        fitted = self.lookup
        # (The widest budget is the largest candidate, or below it.)
        if self.fits_trees and room is not None and room < 1 + max(self.candidates):
            fitted = [fit_budget(budget, room, self.candidates) for budget in self.lookup]
        if scheduler.dynamic_sd_lookup != fitted:
            scheduler.dynamic_sd_lookup = fitted

    def exploration_steps(self) -> int:
        """Steps an explored budget is served before the next refresh judges it: until its
        acceptance (``MIN_TREES`` trees at the running batch size) and its realised step
        ratio (``SETTLE_STEPS`` + ``MIN_REALISED_STEPS`` steps) can stand, plus the
        snapshot's lag; at most ``REFRESH_STEPS``. A slower budget costs only these steps."""
        running = max(1, len(self.engine_core.scheduler.running))
        trees = -(-int(MIN_TREES) // running)
        steps = max(trees, SETTLE_STEPS + int(MIN_REALISED_STEPS)) + SNAPSHOT_LAG_STEPS
        return min(steps, REFRESH_STEPS)

    def _time_step(self, cut: bool) -> None:
        """Tell ``realised`` this step's running requests, queued ones and budget, with the
        step time the (uncorrected) cost model predicts for them; ``cut``: vLLM cuts a tree
        of the step at ``max_model_len``."""
        scheduler = self.engine_core.scheduler
        batch, waiting = len(scheduler.running), len(scheduler.waiting)
        lookup = scheduler.dynamic_sd_lookup
        budget = lookup[batch] if lookup is not None and 0 < batch < len(lookup) else None
        budget = budget or scheduler.num_spec_tokens
        self.realised.tick(batch, waiting, budget, self._predicted_ms(batch, budget), cut)

    def _predicted_ms(self, batch: int, budget: int) -> float | None:
        """The profile's step time for ``batch`` trees of ``budget`` nodes (fixed for the
        engine's life, so worked out once per pair, not on every step); None for no trees."""
        if not batch or not budget:
            return None
        key = (batch, budget)
        if key not in self._predicted:
            self._predicted[key] = self.profile.tree.step_ms(batch * (1 + budget), batch, budget)
        return self._predicted[key]

    def refresh(self) -> None:
        """Read the first worker's acceptance and set the scheduler's budgets from it."""
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        from vllm_ddtree.budget.cost_model import choose_live_schedule, format_schedule
        from vllm_ddtree.budget.step_costs import CorrectedStepCost

        self.next_refresh = self.steps + REFRESH_STEPS
        live = self.engine_core.model_executor.collective_rpc(self.readers.acceptance)[0]
        if not live:
            return
        self.refreshes += 1
        ratios = self.realised.ratios()
        judged = replace(self.profile, tree=CorrectedStepCost(self.profile.tree, ratios))

        def choose(explore: bool):
            return choose_live_schedule(
                judged,
                live,
                self.candidates,
                self.max_num_seqs,
                self.max_verify_tokens,
                MIN_TREES,
                explore=explore,
                served=self.schedule,
                untimed=ratios.untimed,
            )

        explore = self.refreshes % EXPLORE_EVERY == 0
        schedule, acceptance = choose(explore)
        if explore and schedule != choose(False)[0]:
            # An exploration: judged again as soon as its estimates can stand.
            self.next_refresh = self.steps + self.exploration_steps()
        scheduler = self.engine_core.scheduler
        set_predictions(scheduler, acceptance)  # for the log line and /metrics
        if schedule == self.schedule:
            return
        self.lookup = build_dynamic_sd_schedule_lookup(
            [list(entry) for entry in schedule],
            vllm_max_batch_size=self.max_num_seqs,
            vllm_num_speculative_tokens=scheduler.num_spec_tokens,
        )
        scheduler.dynamic_sd_lookup = self.lookup
        self.schedule = schedule
        logger.info(
            "vllm-ddtree: tree_budget 'auto' now serves (requests: budget) %s; tokens per "
            "verify step by budget: %s; step time realised / predicted (budget at requests): "
            "%s",
            format_schedule(schedule),
            ", ".join(f"{b}: {a:.2f}" for b, a in sorted(acceptance.items())),
            ratios.describe(),
        )


def online_budget(engine_core, readers: WorkerReaders) -> OnlineBudget | None:
    """The engine core's ``OnlineBudget`` (made on its first step, reading its workers with
    ``readers``), or None when its budget is fixed."""
    state = hold(engine_core.scheduler, SchedulerState)
    if state.online_budget_decided:
        return state.online_budget
    made = None
    config = engine_core.vllm_config
    if moves_online(config):
        from vllm_ddtree.budget.cost_model import load_profile

        ddtree = get_ddtree_config(config.speculative_config)
        profile = load_profile(ddtree.cost_profile, runner=ddtree.runner.upper())
        measured = engine_core.model_executor.collective_rpc(readers.step_costs)[0]
        made = OnlineBudget(engine_core, ddtree, profile, readers, measured)
        logger.info(
            "vllm-ddtree: tree_budget 'auto' moves between budgets %s as it learns this "
            "engine's acceptance, judging step costs by %s",
            made.candidates,
            "the profile's host costs and this engine's device times measured at start"
            if measured is not None
            else "its cost profile",
        )
    state.online_budget, state.online_budget_decided = made, True
    return made
