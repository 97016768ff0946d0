"""The engine core's online "auto" (``budget/online.py``) against stand-ins for vLLM's
engine core, executor and worker: it reads the worker's acceptance every REFRESH_STEPS steps
and sets the scheduler's per-batch-size budgets with vLLM's own lookup builder."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode  # noqa: E402

from tests.profiles import write_cheap_tree_profile  # noqa: E402
from vllm_ddtree.budget import metrics as budget_metrics
from vllm_ddtree.budget import online as online_budget  # noqa: E402
from vllm_ddtree.budget.acceptance import make_tracker  # noqa: E402
from vllm_ddtree.config import DDTREE_ATTR, DDTreeConfig  # noqa: E402
from vllm_ddtree.handles import HANDLE  # noqa: E402
from vllm_ddtree.spec_decode.engine_step import READERS, before_engine_step  # noqa: E402
from vllm_ddtree.spec_decode.step_state import StepState  # noqa: E402


def engine_core(tmp_path, cudagraph_mode=CUDAGraphMode.NONE, budgets=(4, 8, 16, 32), runner="v1"):
    """An engine core of 4 requests whose worker learns online, and that worker's tracker."""
    path = write_cheap_tree_profile(tmp_path)
    ddtree = DDTreeConfig(32, 8, 15, runner=runner, online_budgets=budgets, cost_profile=path)
    speculative = SimpleNamespace()
    setattr(speculative, DDTREE_ATTR, ddtree)
    config = SimpleNamespace(
        speculative_config=speculative,
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=2048),
        compilation_config=SimpleNamespace(
            cudagraph_mode=cudagraph_mode, max_cudagraph_capture_size=64
        ),
    )
    tracker = make_tracker(config, torch.device("cpu"))
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(**{HANDLE: StepState(acceptance=tracker)})
    )
    executor = SimpleNamespace(collective_rpc=lambda fn: [fn(worker)])
    scheduler = SimpleNamespace(
        num_spec_tokens=32,
        dynamic_sd_lookup=None,
        running=[],
        waiting=[],
        max_model_len=1 << 20,
        num_sampled_tokens_per_step=1,
    )
    core = SimpleNamespace(vllm_config=config, model_executor=executor, scheduler=scheduler)
    return core, tracker


def running_request(tokens: int = 100) -> SimpleNamespace:
    """A request of vLLM's scheduler with ``tokens`` tokens and the next tree scheduled."""
    return SimpleNamespace(num_tokens_with_spec=tokens, num_output_placeholders=0)


def observe(tracker, num_accepted: int, steps: int = 20):
    """``steps`` steps of 4 requests with 32-node trees whose paths run down tree indices
    1, 3, 5, ... (``num_accepted`` deep)."""
    accepted = torch.full((4, 16), -1, dtype=torch.long)
    accepted[:, 0] = 0
    accepted[:, 1 : 1 + num_accepted] = torch.arange(num_accepted) * 2 + 1
    for _ in range(steps):
        tracker.observe(accepted, torch.full((4,), num_accepted), torch.full((4,), 32))


def test_the_budgets_follow_the_workers_acceptance_every_refresh(tmp_path, caplog):
    core, tracker = engine_core(tmp_path)

    def step(core):  # vLLM's step loop, starting with DDTree's call
        before_engine_step(core)
        return "stepped"

    observe(tracker, 0)
    for _ in range(online_budget.REFRESH_STEPS - 1):
        assert step(core) == "stepped"
    assert core.scheduler.dynamic_sd_lookup is None  # not refreshed yet
    with caplog.at_level("INFO", logger="vllm.ddtree"):
        step(core)
    # Nothing accepted: the smallest budget at every batch size (vLLM's lookup, index 0 unused).
    assert core.scheduler.dynamic_sd_lookup[1:] == [4, 4, 4, 4]
    assert "now serves (requests: budget) 1-4: 4" in caplog.text
    # Deep paths (12 accepted within 32 nodes, 8 within 16, 2 within 4): 32 pays.
    observe(tracker, 12, steps=200)
    for _ in range(online_budget.REFRESH_STEPS):
        step(core)
    assert core.scheduler.dynamic_sd_lookup[1] == 32
    # What it predicted per budget waits on the scheduler for the metrics (budget/metrics.py).
    predicted = budget_metrics.predictions(core.scheduler).by_budget
    assert sorted(predicted) == [4, 8, 16, 32]
    assert predicted[32] > predicted[16] > predicted[4] >= 1.0


