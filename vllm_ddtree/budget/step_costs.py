"""Step costs of this engine, measured at start-up: what a verify batch and a drafter pass cost
the device on this target and this GPU.

A cost profile (``cost_model.py``) was measured on one pair (SmolLM2-135M, whose step waits on
the host) and cannot say what a verify of 65 or 129 nodes costs an 8B target. An online
``"auto"`` engine on vLLM's V2 runner therefore times a few replays of each FULL CUDA graph
vLLM captures: every verify graph (one per uniform width ``1 + budget`` and padded batch
size, the widths its per-batch-size schedule may serve) and every drafter graph (one per
padded batch size). Each is timed as vLLM stores it, right after its capture
(``TimedGraphs``): its replays read the inputs prepared for that capture, whose slot mappings
all point nowhere (vLLM's ``PAD_SLOT_ID``), so they write no KV cache. A graph's cost is its
fastest replay, and no graph is costed above a larger one (``measured_step_costs``): timings
taken while other processes use the device only overstate.

``TreeStepCost`` is the step cost ``budget/online.py`` then judges budgets by: the profile's
step cost for the host's work (on the profiled 135M pair the device is a small part of a
step), plus the device time measured here for the verify width and the drafter pass at that
batch size (an upper bound: vLLM's asynchronous scheduling overlaps part of the two). Where a
width was not measured it is the profile's alone.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from vllm_ddtree.budget.cost_model import StepCost

REPLAYS = 3  # timed replays per graph, after one untimed


@dataclass(frozen=True)
class MeasuredStepCosts:
    """Device milliseconds of this engine's captured graphs.

    Attributes:
        verify_ms: ``{tokens per request: {padded batch size: ms}}`` of the target's uniform
            verify graphs (``1 + budget`` tokens per request).
        draft_ms: ``{padded batch size: ms}`` of the drafter's graphs (its pass and, for
            DDTree, the tree build).
    """

    verify_ms: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    draft_ms: Mapping[int, float] = field(default_factory=dict)

    def device_ms(self, batch: int, tree_budget: int) -> float | None:
        """The device time of a step of ``batch`` trees of ``tree_budget`` nodes: the verify
        graph and the drafter graph vLLM pads that batch to (the smallest measured batch at
        least as large), or None when the verify width was not measured."""
        verify = _padded(self.verify_ms.get(1 + tree_budget, {}), batch)
        if verify is None:
            return None
        return verify + (_padded(self.draft_ms, batch) or 0.0)

    def describe(self) -> str:
        """Every measured graph, by width: ``b64: 1 req 3.90 ms, 2 req 4.40 ms, ...; drafter:
        1 req 1.38 ms, ...``."""
        lines = [
            f"b{width - 1}: "
            + ", ".join(f"{n} req {ms:.2f} ms" for n, ms in sorted(by_batch.items()))
            for width, by_batch in sorted(self.verify_ms.items())
        ]
        if self.draft_ms:
            lines.append(
                "drafter: "
                + ", ".join(f"{n} req {ms:.2f} ms" for n, ms in sorted(self.draft_ms.items()))
            )
        return "; ".join(lines)


def _padded(by_batch: Mapping[int, float], batch: int) -> float | None:
    """``by_batch`` at the smallest measured batch size of at least ``batch``."""
    sizes = [n for n in by_batch if n >= batch]
    return by_batch[min(sizes)] if sizes else None


@dataclass(frozen=True)
class TreeStepCost:
    """A DDTree step's cost on this engine (``cost_model.StepCost``'s interface): the
    profile's ``host`` cost plus the ``measured`` device time where the width was measured."""

    host: StepCost
    measured: MeasuredStepCosts

    def step_ms(self, tokens: int, batch: int = 1, nodes: int = 0) -> float:
        host = self.host.step_ms(tokens, batch, nodes)
        device = self.measured.device_ms(batch, nodes)
        return host if device is None else host + device


