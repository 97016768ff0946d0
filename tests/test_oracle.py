"""The test-only controllable drafter (oracle.py): the host (reference) and device forms agree."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_ddtree.testing.oracle import (
    DeviceOracle,
    HostOracle,
    OracleDraftSource,
    match_sequence,
)

VOCAB = 50


@pytest.fixture
def oracle_file(tmp_path):
    def write(p_top: float) -> str:
        path = tmp_path / f"oracle_{p_top}.json"
        sequences = [[1, 2, 3] + list(range(10, 30)), [4, 5] + list(range(30, 45))]
        path.write_text(json.dumps({"p_top": p_top, "seed": 0, "sequences": sequences}))
        return str(path)

    return write


def test_match_sequence():
    sequences = [[1, 2, 3, 4], [1, 2, 9]]
    assert match_sequence(sequences, [1, 2, 9]) == 1
    assert match_sequence(sequences, [1, 2]) == 0
    assert match_sequence(sequences, [7]) == -1


@pytest.mark.parametrize("p_top", [1.0, 0.0])
def test_device_oracle_ranks_the_future_like_the_host_oracle(oracle_file, p_top):
    path = oracle_file(p_top)
    depth, bonus_positions = 4, [5, 3]
    prompts = [[1, 2, 3], [4, 5]]
    host = HostOracle(path, VOCAB).logits(prompts, bonus_positions, depth)  # [2, depth, V]

    device = DeviceOracle(path, VOCAB, max_num_reqs=4, device=torch.device("cpu"))
    # Request states 2 and 0 hold the two prompts (the batch's rows map to states).
    states = [2, 0]
    device.bind(states, ["a", "b"], lambda s: {2: prompts[0], 0: prompts[1]}[s])
    predicted = torch.tensor([p + 1 + d for p in bonus_positions for d in range(depth)])
    row_states = torch.tensor([s for s in states for _ in range(depth)])
    logits = device.logits(predicted, row_states).view(2, depth, VOCAB)

    for r in range(2):
        sequence = device.sequences[device.sequence_of_state[states[r]]]
        for d in range(depth):
            truth = sequence[bonus_positions[r] + 1 + d]
            for out in (host[r, d], logits[r, d]):
                ranked = out.argsort(descending=True)
                expected_rank = 0 if p_top == 1.0 else 1
                assert int(ranked[expected_rank]) == truth


def test_rows_past_the_sequence_padding_and_unmatched_requests_are_noise(oracle_file):
    device = DeviceOracle(oracle_file(1.0), VOCAB, max_num_reqs=3, device=torch.device("cpu"))
    device.bind([0, 1], ["a", "b"], lambda s: {0: [4, 5], 1: [9, 9]}[s])
    assert device.sequence_of_state.tolist() == [1, -1, -1]
    predicted = torch.tensor([2, 500, 2, 2])  # in range, past the end, unmatched, padding
    states = torch.tensor([0, 0, 1, -1])
    logits = device.logits(predicted, states)
    assert int(logits[0].argmax()) == 30
    margin = logits.max(dim=-1).values - logits.topk(2, dim=-1).values[:, 1]
    assert float(margin[0]) >= 7.9
    assert (margin[1:] < 7.9).all()  # plain noise: no token lifted 8 above the rest


def test_a_reused_request_state_is_bound_again(oracle_file):
    device = DeviceOracle(oracle_file(1.0), VOCAB, max_num_reqs=2, device=torch.device("cpu"))
    device.bind([0], ["a"], lambda s: [1, 2, 3])
    assert int(device.sequence_of_state[0]) == 0
    device.bind([0], ["a"], lambda s: pytest.fail("bound twice"))
    device.bind([0], ["b"], lambda s: [4, 5])
    assert int(device.sequence_of_state[0]) == 1


@pytest.mark.parametrize("p_top,expected_rank", [(1.0, 0), (1e-9, 1)])
def test_both_oracles_place_the_future_by_a_rank_model(tmp_path, p_top, expected_rank):
    """With ``rank_model`` the future token sits at the model's rank: first when P(first) is 1,
    second when it is ~0 and the tail is 0 (rank 1 + 0), in both forms."""
    sequences = [[1, 2, 3] + list(range(10, 30)), [4, 5] + list(range(30, 45))]
    model = {"p_top": p_top, "decay": 1.0, "tail": 0.0, "slope": 3.0, "miss_slope": 1.0}
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps({"seed": 0, "sequences": sequences, "rank_model": model}))
    depth, bonus_positions, prompts = 4, [5, 3], [[1, 2, 3], [4, 5]]
    vocab = 128  # at least the candidates a rank model ranks
    host, on_device = _both_oracles(path, vocab, depth, bonus_positions, prompts)
    for r, sequence in enumerate(sequences):
        for d in range(depth):
            truth = sequence[bonus_positions[r] + 1 + d]
            for out in (host[r, d], on_device[r, d]):
                assert int(out.argsort(descending=True)[expected_rank]) == truth


def test_each_sequence_follows_its_own_rank_model(tmp_path):
    """``rank_models`` + ``sequence_models``: in one batch, one request's future is ranked
    first (its model: P(first) 1) and the other's second (P(first) ~0, tail 0), in both
    forms; a sequence naming no model is refused."""
    sequences = [[1, 2, 3] + list(range(10, 30)), [4, 5] + list(range(30, 45))]
    sure = {"p_top": 1.0, "decay": 1.0, "tail": 0.0, "slope": 3.0, "miss_slope": 1.0}
    miss = dict(sure, p_top=1e-9)
    spec = {"seed": 0, "sequences": sequences, "rank_models": {"sure": sure, "miss": miss}}
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps(dict(spec, sequence_models=["sure", "miss"])))
    depth, bonus_positions, prompts = 4, [5, 3], [[1, 2, 3], [4, 5]]
    vocab = 128
    host, on_device = _both_oracles(path, vocab, depth, bonus_positions, prompts)
    for r, (sequence, expected_rank) in enumerate(zip(sequences, (0, 1), strict=True)):
        for d in range(depth):
            truth = sequence[bonus_positions[r] + 1 + d]
            for out in (host[r, d], on_device[r, d]):
                assert int(out.argsort(descending=True)[expected_rank]) == truth
    path.write_text(json.dumps(dict(spec, sequence_models=["sure", "other"])))
    with pytest.raises(ValueError, match="sequence_models"):
        HostOracle(str(path), vocab)


def _both_oracles(path, vocab: int, depth: int, bonus_positions, prompts) -> tuple:
    """The two forms' logits for two requests (``prompts``, bound to request states 2 and 0 on
    the device), each ``[2, depth, vocab]``."""
    host = HostOracle(str(path), vocab).logits(prompts, bonus_positions, depth)
    device = DeviceOracle(str(path), vocab, max_num_reqs=4, device=torch.device("cpu"))
    device.bind([2, 0], ["a", "b"], lambda s: {2: prompts[0], 0: prompts[1]}[s])
    predicted = torch.tensor([p + 1 + d for p in bonus_positions for d in range(depth)])
    row_states = torch.tensor([s for s in (2, 0) for _ in range(depth)])
    return host, device.logits(predicted, row_states, depth).view(2, depth, vocab)


def test_a_requests_ranked_drafts_are_the_same_in_any_batch_and_either_form(tmp_path):
    """With rank models a request's drafts are a function of its sequence and the indices they
    predict, as a real drafter's are of the context: the same alone or batched with another
    request, on a later step (the generators moved on), and in the host and device forms.
    Engines compared by turns then draft a request alike where they reach the same position."""
    sequences = [[1, 2, 3] + list(range(10, 60)), [4, 5] + list(range(60, 110))]
    model = {"p_top": 0.5, "decay": 0.95, "tail": 0.8, "slope": 3.0, "miss_slope": 1.0}
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps({"seed": 7, "sequences": sequences, "rank_model": model}))
    depth, bonus_positions, prompts = 15, [5, 3], [[1, 2, 3], [4, 5]]
    vocab = 512
    host, on_device = _both_oracles(path, vocab, depth, bonus_positions, prompts)
    torch.rand(1000)  # the global generator moves on
    device = DeviceOracle(str(path), vocab, max_num_reqs=4, device=torch.device("cpu"))
    device.bind([1], ["b"], lambda s: prompts[1])
    predicted = torch.tensor([bonus_positions[1] + 1 + d for d in range(depth)])
    alone = device.logits(predicted, torch.full((depth,), 1), depth)
    assert torch.equal(alone, on_device[1])
    assert torch.equal(device.logits(predicted, torch.full((depth,), 1), depth), alone)
    assert torch.equal(host, on_device)
    host_alone = HostOracle(str(path), vocab).logits(prompts[1:], bonus_positions[1:], depth)
    assert torch.equal(host_alone[0], host[1])


class _NoHostReads(torch.overrides.TorchFunctionMode):
    """Raises on any read of a tensor's values into Python (on a GPU: a wait for the device)."""

    READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            raise AssertionError(f"a host read of a tensor: {func.__name__}")
        return func(*args, **(kwargs or {}))


