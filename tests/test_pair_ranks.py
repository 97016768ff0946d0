"""pair-ranks' bookkeeping: ranks from recorded drafter logits, and the rank model they fit."""

from __future__ import annotations

import pytest
import torch

from benchmarks.pair_ranks import first_after_first, fit_rank_model, rank_rows
from vllm_ddtree.testing.synthetic_acceptance import RankModel, sample_ranks


def test_the_targets_token_is_ranked_in_each_rounds_logits_by_position():
    sequence = [5, 6, 7, 8, 9]
    logits = torch.zeros(3, 10)
    logits[0, 7] = 2.0  # predicts position 2: the truth (7) first
    logits[1, 1], logits[1, 8] = 3.0, 1.0  # position 3: the truth (8) second
    logits[2, 9] = -1.0  # position 4: the truth (9) last
    rows = rank_rows([(1, logits)], sequence)
    assert [(r["depth"], r["rank"]) for r in rows] == [(1, 0), (2, 1), (3, 9)]
    assert rows[1]["gap"] == pytest.approx(2.0)
    assert len(rank_rows([(3, logits)], sequence)) == 1  # the sequence ends


def test_the_fit_recovers_the_model_that_drew_the_ranks():
    """Ranks drawn from a known model (independent per depth, as the model draws them) give
    back its ``p_top`` and ``decay`` through the after-first shares, and its tail."""
    truth = RankModel(p_top=0.8, decay=0.9, tail=0.6, slope=3.0, miss_slope=1.0)
    gen = torch.Generator().manual_seed(0)
    ranks = sample_ranks(truth, 20000, 15, gen)
    rows = [
        {"round": i, "depth": d + 1, "rank": int(ranks[i, d]), "gap": 1.0}
        for i in range(ranks.shape[0])
        for d in range(15)
    ]
    shares, counts = first_after_first(rows, 15)
    assert counts[0] == 20000 and counts[1] == pytest.approx(16000, rel=0.03)
    model, _, _ = fit_rank_model(rows, 15)
    assert model.p_top == pytest.approx(0.8, abs=0.02)
    assert model.decay == pytest.approx(0.9, abs=0.02)
    assert model.tail == pytest.approx(0.6, abs=0.03)