def time_replays(
    graph,
    synchronize: Callable[[], None],
    replays: int = REPLAYS,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Milliseconds of one replay of ``graph`` (an object with ``replay()``): one untimed
    replay, then ``replays`` timed one by one (``synchronize``, the device's, after each), the
    fastest. Work of another process on the device (engines starting side by side) only adds
    to a replay's time, so the fastest is the closest to the graph's own cost."""
    graph.replay()
    synchronize()
    fastest = float("inf")
    for _ in range(replays):
        start = clock()
        graph.replay()
        synchronize()
        fastest = min(fastest, clock() - start)
    return 1e3 * fastest


class TimedGraphs(dict):
    """A vLLM graph manager's ``graphs`` (``{BatchExecutionDescriptor: CUDAGraph}``) that
    times each FULL graph as vLLM stores it: right after its capture, while the inputs in the
    runner's buffers are still the ones prepared for that very graph (replayed later, a graph
    would read whatever the last capture left: on the H200 an engine timing its graphs after
    the whole capture never finished starting)."""

    def __init__(self, synchronize, clock=time.perf_counter, replays: int = REPLAYS):
        super().__init__()
        self.synchronize, self.clock, self.replays = synchronize, clock, replays
        self.timed_ms: dict = {}
        self.failure: Exception | None = None  # the first timing that failed; none after it

    def __setitem__(self, desc, graph) -> None:
        super().__setitem__(desc, graph)
        full = getattr(getattr(desc, "cg_mode", None), "name", None) == "FULL"
        if not full or not desc.num_reqs or self.failure is not None:
            return
        try:
            self.timed_ms[desc] = time_replays(graph, self.synchronize, self.replays, self.clock)
        except Exception as error:  # the capture goes on; the profile's costs serve
            self.failure = error


def times_graphs_at_capture(parallel_config) -> bool:
    """Whether an engine times its graphs as vLLM captures them: only on one rank. With
    several (tensor or pipeline parallel) a replay inside vLLM's ``graph_capture()`` context
    runs before custom all-reduce registers the graph's buffers (which it does when the
    context closes), and a rank whose timing failed would stop timing while the others went on:
    every rank then judges budgets by the profile's step costs alike."""
    ranks = parallel_config.tensor_parallel_size * parallel_config.pipeline_parallel_size
    return ranks == 1


def time_graphs_as_captured(runner, synchronize, clock=time.perf_counter) -> list[TimedGraphs]:
    """Before vLLM's V2 ``runner`` captures: its graph managers (the target's and its
    speculator's drafter's) time each graph as they store it; returns their ``TimedGraphs``."""
    managers = [
        runner.cudagraph_manager,
        getattr(getattr(runner, "speculator", None), "query_cudagraph_manager", None),
    ]
    timers = []
    for manager in managers:
        timer = TimedGraphs(synchronize, clock)
        if manager is not None:
            timer.update(manager.graphs)
            manager.graphs = timer
        timers.append(timer)
    return timers


def measured_step_costs(verify: TimedGraphs, draft: TimedGraphs) -> MeasuredStepCosts:
    """The table of what ``time_graphs_as_captured``'s timers timed: uniform verify graphs by
    width and batch, drafter graphs by batch, each made no larger than what a larger graph
    timed (``_at_most_what_larger_graphs_timed``)."""
    verify_ms: dict[int, dict[int, float]] = {}
    for desc, ms in verify.timed_ms.items():
        if desc.uniform_token_count:
            verify_ms.setdefault(desc.uniform_token_count, {})[desc.num_reqs] = ms
    draft_ms: dict[int, float] = {}
    for desc, ms in draft.timed_ms.items():
        draft_ms[desc.num_reqs] = min(ms, draft_ms.get(desc.num_reqs, ms))
    return MeasuredStepCosts(
        verify_ms=_at_most_what_larger_graphs_timed(verify_ms),
        draft_ms=_at_most_what_larger_graphs_timed({0: draft_ms})[0],
    )


