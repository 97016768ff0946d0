"""GatedDeltaNet state of a draft tree on hybrid targets: where it lives, what it costs, fits.

Two layouts. vLLM 0.26.0 keeps, for a chain, ``1 + num_speculative_tokens`` state blocks per
request for the request's lifetime, each a full conv window and SSM state of every GDN layer
(``MambaSpec.num_speculative_blocks``). Extended to trees that is ``1 + budget`` blocks per
request (``slot_layout_bytes``): what the tree path (``gdn_layer``) uses now,
since vLLM allocates and indexes it, and fine for small models and budgets, but tens of times
what a GPU can spare at useful budgets on real hybrids.

The scratch layout (``scratch_layout_bytes``; the next step): vLLM's committed block only, plus
a per-step scratch pool shared by the batch and reused layer after layer (layers run one after
another): the tree kernel (``ops/tree_gated_delta.py``, which reads committed states straight
from vLLM's cache) writes each node's SSM state there in float32 and reads its parent's; the
accepted path is then replayed from the committed state as a chain (at most ``depth + 1``
tokens per layer) from the node inputs kept for the step, so the committed state is exactly the
one target-only decoding reaches. ``check_scratch_fits`` names the budget that fits.

``check_slot_layout_fits`` runs before the engine starts (``compat.installer``), for the layout in
use: with vLLM's default ``max_num_seqs`` a real hybrid's ``1 + budget`` blocks per request
exceed any GPU (Qwen3-Next-80B: 36 GDN layers x 32 heads of 128 x 128 float32 = 75 MB per
block), which vLLM would otherwise meet with a shrunken batch or a late error.

Sizes are per tensor-parallel rank (heads sharded). SSM states in float32 or bfloat16 (the
engine's ``mamba_ssm_cache_dtype``): node states are rounded where target-alone decoding with
that cache dtype rounds them (``ops/tree_gated_delta.py``), so bfloat16 halves the state memory
and keeps the tree path equal to bfloat16 target-alone decoding, not to float32 decoding.
"""

from __future__ import annotations

from collections.abc import Callable
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
    shapes: GDNStateShapes,
    max_num_seqs: int,
    tree_budget: int,
    ssm_bytes: int = 4,
    conv_bytes: int = 2,
    extra_blocks: int = 0,
) -> int:
    """vLLM's chain layout extended to trees: ``1 + budget`` persistent blocks per request (and
    ``extra_blocks`` more: 1 in the prefix-caching ``align`` layout, the block the state is
    copied out of), each an SSM state and a ``K - 1 + budget`` conv window in every GDN layer."""
    conv = shapes.conv_dim * (shapes.conv_kernel - 1 + tree_budget) * conv_bytes
    per_block = shapes.num_gdn_layers * (ssm_state_bytes(shapes, ssm_bytes) + conv)
    return max_num_seqs * (1 + tree_budget + extra_blocks) * per_block


def scratch_layout_bytes(
    shapes: GDNStateShapes, max_num_seqs: int, tree_budget: int, activation_bytes: int = 2
) -> int:
    """DDTree's layout, on top of vLLM's committed block per request: one layer's float32 node
    states for the whole batch (``max_num_seqs x (budget + 1)`` nodes), plus every GDN layer's
    node inputs kept for the replay of the accepted path (conv inputs and the two gates)."""
    nodes = max_num_seqs * (tree_budget + 1)
    states = nodes * ssm_state_bytes(shapes, 4)
    inputs_per_node = shapes.num_gdn_layers * (shapes.conv_dim + 2 * shapes.num_v_heads)
    return states + nodes * inputs_per_node * activation_bytes


def _largest_budget(bytes_at: Callable[[int], int], available_bytes: int) -> int:
    """The largest budget in 1..MAX_TREE_BUDGET with ``bytes_at(budget) <= available_bytes``
    (0 when none); ``bytes_at`` grows with the budget, so bisect."""
    low, high = 0, MAX_TREE_BUDGET
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if bytes_at(middle) <= available_bytes else (low, middle - 1)
    return low


