"""GatedDeltaNet state of a draft tree on hybrid targets: where it lives, what it costs, fits.

Two layouts. vLLM 0.26.0 keeps, for a chain, ``1 + num_speculative_tokens`` state blocks per
request for the request's lifetime, each a full conv window and SSM state of every GDN layer
(``MambaSpec.num_speculative_blocks``). Extended to trees that is ``1 + budget`` blocks per
request (``slot_layout_bytes``): what the experimental tree path (``hybrid_gdn``) uses now,
since vLLM allocates and indexes it, and fine for small models and budgets, but tens of times
what a GPU can spare at useful budgets on real hybrids.

The scratch layout (``scratch_layout_bytes``; the next step): vLLM's committed block only, plus
a per-step scratch pool shared by the batch and reused layer after layer (layers run one after
another): the tree kernel (``ops/tree_gated_delta.py``, which reads committed states straight
from vLLM's cache) writes each node's SSM state there in float32 and reads its parent's; the
accepted path is then replayed from the committed state as a chain (at most ``depth + 1``
tokens per layer) from the node inputs kept for the step, so the committed state is exactly the
one target-only decoding reaches. ``check_scratch_fits`` names the budget that fits.

Sizes are per tensor-parallel rank (heads sharded). SSM states in float32: bf16 node states
drift along deep paths and would break exactness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_ddtree.config import MAX_TREE_BUDGET, DDTreeConfigError

GIB = 1 << 30


@dataclass(frozen=True)
class GDNStateShapes:
    """Per-rank GatedDeltaNet shapes of a hybrid target.

    Attributes:
        num_gdn_layers: layers whose type is ``linear_attention``.
        num_k_heads, num_v_heads: key / value heads on this rank.
        head_k_dim, head_v_dim: ``Dk`` / ``Dv``.
        conv_kernel: width ``K`` of the causal conv (its window holds ``K - 1`` inputs).
    """

    num_gdn_layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (q, k and v of every head on this rank)."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @classmethod
    def from_hf_config(cls, hf_config: Any, tensor_parallel_size: int = 1) -> GDNStateShapes:
        """From a Qwen3-Next / Qwen3.5 config (or a multimodal one with ``text_config``)."""
        text = getattr(hf_config, "text_config", None) or hf_config
        layer_types = list(getattr(text, "layer_types", None) or [])
        num_gdn = sum(1 for kind in layer_types if kind == "linear_attention")
        heads = {
            "linear_num_key_heads": text.linear_num_key_heads,
            "linear_num_value_heads": text.linear_num_value_heads,
        }
        for name, count in heads.items():
            if count % tensor_parallel_size:
                raise DDTreeConfigError(
                    f"{name}={count} does not divide over tensor_parallel_size="
                    f"{tensor_parallel_size}"
                )
        return cls(
            num_gdn_layers=num_gdn,
            num_k_heads=text.linear_num_key_heads // tensor_parallel_size,
            num_v_heads=text.linear_num_value_heads // tensor_parallel_size,
            head_k_dim=text.linear_key_head_dim,
            head_v_dim=text.linear_value_head_dim,
            conv_kernel=text.linear_conv_kernel_dim,
        )


def ssm_state_bytes(shapes: GDNStateShapes, ssm_bytes: int = 4) -> int:
    """Bytes of one SSM state (``Hv x Dk x Dv``) of one layer."""
    return shapes.num_v_heads * shapes.head_k_dim * shapes.head_v_dim * ssm_bytes


def slot_layout_bytes(
    shapes: GDNStateShapes, max_num_seqs: int, budget: int, ssm_bytes: int = 4, conv_bytes: int = 2
) -> int:
    """vLLM's chain layout extended to trees: ``1 + budget`` persistent blocks per request, each
    an SSM state and a ``K - 1 + budget`` conv window in every GDN layer."""
    conv = shapes.conv_dim * (shapes.conv_kernel - 1 + budget) * conv_bytes
    per_block = shapes.num_gdn_layers * (ssm_state_bytes(shapes, ssm_bytes) + conv)
    return max_num_seqs * (1 + budget) * per_block


def scratch_layout_bytes(
    shapes: GDNStateShapes, max_num_seqs: int, budget: int, activation_bytes: int = 2
) -> int:
    """DDTree's layout, on top of vLLM's committed block per request: one layer's float32 node
    states for the whole batch (``max_num_seqs x (budget + 1)`` nodes), plus every GDN layer's
    node inputs kept for the replay of the accepted path (conv inputs and the two gates)."""
    nodes = max_num_seqs * (budget + 1)
    states = nodes * ssm_state_bytes(shapes, 4)
    inputs_per_node = shapes.num_gdn_layers * (shapes.conv_dim + 2 * shapes.num_v_heads)
    return states + nodes * inputs_per_node * activation_bytes


def largest_fitting_budget(
    shapes: GDNStateShapes, max_num_seqs: int, available_bytes: int, activation_bytes: int = 2
) -> int:
    """The largest ``tree_budget`` (1..MAX_TREE_BUDGET) whose scratch fits ``available_bytes``
    at ``max_num_seqs``; 0 when not even budget 1 fits."""
    low, high = 0, MAX_TREE_BUDGET
    while low < high:  # the cost grows with the budget: bisect
        middle = (low + high + 1) // 2
        need = scratch_layout_bytes(shapes, max_num_seqs, middle, activation_bytes)
        low, high = (middle, high) if need <= available_bytes else (low, middle - 1)
    return low


def check_scratch_fits(
    shapes: GDNStateShapes,
    max_num_seqs: int,
    budget: int,
    available_bytes: int,
    activation_bytes: int = 2,
) -> None:
    """Raise ``DDTreeConfigError`` naming ``tree_budget`` and the budget that would fit when the
    tree's GDN scratch does not fit ``available_bytes`` at ``max_num_seqs``."""
    need = scratch_layout_bytes(shapes, max_num_seqs, budget, activation_bytes)
    if need <= available_bytes:
        return
    fits = largest_fitting_budget(shapes, max_num_seqs, available_bytes, activation_bytes)
    advice = f"tree_budget <= {fits} fits" if fits else "no tree_budget fits; lower max_num_seqs"
    raise DDTreeConfigError(
        f"tree_budget={budget} with max_num_seqs={max_num_seqs} needs "
        f"{need / GIB:.2f} GiB of GatedDeltaNet tree state per GPU "
        f"({shapes.num_gdn_layers} GDN layers, {shapes.num_v_heads} value heads of "
        f"{shapes.head_k_dim}x{shapes.head_v_dim} per rank), more than the "
        f"{available_bytes / GIB:.2f} GiB available: {advice}."
    )
