"""The target's TREE_ATTN layers and the drafter's layers share one KV-cache group in a DDTree
engine (``hybrid/kv_cache_specs.py``)."""

from __future__ import annotations

import torch
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from vllm_ddtree.config import DDTREE_ATTR, DDTreeConfig
from vllm_ddtree.hybrid.kv_cache_specs import ddtree_kv_cache_spec, one_block_stride_indexing


def _attention(indexes_kv_by_block_stride: bool) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        indexes_kv_by_block_stride=indexes_kv_by_block_stride,
    )


def _hybrid_specs() -> dict:
    """A Qwen3-Next-like layout: 2 target attention layers on TREE_ATTN (False), 6 GDN layers,
    and a 3-layer DFlash drafter on a packed-KV backend (True)."""
    page = _attention(False).page_size_bytes
    gdn = MambaSpec(
        block_size=16,
        shapes=((4, 8), (2, 8, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page,
    )
    specs = {f"model.layers.{i}.self_attn.attn": _attention(False) for i in (3, 7)}
    specs.update({f"draft.layers.{i}.self_attn.attn": _attention(True) for i in range(3)})
    specs.update({f"model.layers.{i}.linear_attn": gdn for i in (0, 1, 2, 4, 5, 6)})
    return specs


def _drafter_groups(specs: dict) -> set[int]:
    groups = kv_cache_utils._get_kv_cache_groups_uniform_page_size(specs)
    return {
        index
        for index, group in enumerate(groups)
        for name in group.layer_names
        if name.startswith("draft.")
    }


def test_drafter_layers_share_one_group_with_the_target_attention():
    specs = _hybrid_specs()
    # vLLM's grouping splits the drafter's layers when their flag differs from TREE_ATTN's
    # (its DFlash proposer refuses that at start-up)...
    assert len(_drafter_groups(specs)) > 1
    unified = one_block_stride_indexing(specs)
    # ... and keeps them in one group, the target attention layers' one, when it does not.
    assert len(_drafter_groups(unified)) == 1
    groups = kv_cache_utils._get_kv_cache_groups_uniform_page_size(unified)
    (drafter_group,) = _drafter_groups(unified)
    assert "model.layers.3.self_attn.attn" in groups[drafter_group].layer_names
    assert all(
        not spec.indexes_kv_by_block_stride
        for spec in unified.values()
        if isinstance(spec, FullAttentionSpec)
    )


def test_uniform_flags_are_left_alone():
    specs = {name: _attention(True) for name in ("a", "b")}
    assert one_block_stride_indexing(specs) is specs
    specs = {name: _attention(False) for name in ("a", "b")}
    assert one_block_stride_indexing(specs) is specs


def test_engines_without_ddtree_keep_vllms_specs():
    from types import SimpleNamespace

    specs = _hybrid_specs()
    for speculative_config in (None, SimpleNamespace(method="dflash")):
        vllm_config = SimpleNamespace(speculative_config=speculative_config)
        assert ddtree_kv_cache_spec(vllm_config, specs) is specs
    ddtree = SimpleNamespace(
        method="dflash", **{DDTREE_ATTR: DDTreeConfig(tree_budget=8, tree_top_k=8, depth=8)}
    )
    unified = ddtree_kv_cache_spec(SimpleNamespace(speculative_config=ddtree), specs)
    assert len(_drafter_groups(unified)) == 1
