"""Step costs measured at start-up (vllm_ddtree/step_costs.py): graph replays timed, the table
they fill, and the step cost an online "auto" judges budgets by."""

from types import SimpleNamespace

import pytest

from vllm_ddtree.cost_model import StepCost
from vllm_ddtree.step_costs import MeasuredStepCosts, TreeStepCost, time_replays


class Clock:
    """A clock that only the fake graphs move."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeGraph:
    """A graph whose replay costs ``ms`` on ``clock``."""

    def __init__(self, clock: Clock, ms: float):
        self.clock, self.ms, self.replays = clock, ms, 0

    def replay(self):
        self.clock.now += self.ms / 1e3
        self.replays += 1


def test_replays_are_timed_after_one_untimed_and_synchronized():
    clock = Clock()
    graphs = {"a": FakeGraph(clock, 2.0), "b": FakeGraph(clock, 5.0)}
    syncs = []
    timed = time_replays(graphs, lambda: syncs.append(clock.now), replays=4, clock=clock)
    assert timed == pytest.approx({"a": 2.0, "b": 5.0})
    assert [g.replays for g in graphs.values()] == [5, 5]
    assert len(syncs) == 4  # before and after each graph's timed replays


def test_a_step_is_padded_to_the_graph_vllm_replays():
    measured = MeasuredStepCosts(
        verify_ms={65: {1: 4.0, 2: 4.2, 4: 5.0}, 129: {1: 6.0}}, draft_ms={1: 1.0, 4: 1.5}
    )
    assert measured.device_ms(1, 64) == pytest.approx(5.0)
    assert measured.device_ms(3, 64) == pytest.approx(6.5)  # the 4-request graphs
    assert measured.device_ms(1, 128) == pytest.approx(7.0)
    assert measured.device_ms(2, 128) is None  # no graph that large: not measured
    assert measured.device_ms(1, 32) is None
    assert "b64: 1 req 4.00 ms" in measured.describe()
    assert "drafter: 1 req 1.00 ms" in measured.describe()


def test_the_tree_step_is_the_profiles_host_cost_plus_the_measured_device_time():
    host = StepCost(base_ms=2.0, per_token_ms=0.01)
    cost = TreeStepCost(host, MeasuredStepCosts(verify_ms={65: {1: 4.0}}, draft_ms={1: 1.0}))
    assert cost.step_ms(65, 1, 64) == pytest.approx(2.65 + 5.0)
    assert cost.step_ms(33, 1, 32) == pytest.approx(2.33)  # unmeasured: the profile's alone


def test_the_v2_runners_full_graphs_fill_the_table():
    """vLLM's own descriptors: uniform FULL verify graphs by width and padded batch, the
    speculator's drafter graphs by batch; PIECEWISE graphs are not timed."""
    pytest.importorskip("vllm")
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    from vllm_ddtree.step_costs import measure_v2_graphs

    clock = Clock()

    def desc(mode, tokens, reqs, uniform=None):
        return BatchExecutionDescriptor(mode, tokens, reqs, uniform)

    full, piecewise = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE
    verify = {
        desc(full, 17, 1, 17): FakeGraph(clock, 3.0),
        desc(full, 34, 2, 17): FakeGraph(clock, 3.5),
        desc(full, 65, 1, 65): FakeGraph(clock, 4.0),
        desc(piecewise, 64, None): FakeGraph(clock, 9.0),
    }
    draft = {
        desc(full, 16, 1, 16): FakeGraph(clock, 1.0),
        desc(full, 32, 2, 16): FakeGraph(clock, 1.2),
    }
    runner = SimpleNamespace(
        cudagraph_manager=SimpleNamespace(graphs=verify),
        speculator=SimpleNamespace(query_cudagraph_manager=SimpleNamespace(graphs=draft)),
    )
    measured = measure_v2_graphs(runner, lambda: None, clock=clock)
    assert measured.verify_ms[17] == pytest.approx({1: 3.0, 2: 3.5})
    assert measured.verify_ms[65] == pytest.approx({1: 4.0})
    assert sorted(measured.verify_ms) == [17, 65]
    assert measured.draft_ms == pytest.approx({1: 1.0, 2: 1.2})
    assert list(verify.values())[-1].replays == 0