def test_the_v1_drafter_takes_the_oracles_drafts_without_reading_the_device(tmp_path):
    """The V1 drafter (hybrid targets) gets its batch rows' ranked drafts from the device
    form: no read of its positions or draws back to the host (one per step idled the GPU
    through the rest of the step's host work), each row bound to its request's sequence, and
    the drafts are the host form's for the same requests and positions."""
    from types import SimpleNamespace

    from vllm_ddtree.spec_decode.proposer import DDTreeProposer

    sequences = [[1, 2, 3] + list(range(10, 60)), [4, 5] + list(range(60, 110))]
    model = {"p_top": 0.5, "decay": 0.95, "tail": 0.8, "slope": 3.0, "miss_slope": 1.0}
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps({"seed": 7, "sequences": sequences, "rank_model": model}))
    depth, vocab = 15, 512
    prompts, bonus_positions = [[4, 5], [1, 2, 3]], [3, 5]
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["b", "a"]),
        requests={
            "b": SimpleNamespace(prompt_token_ids=prompts[0]),
            "a": SimpleNamespace(prompt_token_ids=prompts[1]),
        },
    )
    drafter = SimpleNamespace(runner=runner)
    source = OracleDraftSource(str(path), vocab, max_num_reqs=4, device=torch.device("cpu"))
    drafters_own = torch.zeros(2, depth, vocab)  # what the source replaces
    # The drafter's query rows: each request's bonus row, then its depth mask rows.
    queries = [p + j for p in bonus_positions for j in range(1 + depth)]
    drafter.positions = torch.tensor(queries)
    drafter._bonus_positions = lambda rows, d: DDTreeProposer._bonus_positions(drafter, rows, d)
    with _NoHostReads():
        drafts = source.v1_logits(drafter, drafters_own, 2, depth)
    expected = HostOracle(str(path), vocab).logits(prompts, bonus_positions, depth)
    assert torch.equal(drafts, expected)
    runner.input_batch.req_ids = ["a", "b"]  # the batch rows' requests swap
    drafter.positions = torch.tensor([p + j for p in bonus_positions[::-1] for j in range(16)])
    with _NoHostReads():
        drafts = source.v1_logits(drafter, drafters_own, 2, depth)
    assert torch.equal(drafts, expected.flip(0))
