"""The calibrated synthetic acceptance model (``vllm_ddtree/testing/synthetic_acceptance.py``):
the true token sits at its sampled rank in the synthetic logits, the simulated chain accepts
what the model's closed form says, and trees accept more as the budget grows."""

import torch

from vllm_ddtree.testing.synthetic_acceptance import (
    CANDIDATES,
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
