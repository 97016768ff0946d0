"""One KV-cache group for the target's TREE_ATTN layers and the drafter's attention layers.

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
uniform layout. A DDTree engine's runner (V1 and V2) therefore gives every attention layer
False as soon as one layer says False (``ddtree_kv_cache_spec``, called where the runner's
``get_kv_cache_spec`` returns).
"""

from __future__ import annotations

import dataclasses

from vllm_ddtree.config import get_ddtree_config


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


def ddtree_kv_cache_spec(vllm_config, specs: dict) -> dict:
    """A runner's ``{layer name: KVCacheSpec}``: through ``one_block_stride_indexing`` in an
    engine with DDTree configured, unchanged in any other."""
    speculative_config = getattr(vllm_config, "speculative_config", None)
    if get_ddtree_config(speculative_config) is None:
        return specs
    return one_block_stride_indexing(specs)
