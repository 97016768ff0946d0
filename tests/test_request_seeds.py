"""Each request's seed for its tree rows' keyed draws (``spec_decode/request_seeds.py``)."""

import torch


def test_request_seeds_are_explicit_or_drawn_alike_on_every_rank():
    """A seeded request keeps its seed; an unseeded one gets one from torch's default
    generator, so two ranks seeded alike (as vLLM seeds its workers) draw the same seeds."""
    from vllm_ddtree.spec_decode.request_seeds import RequestSeeds

    explicit = {"a": 5, "b": None, "c": None}
    drawn = []
    for _ in range(2):  # two ranks
        torch.manual_seed(0)
        table = RequestSeeds(keep=lambda req_id: True)
        first = table.seeds(["a", "b"], explicit.get, torch.device("cpu"))
        again = table.seeds(["c", "b", "a"], explicit.get, torch.device("cpu"))
        assert first.dtype == torch.long and int(first[0]) == 5
        assert int(again[1]) == int(first[1]) and int(again[2]) == 5  # kept per request
        drawn.append(again.tolist())
    assert drawn[0] == drawn[1]
    assert drawn[0][0] != drawn[0][1]


def test_request_seeds_take_every_seed_vllm_accepts():
    """Seeds up to 2**64 - 1 (the offline API accepts them) become the int64 of their 64 bits:
    distinct seeds stay distinct, and a seed below 2**63 is itself."""
    from vllm_ddtree.spec_decode.request_seeds import RequestSeeds

    explicit = {"small": 2**63 - 1, "high": 2**63 + 5, "top": 2**64 - 1, "zero": 0}
    table = RequestSeeds(keep=lambda req_id: True)
    seeds = table.seeds(list(explicit), explicit.get, torch.device("cpu"))
    assert seeds.tolist() == [2**63 - 1, 5 - 2**63, -1, 0]
