"""Keyed Gumbel noise (``ops/keyed_gumbel.py``): a pure function of (seed, key, token), exact
Gumbel-max sampling, and drafts coupled to it that the target's samples match more often."""

import math

import pytest
import torch

from tests.stats import chi_square_p_value
from vllm_ddtree.ops.keyed_gumbel import (
    couple_draft_logits,
    keyed_gumbel_noise,
    keyed_uniform,
    perturb_like_vllm_v2,
)


def test_noise_is_a_pure_function_of_seed_key_and_token():
    seeds = torch.tensor([7, 7, 8])
    keys = torch.tensor([[3, 4], [3, 4], [3, 4]])
    noise = keyed_gumbel_noise(seeds, keys, 50)
    assert noise.shape == (3, 2, 50) and noise.dtype == torch.float32
    assert torch.equal(noise, keyed_gumbel_noise(seeds, keys, 50))
    assert torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[2])  # another seed
    assert not torch.equal(noise[0, 0], noise[0, 1])  # another key
    # A token's noise does not depend on the vocabulary size asked for.
    assert torch.equal(keyed_gumbel_noise(seeds, keys, 20), noise[..., :20])


def test_uniforms_are_uniform_and_gumbels_have_gumbel_moments():
    seeds = torch.arange(64)
    keys = torch.arange(64).view(64, 1) * 1000 + torch.arange(8)
    uniform = keyed_uniform(seeds, keys, 512).flatten()
    assert 0 < float(uniform.min()) and float(uniform.max()) < 1
    # Kolmogorov-Smirnov against U(0, 1), n = 262144: critical value at alpha 1e-3 ~ 0.0038.
    values, _ = uniform.sort()
    ranks = torch.arange(1, values.numel() + 1, dtype=torch.float64) / values.numel()
    assert float((ranks - values).abs().max()) < 0.0038
    # Neighbouring tokens and keys are uncorrelated.
    grid = keyed_uniform(seeds, keys, 512)
    assert (
        abs(
            float(
                torch.corrcoef(torch.stack([grid[..., :-1].flatten(), grid[..., 1:].flatten()]))[
                    0, 1
                ]
            )
        )
        < 0.01
    )
    assert (
        abs(
            float(
                torch.corrcoef(torch.stack([grid[:, :-1].flatten(), grid[:, 1:].flatten()]))[0, 1]
            )
        )
        < 0.01
    )
    noise = keyed_gumbel_noise(seeds, keys, 512).double()
    assert abs(float(noise.mean()) - 0.5772156649) < 0.01
    assert abs(float(noise.var()) - math.pi**2 / 6) < 0.02


def test_gumbel_max_with_keyed_noise_samples_the_softmax():
    """argmax(logits + G(seed, key)) over 20000 (seed, key) pairs vs multinomial draws."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
    seeds = torch.arange(200)
    keys = torch.arange(100).expand(200, 100)
    noise = keyed_gumbel_noise(seeds, keys, logits.numel())
    keyed = (logits + noise).argmax(-1).flatten()
    generator = torch.Generator().manual_seed(0)
    reference = torch.multinomial(logits.softmax(-1), keyed.numel(), True, generator=generator)
    counts = [torch.bincount(t, minlength=logits.numel()).tolist() for t in (keyed, reference)]
    assert counts[0][6] == 0  # a -inf token is never drawn
    keep = [i for i in range(logits.numel()) if i != 6]
    p_value = chi_square_p_value([counts[0][i] for i in keep], [counts[1][i] for i in keep])
    assert p_value > 1e-3, (counts, p_value)


def test_coupling_perturbs_only_sampled_requests():
    logits = torch.randn(3, 4, 32)
    temperature = torch.tensor([0.0, 1.0, 0.5])
    seeds = torch.tensor([1, 2, 3])
    keys = torch.arange(12).view(3, 4) + 100
    coupled = couple_draft_logits(logits, temperature, seeds, keys)
    assert torch.equal(coupled[0], logits[0])
    noise = keyed_gumbel_noise(seeds, keys, 32)
    torch.testing.assert_close(coupled[1], logits[1] + noise[1])
    torch.testing.assert_close(coupled[2], logits[2] / 0.5 + noise[2])
    greedy = torch.zeros(3)
    assert torch.equal(couple_draft_logits(logits, greedy, seeds, keys), logits)


def test_coupled_draft_matches_the_targets_sample_more_often_than_its_argmax():
    """A drafter close to the target (its logits plus small noise): at T = 1 the target's keyed
    sample equals the coupled draft's top token far more often than the drafter's argmax."""
    generator = torch.Generator().manual_seed(0)
    num_reqs, depth, vocab = 64, 15, 200
    target = torch.randn(num_reqs, depth, vocab, generator=generator) * 2
    draft = target + 0.3 * torch.randn(num_reqs, depth, vocab, generator=generator)
    seeds = torch.arange(num_reqs) + 11
    keys = torch.arange(depth).expand(num_reqs, depth) + 40
    target_sample = (target + keyed_gumbel_noise(seeds, keys, vocab)).argmax(-1)
    ones = torch.ones(num_reqs)
    coupled_top = couple_draft_logits(draft, ones, seeds, keys).argmax(-1)
    plain_top = draft.argmax(-1)
    coupled_rate = float((coupled_top == target_sample).float().mean())
    plain_rate = float((plain_top == target_sample).float().mean())
    assert coupled_rate > 0.8 and plain_rate < 0.5, (coupled_rate, plain_rate)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's V2 sampler needs CUDA")
def test_v2_perturbation_is_the_noise_vllms_sampler_draws():
    """The argmax of the perturbed logits is vLLM 0.26.0's ``gumbel_sample`` at the same
    temperatures, seeds and keys (fp32 and fp64 noise); greedy and padding rows untouched."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    rows, vocab = 96, 49152
    logits = torch.randn(rows, vocab, device=device, generator=generator) * 3
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3], device=device)
    seeds = torch.tensor([5, 123456789, 2**40 + 3, 77], dtype=torch.int64, device=device)
    idx_mapping = torch.arange(rows, device=device, dtype=torch.int32) % 4
    idx_mapping[-1] = -1
    keys = torch.randint(0, 4096, (rows,), device=device, dtype=torch.int64, generator=generator)
    for use_fp64 in (False, True):
        perturbed = logits.clone()
        perturb_like_vllm_v2(perturbed, idx_mapping, temperature, seeds, keys, use_fp64)
        expected = gumbel_sample(
            logits.clone(),
            idx_mapping,
            temperature,
            seeds,
            keys,
            apply_temperature=True,
            use_fp64=use_fp64,
        )
        live = idx_mapping >= 0
        assert torch.equal(perturbed.argmax(-1)[live], expected[live])
        untouched = (idx_mapping == 0) | ~live
        assert torch.equal(perturbed[untouched], logits[untouched])
