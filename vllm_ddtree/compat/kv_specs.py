"""TREE_ATTN's KV-cache layout, ``(2, num_blocks, ...)``, where vLLM assumes another.

1. One KV-cache spec for the target's TREE_ATTN layers and the drafter's attention layers.

vLLM 0.26.0 stamps every attention layer's ``KVCacheSpec`` with its backend's
``indexes_kv_by_block_stride()`` (whether ``num_blocks`` is the outermost physical dimension).
TREE_ATTN's cache is ``(2, num_blocks, ...)``, so its layers say False, while the DFlash
drafter's backend (TRITON_ATTN / FLASH_ATTN, K and V packed behind ``num_blocks``) says True.
On a hybrid target (GatedDeltaNet + attention) vLLM groups layers by equal specs and cuts every
group to the size of the smallest one, so the drafter's layers become a type of their own and
are split over several KV-cache groups once the drafter has more layers than the target has
attention layers; vLLM's DFlash proposer then stops at start-up ("All drafting layers should
belong to the same kv cache group"). On dense targets the two kinds still share one group.

False is the conservative value of the flag for any backend (vLLM uses it when a backend
declares no layered stride order): it only turns off page-size padding and the cross-layer
uniform layout. ``wrap_get_kv_cache_spec`` therefore gives every attention layer False as soon
as one layer says False, on the V1 and the V2 runner, in engines with DDTree configured.

2. vLLM-CPU zeroes new KV blocks as ``kv[block_id]`` (blocks first): for TREE_ATTN caches
``zero_attention_blocks`` zeroes along the backend's block dimension instead.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_ddtree.compat import get_ddtree_config


def one_block_stride_indexing(specs: dict) -> dict:
    """``{layer name: KVCacheSpec}`` with ``indexes_kv_by_block_stride`` False on every
    attention spec when any of them is False (other specs and the all-True case unchanged)."""
    flags = {
        spec.indexes_kv_by_block_stride
        for spec in specs.values()
        if hasattr(spec, "indexes_kv_by_block_stride")
    }
    if flags != {True, False}:
        return specs
    return {
        name: (
            dataclasses.replace(spec, indexes_kv_by_block_stride=False)
            if getattr(spec, "indexes_kv_by_block_stride", False)
            else spec
        )
        for name, spec in specs.items()
    }


def wrap_get_kv_cache_spec(original):
    """A runner's ``get_kv_cache_spec(self)`` passed through ``one_block_stride_indexing``."""

    def get_kv_cache_spec(self, *args, **kwargs):
        specs = original(self, *args, **kwargs)
        return one_block_stride_indexing(specs) if _ddtree_configured(self) else specs

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