def largest_fitting_budget(
    shapes: GDNStateShapes, max_num_seqs: int, available_bytes: int, activation_bytes: int = 2
) -> int:
    """The largest ``tree_budget`` (1..MAX_TREE_BUDGET) whose scratch fits ``available_bytes``
    at ``max_num_seqs``; 0 when not even budget 1 fits."""
    return _largest_budget(
        lambda tree_budget: scratch_layout_bytes(
            shapes, max_num_seqs, tree_budget, activation_bytes
        ),
        available_bytes,
    )


def check_slot_layout_fits(
    shapes: GDNStateShapes,
    max_num_seqs: int,
    tree_budget: int,
    available_bytes: int,
    ssm_bytes: int = 4,
    extra_blocks: int = 0,
) -> None:
    """Before the engine starts: raise ``DDTreeConfigError`` when the states of the layout the
    tree path uses (``slot_layout_bytes``: ``1 + budget + extra_blocks`` blocks per request)
    cannot fit the ``available_bytes`` vLLM may use at all, naming the ``tree_budget`` that fits
    at this ``max_num_seqs`` and the ``max_num_seqs`` that fits at this budget. A necessary
    condition only (weights, activations and attention KV come out of the same memory), so it
    refuses only what can never run; vLLM's own KV-cache sizing decides the rest."""

    def bytes_at(budget: int, seqs: int = max_num_seqs) -> int:
        return slot_layout_bytes(shapes, seqs, budget, ssm_bytes, extra_blocks=extra_blocks)

    need = bytes_at(tree_budget)
    if need <= available_bytes:
        return
    fits = _largest_budget(bytes_at, available_bytes)
    seqs = available_bytes // bytes_at(tree_budget, 1)
    options = [f"tree_budget <= {fits}" if fits else "no tree_budget fits this max_num_seqs"]
    if seqs:
        options.append(f"max_num_seqs <= {seqs} at tree_budget={tree_budget}")
    raise DDTreeConfigError(
        f"tree_budget={tree_budget} with max_num_seqs={max_num_seqs} keeps "
        f"{need / GIB:.1f} GiB of GatedDeltaNet state per GPU ({1 + extra_blocks} + tree_budget "
        f"state blocks per request, each {shapes.num_gdn_layers} layers x {shapes.num_v_heads} "
        "value heads of "
        f"{shapes.head_k_dim}x{shapes.head_v_dim} {'float32' if ssm_bytes == 4 else 'bfloat16'} "
        "plus the conv window), more than the "
        f"{available_bytes / GIB:.1f} GiB vLLM may use: {' or '.join(options)}."
    )


def check_scratch_fits(
    shapes: GDNStateShapes,
    max_num_seqs: int,
    tree_budget: int,
    available_bytes: int,
    activation_bytes: int = 2,
) -> None:
    """Raise ``DDTreeConfigError`` naming ``tree_budget`` and the budget that would fit when the
    tree's GDN scratch does not fit ``available_bytes`` at ``max_num_seqs``."""
    need = scratch_layout_bytes(shapes, max_num_seqs, tree_budget, activation_bytes)
    if need <= available_bytes:
        return
    fits = largest_fitting_budget(shapes, max_num_seqs, available_bytes, activation_bytes)
    advice = f"tree_budget <= {fits} fits" if fits else "no tree_budget fits; lower max_num_seqs"
    raise DDTreeConfigError(
        f"tree_budget={tree_budget} with max_num_seqs={max_num_seqs} needs "
        f"{need / GIB:.2f} GiB of GatedDeltaNet tree state per GPU "
        f"({shapes.num_gdn_layers} GDN layers, {shapes.num_v_heads} value heads of "
        f"{shapes.head_k_dim}x{shapes.head_v_dim} per rank), more than the "
        f"{available_bytes / GIB:.2f} GiB available: {advice}."
    )
