"""Tiny random-weight checkpoints for tests and benchmarks (HF layout, safetensors).

Nothing here downloads anything: models are built with transformers from a config and saved
with ``save_pretrained``, then loaded back through the ordinary loading code (transformers or
vLLM), exactly like a real checkpoint.

Random models need *sharp* logits (``initializer_range`` around 0.5): with the default 0.02 the
next-token distribution is nearly uniform, and bf16/fp32 rounding differences between two
correct kernels then flip greedy ties, which would look like (but is not) a losslessness bug.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vllm_ddtree.dflash_drafter import DFlashDrafterConfig, random_drafter


@dataclass(frozen=True)
class TinyQwen3Spec:
    """Shape of a tiny Qwen3 target (head_dim 64: supported by vLLM's CPU and GPU backends)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    initializer_range: float = 0.5
    max_position_embeddings: int = 4096


def target_config_fields(spec) -> dict:
    """The config fields every test target shares: ``spec``'s shapes (a ``TinyQwen3Spec`` or a
    ``scale_models.ScaleModel``), untied embeddings, no special tokens."""
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        initializer_range=spec.initializer_range,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def tiny_qwen3_config(spec: TinyQwen3Spec = TinyQwen3Spec()):
    """The transformers ``Qwen3Config`` of a tiny target (untied, no special tokens)."""
    from transformers import Qwen3Config

    return Qwen3Config(**target_config_fields(spec))


def _save_random(path: str, model_class, config, seed: int) -> str:
    """Random weights for ``config`` (seeded), saved as bf16 safetensors with no special tokens
    in the generation config; a checkpoint already at ``path`` is kept."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(path)
    return path


def make_tiny_qwen3(path: str, spec: TinyQwen3Spec = TinyQwen3Spec(), seed: int = 0) -> str:
    """Save a random-weight Qwen3ForCausalLM checkpoint (bf16 safetensors) under ``path``."""
    from transformers import Qwen3ForCausalLM

    return _save_random(path, Qwen3ForCausalLM, tiny_qwen3_config(spec), seed)


def make_tiny_qwen3_next(path: str, spec: TinyQwen3Spec = TinyQwen3Spec(), seed: int = 0) -> str:
    """Save a random-weight hybrid target, ``Qwen3NextForCausalLM``, under ``path``: the spec's
    vocabulary, hidden size and attention heads, GatedDeltaNet layers with 2 key / 4 value heads
    of 128 (one full-attention layer in 4, the last), 4 experts (vLLM's Qwen3-Next needs MoE
    layers), untied embeddings (vLLM ignores tying for Qwen3-Next).

    Every token is routed to all 4 experts: a top-k router is a discrete choice, and a float32
    rounding difference between two correct kernels (a tree's and a chain's) at a router
    near-tie would send a token to other experts and part the two outputs, which a lossless
    check would then blame on the tree. With all experts taken the routing weights are
    continuous in the input.

    Two value heads per key head, as in the real checkpoints: with one, vLLM 0.26.0's packed
    decode kernel rejects the ``a``/``b`` views its Qwen3-Next layer hands it ("must be
    contiguous in the last dim"). Serve it in bf16: vLLM's chunked GDN prefill refuses float32."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **target_config_fields(spec),
        moe_intermediate_size=spec.intermediate_size // 4,
        shared_expert_intermediate_size=spec.intermediate_size // 4,
        num_experts=4,
        num_experts_per_tok=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        full_attention_interval=4,
        architectures=["Qwen3NextForCausalLM"],
    )
    return _save_random(path, Qwen3NextForCausalLM, config, seed)


def hybrid_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5-family ``layer_types``: a full-attention layer every ``interval``, the last of
    each group, GatedDeltaNet layers between."""
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def qwen3_5_config(config_class, text_config: dict):
    """A Qwen3.5-family multimodal config around ``text_config`` with a one-block vision tower,
    which text-only prompts never run but the checkpoint must hold; untied embeddings."""
    return config_class(
        text_config=text_config,
        vision_config=dict(
            depth=1,
            hidden_size=64,
            num_heads=2,
            intermediate_size=128,
            out_hidden_size=text_config["hidden_size"],
        ),
        tie_word_embeddings=False,
    )


# The Qwen3-Next fixture's GatedDeltaNet heads: 2 key / 4 value heads of 128.
TINY_GDN_HEADS = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
# Heads with small states (1 key / 2 value heads of 32, the smallest vLLM-CPU's GDN kernels
# take): vLLM sizes a hybrid's KV blocks to hold a layer's state, so these give blocks of a few
# dozen tokens, and prefix caching's state blocks (its "align" layout) fill within a short test.
SMALL_STATE_GDN_HEADS = dict(
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
)


def _qwen3_5_config(config_class, spec: TinyQwen3Spec, gdn_heads=None, **text_extra):
    """A tiny Qwen3.5-family config: the text model with the Qwen3-Next fixture's GDN layout
    (``gdn_heads``, by default ``TINY_GDN_HEADS``; one full-attention layer in 4, untied
    embeddings) plus ``text_extra`` (``qwen3_5_config``)."""
    text = target_config_fields(spec)
    text.update(
        text_extra,
        **(gdn_heads or TINY_GDN_HEADS),
        layer_types=hybrid_layer_types(spec.num_hidden_layers),
    )
    return qwen3_5_config(config_class, text)


def make_tiny_qwen3_5(
    path: str, spec: TinyQwen3Spec = TinyQwen3Spec(), seed: int = 0, gdn_heads=None
) -> str:
    """Save a random-weight dense Qwen3.5 hybrid, ``Qwen3_5ForConditionalGeneration`` (the class
    vLLM 0.26.0 serves Qwen3.5/3.6 dense checkpoints with), under ``path``: the text model as in
    ``make_tiny_qwen3_next`` without experts (GDN heads ``gdn_heads``, by default
    ``TINY_GDN_HEADS``) and a one-block vision tower."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = _qwen3_5_config(Qwen3_5Config, spec, gdn_heads)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return _save_random(path, Qwen3_5ForConditionalGeneration, config, seed)


def make_tiny_qwen3_5_moe(path: str, spec: TinyQwen3Spec = TinyQwen3Spec(), seed: int = 0) -> str:
    """Save a random-weight Qwen3.5 MoE hybrid, ``Qwen3_5MoeForConditionalGeneration`` (the class
    vLLM 0.26.0 serves Qwen3.5/3.6 MoE checkpoints with, e.g. Qwen3.5-35B-A3B), under ``path``:
    the dense fixture's GDN layout with 4 experts and a shared expert in every layer, every
    token routed to all 4 (continuous routing weights, as in ``make_tiny_qwen3_next``)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config = _qwen3_5_config(
        Qwen3_5MoeConfig,
        spec,
        moe_intermediate_size=spec.intermediate_size // 4,
        shared_expert_intermediate_size=spec.intermediate_size // 4,
        num_experts=4,
        num_experts_per_tok=4,
    )
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    return _save_random(path, Qwen3_5MoeForConditionalGeneration, config, seed)


# The tiny hybrid fixtures by name (``lossless_gpu.py --hybrid-arch``): the maker and the vLLM
# model class its checkpoint is served with.
HYBRID_TARGETS = {
    "qwen3_next": (make_tiny_qwen3_next, "Qwen3NextForCausalLM"),
    "qwen3_5": (make_tiny_qwen3_5, "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": (make_tiny_qwen3_5_moe, "Qwen3_5MoeForConditionalGeneration"),
}


def tiny_drafter_config(
    target_spec: TinyQwen3Spec = TinyQwen3Spec(),
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
) -> DFlashDrafterConfig:
    """A DFlash drafter config matching a tiny target (mask token = last vocab id)."""
    if target_layer_ids is None:
        target_layer_ids = [1, max(target_spec.num_hidden_layers - 2, 1)]
    return DFlashDrafterConfig.for_target(
        target_spec,
        num_layers,
        target_layer_ids,
        block_size=block_size,
        max_position_embeddings=target_spec.max_position_embeddings,
    )


def make_tiny_dflash(
    path: str,
    target_spec: TinyQwen3Spec = TinyQwen3Spec(),
    seed: int = 0,
    **config_kwargs,
) -> str:
    """Save a random-weight DFlash drafter in vLLM's DFlash checkpoint format under ``path``."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    drafter = random_drafter(tiny_drafter_config(target_spec, **config_kwargs), seed=seed)
    drafter.save_pretrained(path)
    return path