def test_a_v2_engine_moves_within_its_largest_graph(tmp_path):
    """V2 graphs cover every budget of its schedule: its budgets move, no verify batch past the
    largest graph (64 tokens here: 4 requests of budget 32 would take 132)."""
    core, tracker = engine_core(
        tmp_path, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, runner="v2"
    )
    controller = online_budget.online_budget(core, READERS)
    assert controller is not None and controller.max_verify_tokens == 64
    observe(tracker, 12, steps=200)
    controller.refresh()
    lookup = core.scheduler.dynamic_sd_lookup
    assert all(b * (1 + lookup[b]) <= 64 for b in range(1, 5)), lookup
    assert lookup[1] == 32  # deep paths pay where the graph allows


def test_an_engine_with_cuda_graphs_or_one_budget_keeps_its_budget(tmp_path):
    """A V1 engine's graphs have one verify width; one budget has nothing to move to."""
    for core, tracker in (
        engine_core(tmp_path, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
        engine_core(tmp_path, budgets=(32,)),
    ):
        assert online_budget.online_budget(core, READERS) is None and tracker is None


def test_a_worker_without_a_tracker_leaves_the_budgets_alone(tmp_path):
    core, _ = engine_core(tmp_path)
    worker = SimpleNamespace(model_runner=SimpleNamespace(**{HANDLE: StepState()}))
    core.model_executor = SimpleNamespace(collective_rpc=lambda fn: [fn(worker)])
    online_budget.online_budget(core, READERS).refresh()
    assert core.scheduler.dynamic_sd_lookup is None


def test_device_times_measured_at_start_decide_where_the_profile_would_not(tmp_path, caplog):
    """Deep paths make budget 32 the profile's fastest; once the engine measured a verify of
    33 tokens at 10 ms on its device (17 tokens: 0.1 ms), 16 is."""
    from vllm_ddtree.budget.step_costs import MeasuredStepCosts

    chosen = {}
    for measured in (None, MeasuredStepCosts(verify_ms={33: {4: 10.0}, 17: {4: 0.1}})):
        core, tracker = engine_core(tmp_path, budgets=(16, 32), runner="v2")
        worker = core.model_executor.collective_rpc(lambda w: w)[0]
        getattr(worker.model_runner, HANDLE).step_costs = measured
        with caplog.at_level("INFO", logger="vllm.ddtree"):
            controller = online_budget.online_budget(core, READERS)
        observe(tracker, 12, steps=200)
        controller.refresh()
        chosen[measured is not None] = core.scheduler.dynamic_sd_lookup[1]
    assert chosen == {False: 32, True: 16}
    assert "device times measured at start" in caplog.text


def timed_server(tmp_path, num_accepted: int, realised: dict[int, float]):
    """A V2 engine core of 4 requests between budgets 16 and 32, refreshed once on paths
    ``num_accepted`` deep (budget 32 the profile's fastest), with a stand-in clock for its
    realised step times; and ``serve(steps)``: that many engine steps at 4 requests, each
    observing such paths and taking ``realised.get(budget, 1)`` times its predicted time at
    the budget served, returning the budget of each step."""
    core, tracker = engine_core(tmp_path, budgets=(16, 32), runner="v2")
    controller = online_budget.online_budget(core, READERS)
    observe(tracker, num_accepted, steps=200)
    controller.refresh()
    assert core.scheduler.dynamic_sd_lookup[1:] == [32] * 4
    now = [0.0]
    controller.realised.clock = lambda: now[0]
    core.scheduler.running = [running_request()] * 4

    def serve(steps: int) -> list[int]:
        served = []
        for _ in range(steps):
            observe(tracker, num_accepted, steps=1)
            budget = core.scheduler.dynamic_sd_lookup[4]
            served.append(budget)
            controller.before_step()
            predicted = controller.profile.tree.step_ms(4 * (1 + budget), 4, budget)
            now[0] += realised.get(budget, 1.0) * predicted / 1e3
        return served

    return core, controller, serve


def test_a_budget_whose_served_steps_ran_slower_than_predicted_is_left(tmp_path, caplog):
    """Deep paths make budget 32 the fastest by the profile; once its served steps took three
    times their predicted time (steady batches, nothing waiting), "auto" serves 16, whose
    steps take their predicted time, and it does not explore 32 again while that stands.
    Steps while a request waits are not counted."""
    core, controller, serve = timed_server(tmp_path, 12, {32: 3.0})
    core.scheduler.waiting = ["w"]  # a prefill in every interval: nothing counted
    assert set(serve(online_budget.REFRESH_STEPS)) == {32}
    assert controller.realised.ratios().by_pair == {}
    core.scheduler.waiting = []
    with caplog.at_level("INFO", logger="vllm.ddtree"):
        served = serve(online_budget.REFRESH_STEPS * (online_budget.EXPLORE_EVERY + 2))
    ratios = controller.realised.ratios().by_pair
    assert ratios[(32, 4)] == pytest.approx(3.0) and ratios[(16, 4)] == pytest.approx(1.0)
    assert served[: online_budget.REFRESH_STEPS - 1] == [32] * (online_budget.REFRESH_STEPS - 1)
    last = served[2 * online_budget.REFRESH_STEPS :]
    assert set(last) == {16}, "32 explored again, or never left"
    # Only 3-4 requests were served: 1-2 keep 32 until measured there.
    assert (
        "now serves (requests: budget) 1-2: 32, 3-4: 16; tokens per verify step by budget: "
        "16: 9.00, 32: 13.00; step time realised / predicted (budget at requests): 32 at 3-4: "
        "3.00" in caplog.text
    )


def test_a_smaller_budget_never_timed_where_the_engine_serves_is_explored_and_kept(tmp_path):
    """Budget 32 is the profile's fastest at 4 requests and budget 16 predicted within
    EXPLORE_MARGIN of it; 16's steps would take half their predicted time. Its acceptance is
    known from 32's trees, its time only by serving it: the EXPLORE_EVERY-th refresh serves
    16 at 3-4 requests (served with 32 there, never with 16), its steps are timed, and it
    stays. Failed before: 32 was served to the end (the 8B grid at ed73855 kept budget 16
    at 16 requests where budget 8 ran faster, budget 8 never served there)."""
    core, controller, serve = timed_server(tmp_path, 11, {16: 0.5})
    served = serve(online_budget.REFRESH_STEPS * (online_budget.EXPLORE_EVERY + 2))
    ratios = controller.realised.ratios().by_pair
    assert ratios[(32, 4)] == pytest.approx(1.0) and ratios[(16, 4)] == pytest.approx(0.5)
    # The first refresh ran before the loop: the EXPLORE_EVERY-th comes 7 refreshes into it.
    explored_from = online_budget.REFRESH_STEPS * (online_budget.EXPLORE_EVERY - 1)
    assert set(served[:explored_from]) == {32} and served[explored_from] == 16
    assert set(served[-online_budget.REFRESH_STEPS :]) == {16}
    assert core.scheduler.dynamic_sd_lookup[1:3] == [32, 32]  # 1-2 requests: never served


def test_an_exploration_is_judged_again_as_soon_as_its_estimates_can_stand(tmp_path, monkeypatch):
    """An exploring refresh (every EXPLORE_EVERY-th) that serves a larger budget is followed
    by the next refresh after ``exploration_steps`` (enough trees at the running batch size,
    a realised ratio, the snapshot's lag), not REFRESH_STEPS later; other refreshes keep the
    cadence."""
    from vllm_ddtree.budget import cost_model

    core, tracker = engine_core(tmp_path)
    observe(tracker, 2)

    def choose(*args, explore=False, **kwargs):
        budget = 8 if explore else 4
        return [(1, 4, budget)], {4: 2.0, 8: 2.0}

    monkeypatch.setattr(cost_model, "choose_live_schedule", choose)
    controller = online_budget.online_budget(core, READERS)
    core.scheduler.running = [running_request()] * 4  # 4 requests: 16 trees in 4 steps
    lengths = []
    last = 0
    while controller.refreshes < online_budget.EXPLORE_EVERY + 1:
        before = controller.refreshes
        controller.before_step()
        if controller.refreshes != before:
            lengths.append(controller.steps - last)
            last = controller.steps
    wait = online_budget.SETTLE_STEPS + int(online_budget.MIN_REALISED_STEPS)
    wait += online_budget.SNAPSHOT_LAG_STEPS
    assert controller.exploration_steps() == wait < online_budget.REFRESH_STEPS
    every = online_budget.REFRESH_STEPS
    # The EXPLORE_EVERY-th refresh explored (budget 8 at 1-4), the next came `wait` later.
    assert lengths == [every] * online_budget.EXPLORE_EVERY + [wait]
    assert core.scheduler.dynamic_sd_lookup[1:] == [4, 4, 4, 4]  # back after judging it
    core.scheduler.running = [running_request()]  # one request: 16 steps for 16 trees
    assert controller.exploration_steps() == 16 + online_budget.SNAPSHOT_LAG_STEPS


def test_steps_of_a_request_whose_tree_vllm_cuts_at_max_model_len_are_not_timed(tmp_path):
    """A request whose next tree would pass ``max_model_len`` has it cut by vLLM's scheduler
    (``num_tokens_with_spec + num_output_placeholders`` past ``max_model_len`` less the
    tokens a step samples); the step leaves the FULL CUDA graph. "auto" does not time such
    steps: on the 8B scale model at cedb958 it read budget 128 at one request at 5.08 times
    its prediction from them. Failed before: the cut steps' ratio (5) stood for budget 32."""
    slowdown = {32: 5.0}  # serve() reads it at every step
    core, controller, serve = timed_server(tmp_path, 12, slowdown)
    core.scheduler.max_model_len = 1000
    core.scheduler.num_sampled_tokens_per_step = 1
    # 970 tokens and a 32-node tree: 1002 past 1000 less the 1 a step samples. (The far
    # request's 532 are not.)
    near = SimpleNamespace(num_tokens_with_spec=970 + 32, num_output_placeholders=0)
    far = SimpleNamespace(num_tokens_with_spec=500 + 32, num_output_placeholders=0)
    core.scheduler.running = [far, far, far, near]
    assert set(serve(online_budget.REFRESH_STEPS - 1)) == {32}
    assert (32, 4) not in controller.realised.ratios().by_pair
    core.scheduler.running = [far] * 4  # the near request left; its successor is far
    slowdown[32] = 1.0
    assert set(serve(16)) == {32}
    assert controller.realised.ratios().by_pair[(32, 4)] == pytest.approx(1.0)


def test_the_cut_rule_is_the_one_vllms_scheduler_applies():
    """``tree_room`` mirrors vLLM's scheduler: a running request is given at most
    ``max_model_len - num_computed_tokens - num_sampled_tokens_per_step`` tokens, of the
    ``num_tokens_with_spec + num_output_placeholders - num_computed_tokens`` it has. A vLLM
    that changes the rule or the names fails here (and "auto" would time cut steps)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    source = " ".join(inspect.getsource(Scheduler.schedule).split())
    assert (
        "request.num_tokens_with_spec + request.num_output_placeholders - "
        "request.num_computed_tokens" in source
    )
    assert (
        "self.max_model_len - request.num_computed_tokens - self.num_sampled_tokens_per_step"
        in source
    )
    assert isinstance(Request.num_tokens_with_spec, property)
    scheduler = SimpleNamespace(max_model_len=100, num_sampled_tokens_per_step=1)
    request = SimpleNamespace(num_tokens_with_spec=90, num_output_placeholders=9)
    assert online_budget.tree_room(scheduler, request) == 0  # 99 tokens: room for them
    request.num_output_placeholders = 10
    assert online_budget.tree_room(scheduler, request) == -1  # cut
    scheduler.running = [request, running_request(50)]
    assert online_budget.tightest_room(scheduler) == -1


def test_a_budget_is_lowered_to_a_candidate_whose_tree_fits_before_max_model_len():
    """``fit_budget``: the served budget where its next verify fits the tightest request's
    room, else the largest smaller candidate that fits, else the smallest candidate."""
    candidates = [8, 16, 32, 64, 128]
    assert online_budget.fit_budget(64, 65, candidates) == 64
    assert online_budget.fit_budget(64, 64, candidates) == 32
    assert online_budget.fit_budget(128, 20, candidates) == 16
    assert online_budget.fit_budget(32, 5, candidates) == 8  # cut either way: the narrowest
    assert online_budget.fit_budget(8, 5, candidates) == 8
    assert online_budget.fit_budget(0, 5, candidates) == 0  # vLLM's entry for no requests


def test_auto_drafts_trees_that_fit_before_max_model_len_where_verifies_replay_graphs(tmp_path):
    """vLLM cuts a tree that would pass ``max_model_len``, and the cut verify runs outside the
    FULL CUDA graph (the 8B scale model at cedb958: "auto"'s one-request steps at budget 128
    near the bench's max_model_len ran eagerly). An engine with graphs drafts, while a running
    request is that close, with the largest candidate budget whose tree fits (each has its
    graphs), and serves its schedule again once no request is; one without graphs keeps its
    budgets (a cut costs it nothing)."""
    for mode, lowered in ((CUDAGraphMode.FULL_DECODE_ONLY, True), (CUDAGraphMode.NONE, False)):
        core, tracker = engine_core(tmp_path, cudagraph_mode=mode, runner="v2")
        controller = online_budget.online_budget(core, READERS)
        observe(tracker, 12, steps=200)
        controller.refresh()
        served = list(core.scheduler.dynamic_sd_lookup)
        assert 32 in served[1:]
        scheduler = core.scheduler
        scheduler.max_model_len, scheduler.num_sampled_tokens_per_step = 1000, 1
        # 950 tokens and a 32-node tree scheduled next: 999 - 982 = 17 tokens of room, so
        # the tree drafted now fits with 16 nodes, not 32.
        near = SimpleNamespace(num_tokens_with_spec=950 + 32, num_output_placeholders=0)
        far = SimpleNamespace(num_tokens_with_spec=100 + 32, num_output_placeholders=0)
        scheduler.running = [far, near]
        controller.before_step()
        expected = [min(budget, 16) for budget in served] if lowered else served
        assert scheduler.dynamic_sd_lookup == expected
        assert controller.lookup == served  # the schedule itself is kept
        scheduler.running = [far, far]
        controller.before_step()
        assert scheduler.dynamic_sd_lookup == served
