"""TREE_ATTN's KV-cache layout, ``(2, num_blocks, ...)``, where vLLM assumes another (the
plugin's wrappers).

1. The runners' ``get_kv_cache_spec`` (V1 and V2) through ``hybrid/kv_cache_specs.py``: one
   KV-cache group for the target's TREE_ATTN layers and the drafter's attention layers.
2. vLLM-CPU zeroes new KV blocks as ``kv[block_id]`` (blocks first): for TREE_ATTN caches
   ``zero_attention_blocks`` zeroes along the backend's block dimension instead.
"""

from __future__ import annotations

import torch

from vllm_ddtree.compat import get_ddtree_config
from vllm_ddtree.hybrid.kv_cache_specs import ddtree_kv_cache_spec


def wrap_get_kv_cache_spec(original):
    """A runner's ``get_kv_cache_spec(self)`` passed through ``ddtree_kv_cache_spec``."""

    def get_kv_cache_spec(self, *args, **kwargs):
        specs = original(self, *args, **kwargs)
        return ddtree_kv_cache_spec(getattr(self, "vllm_config", None), specs)

    return get_kv_cache_spec


def zero_attention_blocks(runner, block_ids: list[int]) -> None:
    """vLLM-CPU's ``CPUModelRunner._zero_block_ids`` with TREE_ATTN's block dimension: vLLM's
    zeroes ``kv[block_id]`` (blocks first), while TREE_ATTN's cache is ``(2, num_blocks, ...)``
    (vLLM's GPU runner already asks the backend). Zeroes the blocks of every full-attention
    layer's cache once; other backends' caches as vLLM does."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tree_attn_backend.backend import TreeAttentionBackend

    seen: set[int] = set()
    context = runner.compilation_config.static_forward_context
    for group in runner.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec):
            continue
        for name in group.layer_names:
            layer = context.get(name)
            kv = getattr(layer, "kv_cache", None)
            if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            dim = 0
            if layer.get_attn_backend() is TreeAttentionBackend:
                dim = TreeAttentionBackend.get_kv_cache_block_dim(
                    spec.block_size, spec.num_kv_heads, spec.head_size
                )
            index = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            kv.index_fill_(dim, index, 0)


def wrap_zero_block_ids(original):
    """``CPUModelRunner._zero_block_ids`` through ``zero_attention_blocks`` when DDTree is
    configured (vLLM's own otherwise)."""

    def _zero_block_ids(self, block_ids):
        if not _ddtree_configured(self):
            return original(self, block_ids)
        zero_attention_blocks(self, block_ids)

    return _zero_block_ids


def _ddtree_configured(runner) -> bool:
    config = getattr(runner, "vllm_config", None)
    return get_ddtree_config(getattr(config, "speculative_config", None)) is not None
