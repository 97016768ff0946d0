"""vLLM's own ``DFlashQwen3Model._normalize_context_k`` on the CPU, on a stand-in drafter with
a different K-norm weight per layer: each layer's context keys must take that layer's weight
(``compat/cpu_dflash.normalize_per_layer``; vLLM 0.26.0's CPU ``rms_norm`` gives every layer
the first row). ``python -m tests.helpers.cpu_dflash_k_norm`` prints ``ok`` where vLLM has
the fix (patched with the upstream series) and fails where it has not."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_ddtree.compat.cpu_dflash import normalize_per_layer


def check_each_layer_takes_its_own_k_norm() -> None:
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 5, 2, 8, generator=gen) * 3
    weights = torch.rand(3, 8, generator=gen) + 0.5
    drafter = SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-6)
    out = DFlashQwen3Model._normalize_context_k(drafter, keys)
    torch.testing.assert_close(out, normalize_per_layer(keys, weights, 1e-6), atol=0, rtol=0)


if __name__ == "__main__":
    check_each_layer_takes_its_own_k_norm()
    print("ok")
