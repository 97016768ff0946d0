"""vLLM's own ``QwenGatedDeltaNetAttention._forward_core`` in a forward verifying trees, on the
CPU: its speculative rows must reach the tree path (the plugin routes the calls,
``compat/gdn_dispatch.py``; vLLM patched with the upstream series calls the step itself) and
give exactly what the step's own calls give (``tests/test_gdn_layer.tree_step``).

``python -m tests.helpers.gdn_forward_core`` runs it with vLLM's in-tree DDTree modules (vLLM
patched with the series, the plugin not loaded) and prints ``ok``."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.test_gdn_layer import DV, HV, Layer, split_qkv, tree_step


def vllm_layer_forward(layer, step, step_state_class, table, accepted):
    """``tree_step``'s ``forward``: vLLM's ``_forward_core`` on a stand-in for ``layer`` (its
    weights and caches), in a forward whose TREE_ATTN metadata carries ``step``."""
    from vllm.forward_context import override_forward_context
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    num_reqs = table.shape[0]
    stand_in = SimpleNamespace(
        prefix="model.layers.0.linear_attn",
        enable_packed_recurrent_decode=False,
        kv_cache=(layer.conv_cache, layer.ssm_cache),  # vLLM's default (SD) conv layout
        conv1d=SimpleNamespace(weight=layer.weight.unsqueeze(1), bias=layer.bias),
        activation="silu",
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        rearrange_mixed_qkv=lambda t: (None, None, None) if t is None else split_qkv(t),
    )

    def forward(x, a, b, query_start):
        total = x.shape[0]
        metadata = GDNAttentionMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=0,
            num_decode_tokens=0,
            num_spec_decodes=num_reqs,
            num_spec_decode_tokens=total,
            num_actual_tokens=total,
            spec_query_start_loc=query_start.to(torch.int32),
            spec_state_indices_tensor=table,
            spec_sequence_masks=torch.ones(num_reqs, dtype=torch.bool),
            spec_token_indx=torch.arange(total, dtype=torch.int32),
            non_spec_token_indx=torch.empty(0, dtype=torch.int32),
            num_accepted_tokens=accepted,
        )
        tree_forward = SimpleNamespace(
            attn_metadata={
                stand_in.prefix: metadata,
                "model.layers.3.self_attn": SimpleNamespace(
                    tree_source=step_state_class(hybrid=step)
                ),
            }
        )
        core_attn_out = torch.zeros(total, HV, DV)
        with override_forward_context(tree_forward):
            QwenGatedDeltaNetAttention._forward_core(stand_in, x, b, a, core_attn_out)
        return core_attn_out.unsqueeze(0)

    return forward


def check_forward_core_verifies_trees(step_class, step_state_class) -> None:
    """Two copies of one verify: through vLLM's ``_forward_core`` on a stand-in layer, and
    through the step's own calls; outputs and caches identical, the layer's call routed."""
    num_reqs, budget, depth = 2, 5, 3
    tokens = budget + 1
    table = (1 + torch.arange(num_reqs * tokens)).view(num_reqs, tokens).to(torch.int32)
    accepted = torch.tensor([2, 1], dtype=torch.int32)
    num_draft = torch.tensor([budget, budget - 2])
    results = {}
    for through_vllm in (True, False):
        gen = torch.Generator().manual_seed(11)
        layer = Layer(num_reqs, budget, gen)
        step = step_class(max_rows=4, tree_budget=budget, device=torch.device("cpu"))
        forward = None
        if through_vllm:  # the same trees and inputs as tree_step draws them
            forward = vllm_layer_forward(layer, step, step_state_class, table, accepted)
        *_, out = tree_step(
            step, layer, table, accepted, gen, budget, depth, num_draft, forward=forward
        )
        results[through_vllm] = {
            "out": out,
            "ssm": layer.ssm_cache,
            "conv": layer.conv_cache,
            "routed": torch.tensor(step.routed_calls),
        }
    assert int(results[True]["routed"]) == 1, "vLLM's layer did not reach the tree path"
    for name, ours in results[True].items():
        torch.testing.assert_close(ours, results[False][name], atol=0, rtol=0, msg=name)


if __name__ == "__main__":
    from vllm.v1.spec_decode.ddtree.gdn_layer import HybridTreeStep
    from vllm.v1.spec_decode.ddtree.step_state import StepState

    check_forward_core_verifies_trees(HybridTreeStep, StepState)
    print("ok")