def _at_most_what_larger_graphs_timed(
    timed: Mapping[int, Mapping[int, float]],
) -> dict[int, dict[int, float]]:
    """``{width: {batch: ms}}`` with each entry the smallest timing of the graphs at least as
    wide and of at least as many requests. A timing can only overstate a graph's cost (another
    process's work on the device adds to it; on the H200, engines starting side by side timed
    budget 16 at 10.58 ms for one request and 5.48 for three), and a wider graph or one of more
    requests costs no less, so a larger graph's timing bounds a smaller one's cost."""
    table: dict[int, dict[int, float]] = {}
    wider: dict[int, float] = {}  # by batch: the smallest timing of the widths done so far
    for width in sorted(timed, reverse=True):
        bound = float("inf")
        row: dict[int, float] = {}
        for batch in sorted(set(timed[width]) | set(wider), reverse=True):
            bound = min(bound, timed[width].get(batch, bound), wider.get(batch, bound))
            wider[batch] = bound
            if batch in timed[width]:
                row[batch] = bound
        table[width] = dict(sorted(row.items()))
    return dict(sorted(table.items()))


def batch_bucket(batch: int) -> int:
    """The power of two at or above ``batch`` (1, 2, 4, 8, ...): realised step times are kept
    per bucket, as a prediction's error depends on the batch (the host's share of a step
    shrinks as the batch grows) as well as on the budget."""
    return 1 << max(0, batch - 1).bit_length()


def describe_bucket(bucket: int) -> str:
    """``"1"``, ``"2"``, ``"3-4"``, ``"5-8"``, ...: the batch sizes of a bucket."""
    first = bucket // 2 + 1
    return str(bucket) if first >= bucket else f"{first}-{bucket}"


@dataclass(frozen=True)
class RealisedRatios:
    """What an engine's served steps realised over their predicted time
    (``RealisedStepTimes.ratios``): ``by_pair`` by (tree budget, batch bucket) where enough
    steps stand behind it. ``default`` judges what nothing at its batch size tells."""

    by_pair: Mapping[tuple[int, int], float] = field(default_factory=dict)
    default: float = 1.0

    def ratio(self, budget: int, batch: int) -> float:
        """The ratio ``budget`` is judged by at ``batch`` requests: its own at this batch
        bucket; else 1 or the smallest of the other budgets' there if below (judged at its
        prediction, or as well as the best-behaved budget served at this batch size, so that
        it is tried); else ``default``. Ratios at other batch sizes do not stand in where this
        one has its own: one measured where the host's work fills the step says little of a
        step the device fills."""
        bucket = batch_bucket(batch)
        own = self.by_pair.get((budget, bucket))
        if own is not None:
            return own
        here = [ratio for (_, at), ratio in self.by_pair.items() if at == bucket]
        return min([1.0, *here]) if here else self.default

    def untimed(self, budget: int, batch: int) -> bool:
        """Whether steps at ``batch`` requests (its bucket) were timed for other budgets but
        not for ``budget``: where the engine serves, a budget whose step time is unknown."""
        bucket = batch_bucket(batch)
        if (budget, bucket) in self.by_pair:
            return False
        return any(at == bucket for _, at in self.by_pair)

    def describe(self) -> str:
        """``"16 at 9-16: 0.77, 64 at 1: 0.64"`` (budget at requests: ratio), or
        ``"none yet"``."""
        return (
            ", ".join(
                f"{budget} at {describe_bucket(bucket)}: {ratio:.2f}"
                for (budget, bucket), ratio in sorted(self.by_pair.items())
            )
            or "none yet"
        )


@dataclass(frozen=True)
class CorrectedStepCost:
    """A DDTree step cost (``cost_model.StepCost``'s interface) scaled by what this engine's
    steps realised over what ``inner`` predicted for them (``RealisedRatios``, by budget and
    batch size)."""

    inner: StepCost | TreeStepCost
    ratios: RealisedRatios

    def step_ms(self, tokens: int, batch: int = 1, nodes: int = 0) -> float:
        return self.inner.step_ms(tokens, batch, nodes) * self.ratios.ratio(nodes, batch)


