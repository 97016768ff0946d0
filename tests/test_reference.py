"""The reference DDTree engine reproduces the target alone (greedy exactly; sampling in law)."""

import math

import pytest
import torch

from tests.stats import chi_square_p_value
from vllm_ddtree.dflash_drafter import DFlashDrafter
from vllm_ddtree.reference import (
    DDTreeReference,
    DFlashDraftSource,
    autoregressive_generate,
)


class OracleDraftSource:
    """A drafter that knows the target's greedy continuation (from a prior target-only run).

    At depth ``d`` below position ``p`` the true token gets rank 0 with probability
    ``p_top`` and rank 1 otherwise (so acceptance needs the tree's sibling branches), on top of
    random logits. Past the known continuation it proposes noise.
    """

    def __init__(self, sequence: list[int], vocab: int, depth: int, p_top: float, seed: int = 0):
        self.sequence, self.vocab, self.depth, self.p_top = sequence, vocab, depth, p_top
        self.gen = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        pass

    def extend_context(self, token_ids, features, positions) -> None:
        pass

    def draft_logits(self, bonus_token: int, position: int) -> torch.Tensor:
        logits = torch.randn(self.depth, self.vocab, generator=self.gen)
        for d in range(self.depth):
            index = position + 1 + d
            if index >= len(self.sequence):
                break
            true_token = self.sequence[index]
            order = torch.argsort(logits[d], descending=True)
            top = float(logits[d, order[0]])
            if torch.rand(1, generator=self.gen).item() < self.p_top:
                logits[d, true_token] = top + 8.0
            else:
                rival = int(order[0]) if int(order[0]) != true_token else int(order[1])
                logits[d, rival] = top + 8.0
                logits[d, true_token] = top + 7.0
        return logits


PROMPTS = [[5, 17, 300, 42], [900, 1, 2, 3, 4, 5, 6, 7], [77]]


def test_greedy_matches_hf_generate_with_a_random_dflash_drafter(tiny_target, tiny_drafter_path):
    drafter = DFlashDrafter.from_pretrained(tiny_drafter_path)
    engine = DDTreeReference(tiny_target, DFlashDraftSource(drafter, tiny_target), tree_budget=16)
    for prompt in PROMPTS:
        out = engine.generate(prompt, max_new_tokens=24)
        hf = tiny_target.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
        )
        assert out.token_ids == hf[0, len(prompt) :].tolist()
        assert out.num_rounds >= 1


@pytest.mark.parametrize("budget", [1, 4, 32, 128])
@pytest.mark.parametrize("p_top", [1.0, 0.6])
def test_greedy_output_matches_target_alone_with_deep_acceptance(
    tiny_target, tiny_spec, budget, p_top
):
    for seed, prompt in enumerate(PROMPTS):
        expected = autoregressive_generate(tiny_target, prompt, max_new_tokens=80).token_ids
        sequence = list(prompt) + expected
        oracle = OracleDraftSource(sequence, tiny_spec.vocab_size, depth=15, p_top=p_top, seed=seed)
        engine = DDTreeReference(tiny_target, oracle, tree_budget=budget)
        out = engine.generate(prompt, max_new_tokens=80, trace=True)
        assert out.token_ids == expected
        if budget >= 32:
            # Rank-1 truths are only reachable through sibling branches.
            assert out.mean_acceptance_length > 3.0
        if p_top == 1.0 and budget >= 15:
            assert max(out.acceptance_lengths) == 16
        for trace in out.traces:
            assert trace.acceptance_length == len(trace.accepted_path)
            assert trace.tree["nodes"] <= budget


def test_trace_records_each_round(tiny_target, tiny_spec):
    prompt = PROMPTS[0]
    expected = autoregressive_generate(tiny_target, prompt, max_new_tokens=30).token_ids
    oracle = OracleDraftSource(list(prompt) + expected, tiny_spec.vocab_size, 15, p_top=0.7)
    out = DDTreeReference(tiny_target, oracle, tree_budget=24).generate(prompt, 30, trace=True)
    assert len(out.traces) == out.num_rounds
    emitted = [out.token_ids[0]] + [t for trace in out.traces for t in trace.emitted]
    assert emitted[:30] == out.token_ids
    first = out.traces[0]
    assert first.bonus_token == out.token_ids[0]
    for parent_index, (child_token, parent) in enumerate(
        zip(first.node_tokens, first.node_parents, strict=False)
    ):
        assert 0 <= parent <= parent_index and child_token >= 0
    assert set(out.stage_seconds) == {"draft", "tree_build", "verify", "commit"}


def test_eos_stops_generation(tiny_target, tiny_spec):
    prompt = PROMPTS[1]
    expected = autoregressive_generate(tiny_target, prompt, max_new_tokens=40).token_ids
    eos = expected[17]
    oracle = OracleDraftSource(list(prompt) + expected, tiny_spec.vocab_size, 15, p_top=1.0)
    out = DDTreeReference(tiny_target, oracle, tree_budget=16).generate(
        prompt, 40, eos_token_id=eos
    )
    assert out.token_ids == expected[: expected.index(eos) + 1]


def test_sampling_is_distributed_like_the_target_alone(tiny_target, tiny_spec):
    """At T = 1.5, the third generated token's histogram (over 400 seeds) from DDTree equals
    the target's own sampling histogram (chi-square homogeneity test, p > 0.001)."""
    prompt = [11, 12, 13]
    greedy = autoregressive_generate(tiny_target, prompt, max_new_tokens=6).token_ids
    vocab, position, runs = tiny_spec.vocab_size, 2, 400
    counts_ar = torch.zeros(vocab)
    counts_tree = torch.zeros(vocab)
    for seed in range(runs):
        ar = autoregressive_generate(
            tiny_target, prompt, 3, temperature=1.5, generator=torch.Generator().manual_seed(seed)
        )
        counts_ar[ar.token_ids[position]] += 1
        oracle = OracleDraftSource(list(prompt) + greedy, vocab, depth=4, p_top=0.8, seed=seed)
        tree = DDTreeReference(tiny_target, oracle, tree_budget=12).generate(
            prompt, 3, temperature=1.5, generator=torch.Generator().manual_seed(10_000 + seed)
        )
        counts_tree[tree.token_ids[position]] += 1
    p_value = chi_square_p_value(counts_ar, counts_tree)
    assert p_value > 1e-3, f"DDTree sampling differs from the target's (p = {p_value:.2e})"
    assert math.isfinite(p_value)
    # The test has power: a wrong distribution (greedy) is rejected.
    counts_greedy = torch.zeros(vocab)
    counts_greedy[greedy[position]] = runs
    assert chi_square_p_value(counts_ar, counts_greedy) < 1e-6
