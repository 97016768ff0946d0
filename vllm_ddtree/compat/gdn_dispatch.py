"""vLLM's GatedDeltaNet calls routed to the tree path, in a DDTree worker (the plugin's side).

vLLM 0.26.0's ``QwenGatedDeltaNetAttention._forward_core`` sends its speculative rows through
two chain-shaped calls it looks up in its own module (``seams.GDN_MODULE``):
``causal_conv1d_update(..., num_accepted_tokens=, query_start_loc=, max_query_len=)`` and
``fused_sigmoid_gating_delta_rule_update(..., ssm_state_indices=[S, 1 + B],
num_accepted_tokens=)``; vLLM-CPU its own ``_spec_forward``. ``install`` replaces those names
with dispatchers that send exactly the speculative calls of a forward verifying trees
(``gdn_layer.step_of_this_forward``) to the tree path (``HybridTreeStep.tree_conv`` /
``tree_recurrence``, ``gdn_layer.tree_spec_forward_cpu``) and every other call to vLLM's
function unchanged. In vLLM's tree the layer makes the same choice where it calls them.
"""

from __future__ import annotations

import torch

from vllm_ddtree import envs
from vllm_ddtree.compat import seams
from vllm_ddtree.hybrid import gdn_metadata
from vllm_ddtree.hybrid.gdn_layer import step_of_this_forward, tree_spec_forward_cpu

GDN_MODULE = seams.GDN_MODULE
CPU_GDN_MODULE = seams.GDN_CPU_MODULE


def _is_tree_conv_call(kwargs: dict) -> bool:
    return (
        kwargs.get("num_accepted_tokens") is not None
        and kwargs.get("query_start_loc") is not None
        and kwargs.get("conv_state_indices") is not None
    )


def _is_tree_recurrence_call(kwargs: dict) -> bool:
    indices = kwargs.get("ssm_state_indices")
    return (
        kwargs.get("num_accepted_tokens") is not None
        and kwargs.get("cu_seqlens") is not None
        and indices is not None
        and indices.dim() == 2
    )


def _conv_dispatcher(original):
    def causal_conv1d_update(*args, **kwargs):
        step = step_of_this_forward() if _is_tree_conv_call(kwargs) else None
        if step is None:
            return original(*args, **kwargs)
        return step.tree_conv(*args, **kwargs)  # takes vLLM's speculative call as it is

    return causal_conv1d_update


def _recurrence_dispatcher(original):
    def fused_sigmoid_gating_delta_rule_update(*args, **kwargs):
        tree_call = not args and _is_tree_recurrence_call(kwargs)
        step = step_of_this_forward() if tree_call else None
        if step is None:
            return original(*args, **kwargs)
        return step.tree_recurrence(**kwargs)  # takes vLLM's speculative call as it is

    return fused_sigmoid_gating_delta_rule_update


def _cpu_spec_dispatcher(original):
    def _spec_forward(
        layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state, *args, **kw
    ):
        given = (layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state)
        step = step_of_this_forward()
        if step is None:
            return original(*given, *args, **kw)
        return tree_spec_forward_cpu(step, *given)

    return _spec_forward


def build_wrapper(original):
    """``GDNAttentionMetadataBuilder.build`` as the plugin wraps it: a DDTree engine's tree
    steps through ``gdn_metadata.tree_step_build``, every other build through vLLM's, then
    ``finish_build`` (vLLM's tree makes both calls in the build itself)."""

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        metadata = gdn_metadata.tree_step_build(
            self, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu
        )
        if metadata is not None:
            return metadata
        metadata = original(
            self,
            common_prefix_len,
            common_attn_metadata,
            num_accepted_tokens,
            num_decode_draft_tokens_cpu,
            fast_build,
        )
        return gdn_metadata.finish_build(self, metadata)

    return build


def install(device: torch.device) -> None:
    """In a worker: route vLLM's speculative GDN calls to the tree kernels when the forward
    verifies trees (``step_of_this_forward``); vLLM-CPU's own GDN code too on a CPU device,
    and the metadata checks under ``VLLM_DDTREE_CHECK_INDICES=1``. Once per process."""
    seams.install(seams.GDN)
    if torch.device(device).type == "cpu":
        seams.install(seams.GDN_CPU)
    if envs.checking_indices():
        seams.install(seams.GDN_CHECKS)