# A realised step this many times its prediction or more (or less) counts as this: a pause of
# the host (a garbage collection, a log flush) is not the step's cost.
RATIO_CLIP = (0.1, 10.0)


class RealisedStepTimes:
    """The wall time between an engine core's steps, over the cost model's prediction for the
    step, by the tree budget served and the batch size (its bucket, ``batch_bucket``).

    A start-up measurement times each CUDA graph alone; a served step adds the host's work, the
    sampler, the tree walk and anything the measurement missed, and on the H200 a budget whose
    graphs timed 7% slower than the next smaller one's served steps more than twice as long
    (``benchmarks/results/2026-12-03_7d61089_scale-8b-auto-grid``). ``tick`` runs at every
    engine step with that step's requests and budget; the interval up to the next tick counts
    when the batch neither grew nor shrank, nothing waited (no prefill in it), the budget did
    not change and vLLM cut no tree of the step at ``max_model_len`` (a cut tree's verify leaves
    the FULL CUDA graph), and not in the ``settle_steps`` intervals after any such change: the
    first steps of a new shape pay one-time costs (Triton compiling a kernel for it) that are
    not what the budget costs. A kernel can compile at a later step too, so a pair's ratio is
    the median of its latest ``window`` counted intervals: a stall among them does not move it,
    a budget slow at every step still shows. A pair stands while its decayed
    step count is at least ``min_steps`` (a step's weight halves after ``half_life_steps`` more
    counted steps)."""

    def __init__(
        self,
        half_life_steps: float,
        min_steps: float,
        settle_steps: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        window: int = 16,
    ):
        self.min_steps, self.settle_steps, self.clock = min_steps, settle_steps, clock
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._latest: dict[tuple[int, int], deque[float]] = {}
        self._window = window
        self._steps: dict[tuple[int, int], float] = {}
        self._last: tuple[float, int, int, int, float | None, bool] | None = None
        self._steady_run = 0  # steady intervals in a row, up to this one

    def tick(
        self,
        batch: int,
        waiting: int,
        tree_budget: int,
        predicted_ms: float | None,
        cut: bool = False,
    ):
        """One engine step of ``batch`` running requests (``waiting`` more queued) served
        ``tree_budget`` nodes a tree, predicted to take ``predicted_ms`` (None: unknown);
        ``cut``: vLLM cuts a tree of the step at ``max_model_len`` (the step leaves the FULL
        CUDA graph: not what the budget costs, not counted)."""
        now = self.clock()
        last, self._last = self._last, (now, batch, waiting, tree_budget, predicted_ms, cut)
        if last is None:
            return
        then, last_batch, last_waiting, last_budget, last_predicted, last_cut = last
        steady = (
            batch == last_batch > 0
            and waiting == last_waiting == 0
            and tree_budget == last_budget
            and not last_cut
        )
        self._steady_run = self._steady_run + 1 if steady else 0
        if self._steady_run <= self.settle_steps or not last_predicted:
            return
        ratio = min(max(1e3 * (now - then) / last_predicted, RATIO_CLIP[0]), RATIO_CLIP[1])
        for key in self._steps:
            self._steps[key] *= self._decay
        key = (last_budget, batch_bucket(last_batch))
        self._latest.setdefault(key, deque(maxlen=self._window)).append(ratio)
        self._steps[key] = self._steps.get(key, 0.0) + 1.0

    def ratios(self) -> RealisedRatios:
        """The ratios of the (budget, batch bucket) pairs with at least ``min_steps`` decayed
        steps behind them. Their ``default`` is 1, or the smallest of them if below: a pair
        at a batch size nothing was served at is judged at its prediction (or as well as the
        best-behaved served one), so that it is tried, while a served one that ran slower than
        predicted is judged by what it realised (``RealisedRatios.ratio``)."""
        by_pair = {
            key: statistics.median(self._latest[key])
            for key, steps in self._steps.items()
            if steps >= self.min_steps
        }
        return RealisedRatios(by_pair, min([1.0, *by_pair.values()]))
