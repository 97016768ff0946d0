"""The calibrated synthetic acceptance model (``synthetic_acceptance``):
the true token sits at its sampled rank in the synthetic logits, the simulated chain accepts
what the model's closed form says, and trees accept more as the budget grows."""

import torch

from vllm_ddtree.testing.synthetic_acceptance import (
    CANDIDATES,
    DrawKeys,
    RankModel,
    sample_ranks,
    simulate,
    synthetic_logits,
)


def test_the_true_token_sits_at_its_rank_among_the_candidates():
    model = RankModel(p_top=0.6, decay=0.95, tail=0.7, slope=3.0, miss_slope=1.0)
    gen = torch.Generator().manual_seed(0)
    truth = torch.randint(0, 300, (50, 15), generator=gen)
    ranks = sample_ranks(model, 50, 15, gen)
    logits = synthetic_logits(model, truth, ranks, 300, gen)
    order = logits.argsort(dim=-1, descending=True)
    found = (order == truth.unsqueeze(-1)).long().argmax(dim=-1)
    assert torch.equal(found, ranks)
    assert bool((torch.isfinite(logits).sum(-1) == CANDIDATES).all())
    assert 0 < int((ranks == 0).sum()) < ranks.numel()  # both kinds of depth occur


def test_the_simulated_chain_accepts_what_the_closed_form_says():
    model = RankModel(p_top=0.9, decay=0.98)
    simulated = simulate(model, [], rounds=4000, seed=1)["chain"]
    assert abs(simulated - model.chain_acceptance()) < 0.2


def test_trees_accept_more_as_the_budget_grows():
    model = RankModel(p_top=0.85, decay=0.98, tail=0.8, slope=3.0, miss_slope=1.0)
    out = simulate(model, [16, 64, 256], rounds=300)
    assert out["b16"] <= out["b64"] <= out["b256"]
    assert out["b256"] > out["chain"]


def test_the_other_candidates_are_distinct_and_never_the_truth_even_at_the_vocabularys_end():
    """The candidates besides the truth are consecutive ids a random shift past it, wrapping
    at the vocabulary's end: a truth near the end, and a vocabulary just the candidates wide."""
    model = RankModel(p_top=0.5, tail=0.9)
    for vocab in (CANDIDATES, CANDIDATES + 1, 1000):
        gen = torch.Generator().manual_seed(vocab)
        truth = torch.full((20, 15), vocab - 1)
        truth[10:] = torch.randint(0, vocab, (10, 15), generator=gen)
        ranks = sample_ranks(model, 20, 15, gen)
        logits = synthetic_logits(model, truth, ranks, vocab, gen)
        finite = torch.isfinite(logits)
        assert bool((finite.sum(-1) == CANDIDATES).all())
        assert bool(finite.gather(2, truth.unsqueeze(-1)).all())


def test_keyed_draws_depend_only_on_the_sequence_the_position_and_the_depth():
    """With ``DrawKeys`` a row's ranks and candidates are a function of (seed, sequence,
    predicted index, depth): the same alone or in a batch, in any row order, whatever the
    generators drew before; another sequence, position or seed draws otherwise."""
    model = RankModel(p_top=0.5, decay=0.95, tail=0.8)
    sequence = torch.tensor([0, 1, 0, 2])
    position = torch.tensor([5, 5, 9, 40]).unsqueeze(1) + 1 + torch.arange(15)
    truth = torch.randint(0, 1000, (4, 15), generator=torch.Generator().manual_seed(0))

    def draw(rows, seed=0):
        keys = DrawKeys(sequence[rows], position[rows], seed)
        ranks = sample_ranks(model, len(rows), 15, keys=keys)
        return ranks, synthetic_logits(model, truth[rows], ranks, 1000, keys=keys)

    ranks, logits = draw([0, 1, 2, 3])
    torch.rand(100)  # the global generator moves on: keyed draws do not follow it
    for rows in ([3, 1], [2], [1, 0, 3, 2]):
        again_ranks, again_logits = draw(rows)
        assert torch.equal(again_ranks, ranks[rows])
        assert torch.equal(again_logits, logits[rows])
    # Rows 0 and 1 share a position, rows 0 and 2 a sequence; seed 1 draws anew.
    for a, b in ((0, 1), (0, 2)):
        assert not torch.equal(logits[a], logits[b])
    assert not torch.equal(draw([0, 1, 2, 3], seed=1)[1], logits)


def test_streams_drawn_at_once_are_each_streams_keyed_hash():
    """``DrawKeys.drawn`` gives every stream's draws as ``uniform`` does, each the 32-bit hash
    chain of (seed, stream, sequence, position, depth) as plain integers compute it, in a
    third of the device ops of drawing the streams one by one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_ddtree.testing import synthetic_acceptance as sa

    sequence = torch.tensor([0, 7, 3])
    position = torch.tensor([5, 9, 40]).unsqueeze(1) + torch.arange(15)
    keys = DrawKeys(sequence, position, seed=11)

    class CountOps(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountOps.ops += 1
            return func(*args, **(kwargs or {}))

    with CountOps():
        drawn = keys.drawn()
    together, CountOps.ops = CountOps.ops, 0
    with CountOps():
        alone = [keys.uniform(s) for s in (sa._FIRST, sa._BELOW, sa._OTHERS)]
    assert 3 * together <= CountOps.ops + 3, (together, CountOps.ops)
    mask = sa._MASK32
    for stream, draws in zip((sa._FIRST, sa._BELOW, sa._OTHERS), alone, strict=True):
        assert torch.equal(drawn.uniform(stream), draws)
        salt = sa._mix32((11 * 0x9E3779B9 + stream) & mask)
        for r, d in ((0, 0), (1, 7), (2, 14)):
            h = sa._mix32(int(sequence[r]) ^ salt)
            h = sa._mix32(sa._mix32(h ^ int(position[r, d])) ^ d)
            assert int(draws[r, d] * float(1 << 32)) == h


def test_keyed_draws_keep_the_rank_models_distribution():
    """Over many keys the keyed ranks follow the model as the generator's do: P(ranked first)
    per depth within 4 standard errors of ``p_top x decay^(d - 1)``, and the mean rank below
    the first within 5% of the geometric tail's."""
    model = RankModel(p_top=0.7, decay=0.95, tail=0.6)
    rows, depth = 20000, 15
    sequence = torch.arange(rows) % 97
    position = (torch.arange(rows) // 97).unsqueeze(1) + torch.arange(depth)
    ranks = sample_ranks(model, rows, depth, keys=DrawKeys(sequence, position, seed=3))
    expected = model.first_probability(depth)
    observed = (ranks == 0).double().mean(0)
    error = (expected * (1 - expected) / rows).sqrt()
    assert bool(((observed - expected).abs() < 4 * error).all()), (observed, expected)
    below = ranks[ranks > 0].double() - 1
    mean_below = model.tail / (1 - model.tail)  # a geometric's mean, P(G = g) ~ tail^g
    assert abs(float(below.mean()) / mean_below - 1) < 0.05
