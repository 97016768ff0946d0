"""The tree step's own state over the runner's layers (``spec_decode/tree_step.py``)."""

import torch


def test_the_runners_layer_tables_are_reused_until_a_cache_changes():
    """``tree_step._kv_layer_groups`` (the GPU commit's launch tables): built once from the
    target's TREE_ATTN layers (other layers left out), reused while the caches stay, rebuilt
    when vLLM gives a layer a new cache, and not kept while a cache is still unallocated."""
    from types import SimpleNamespace

    from tree_attn_backend.backend import TreeAttentionImpl
    from vllm_ddtree.spec_decode import tree_step
    from vllm_ddtree.spec_decode.step_state import StepState

    def tree_layer(cache):
        return SimpleNamespace(impl=object.__new__(TreeAttentionImpl), kv_cache=[cache])

    shape = (2, 4, 16, 2, 8)
    layers = {f"l{i}": tree_layer(torch.zeros(shape)) for i in range(3)}
    layers["drafter"] = SimpleNamespace(impl=object(), kv_cache=[torch.zeros(shape)])
    runner = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers))
    state = StepState()
    first = tree_step._kv_layer_groups(runner, state)
    assert len(first) == 1 and first[0].num_layers == 3
    assert tree_step._kv_layer_groups(runner, state) is first
    layers["l1"].kv_cache = [torch.ones(shape)]  # a new cache (e.g. re-allocated)
    second = tree_step._kv_layer_groups(runner, state)
    assert second is not first
    assert second[0].key_ptrs[1] == layers["l1"].kv_cache[0][0].data_ptr()
    layers["l2"].kv_cache = [torch.zeros(0)]  # not allocated yet: tables not kept
    partial = tree_step._kv_layer_groups(runner, state)
    assert partial[0].num_layers == 2 and tree_step._kv_layer_groups(runner, state) is not partial
