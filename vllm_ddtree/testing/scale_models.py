"""Scale models: random-weight targets and DFlash drafters at the shapes users serve.

Nothing at 8B-27B can be downloaded here, so speed is measured on checkpoints built from a
config: real compute at real shapes, random weights. They are saved once per machine as HF
checkpoints (safetensors) and loaded through vLLM's ordinary loader, like a real model.

The shapes, from public configs:

* ``QWEN3_8B``: Qwen/Qwen3-8B's ``config.json`` (36 layers, hidden 4096, 32 query / 8 KV heads
  of 128, MLP 12288, vocabulary 151936, untied), with the shape of z-lab's
  Qwen3-8B-DFlash-b16 drafter as the issue states it (5 layers at the target's width, block
  16, features from target layers 1, 9, 17, 25, 33, mask token 151669).
* ``QWEN3_6_27B``: Qwen3.6-27B, the dense GatedDeltaNet hybrid (vLLM class
  ``Qwen3_5ForConditionalGeneration``): its model card gives hidden 5120, 64 layers laid out
  as 16 x (3 GatedDeltaNet + 1 gated attention), GDN heads 48 for V and 16 for QK of dim 128;
  a public training recipe of the same text model (THUDM/slime
  ``scripts/models/qwen3.5-27B.sh``) gives 24 query / 4 KV heads of 256, partial rotary 0.25,
  MLP 17408, vocabulary 248320, untied embeddings. The drafter: a public config of a
  ``DFlashDraftModel`` for this target (5 layers, hidden 5120, 32 query / 8 KV heads of 128,
  MLP 17408, features from target layers 1, 16, 31, 46, 61, mask token 248070, RoPE theta
  1e7). The vision tower is one block: text prompts never run it.
* ``QWEN3_5_9B``: Qwen3.5-9B, the smaller dense GatedDeltaNet hybrid of the same class, for
  iterating on one H100: Qwen/Qwen3.5-9B's ``config.json`` (its ``text_config``) and model card
  give hidden 4096, 32 layers laid out as 8 x (3 GatedDeltaNet + 1 gated attention), GDN heads
  32 for V and 16 for QK of dim 128, conv width 4, 16 query / 4 KV heads of 256, partial rotary
  0.25, RoPE theta 1e7, MLP 12288, vocabulary 248320. The drafter, as z-lab's
  Qwen3.5-9B-DFlash card describes it: 5 layers at the target's width with 32 heads (8 KV heads
  of 128, MLP 12288 as the Qwen3-8B drafter's), block 16, features from target layers 1, 8,
  15, 22, 29, mask token 248070.

Sharp logits: with the usual initialisation (std 0.02) a random model's next-token
distribution is nearly flat and bf16 rounding flips greedy near-ties between two correct
kernels. Every weight here has std 0.02 except the output head, whose std makes the logits'
spread ``LOGIT_STD`` (the final norm leaves hidden states of RMS 1, so a logit's std is
``sqrt(hidden) x head std``).

``shrink`` divides widths, depths and the vocabulary (for CPU tests of the same code path);
``parameter_count`` counts a spec's parameters without allocating them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vllm_ddtree.dflash_drafter import DFlashDrafterConfig, random_drafter
from vllm_ddtree.testing import hybrid_layer_types, qwen3_5_config, target_config_fields

LOGIT_STD = 8.0
INIT_STD = 0.02


@dataclass(frozen=True)
class ScaleModel:
    """A target's shape and its DFlash drafter's."""

    name: str
    architecture: str  # the vLLM model class its checkpoint is served with
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    drafter_layers: int
    drafter_heads: int
    drafter_kv_heads: int
    drafter_head_dim: int
    drafter_intermediate_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    max_position_embeddings: int = 40960
    hybrid: dict[str, Any] = field(default_factory=dict)  # GDN fields (hybrid targets)
    partial_rotary_factor: float | None = None
    init_std: float = INIT_STD  # every weight's init std but the embedding's and the head's
    embedding_std: float | None = None  # the input embedding's (None: ``init_std``)
    successor_head: bool = False  # the output head: a fixed successor per token (below)

    def predictable(self) -> ScaleModel:
        """The same shapes, built so that the target's next token is a fixed function of the
        current one that no rounding can change (``build_target``): layers at init std
        0.002 against an embedding of std 1, and the successor head."""
        return replace(
            self,
            name=f"{self.name}-successor",
            init_std=0.002,
            embedding_std=1.0,
            successor_head=True,
        )

    def shrunk(self, factor: int) -> ScaleModel:
        """The same architecture with widths, depth and vocabulary divided by ``factor`` (head
        dims kept; depth and the feature layers kept inside the target)."""
        if factor == 1:
            return self
        layers = max(4, self.num_hidden_layers // factor // 4 * 4)
        vocab = max(1024, self.vocab_size // factor // 64 * 64)
        heads = max(2, self.num_attention_heads // factor)
        kv = max(1, self.num_key_value_heads // factor)
        heads -= heads % kv
        hybrid = dict(self.hybrid)
        if hybrid:
            hybrid["linear_num_key_heads"] = max(1, hybrid["linear_num_key_heads"] // factor)
            hybrid["linear_num_value_heads"] = 2 * hybrid["linear_num_key_heads"]
        return replace(
            self,
            name=f"{self.name}/{factor}",
            hidden_size=heads * self.head_dim,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=max(256, self.intermediate_size // factor),
            vocab_size=vocab,
            drafter_layers=1,
            drafter_heads=heads,
            drafter_kv_heads=kv,
            drafter_head_dim=self.head_dim,
            drafter_intermediate_size=max(256, self.drafter_intermediate_size // factor),
            target_layer_ids=(1, layers - 2),
            mask_token_id=vocab - 1,
            max_position_embeddings=4096,
            hybrid=hybrid,
        )

    @property
    def drafter_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def initializer_range(self) -> float:
        return self.init_std


QWEN3_8B = ScaleModel(
    name="qwen3-8b",
    architecture="Qwen3ForCausalLM",
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    rope_theta=1_000_000.0,
    drafter_layers=5,
    drafter_heads=32,
    drafter_kv_heads=8,
    drafter_head_dim=128,
    drafter_intermediate_size=12288,
    target_layer_ids=(1, 9, 17, 25, 33),
    mask_token_id=151669,
)


def qwen3_5_family(gdn_value_heads: int, **shapes) -> ScaleModel:
    """A Qwen3.5/3.6 dense hybrid (vLLM's ``Qwen3_5ForConditionalGeneration``) and its z-lab
    drafter: what the family shares (vocabulary, RoPE, the drafter's mask token and heads, the
    GatedDeltaNet layout: 16 key heads of 128, conv width 4, full attention every 4th layer)
    with the model's own ``shapes`` and ``gdn_value_heads``."""
    return ScaleModel(
        architecture="Qwen3_5ForConditionalGeneration",
        vocab_size=248320,
        rope_theta=10_000_000.0,
        drafter_layers=5,
        drafter_heads=32,
        drafter_kv_heads=8,
        drafter_head_dim=128,
        mask_token_id=248070,
        max_position_embeddings=262144,
        partial_rotary_factor=0.25,
        hybrid=dict(
            linear_num_key_heads=16,
            linear_num_value_heads=gdn_value_heads,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            full_attention_interval=4,
        ),
        **shapes,
    )


QWEN3_6_27B = qwen3_5_family(
    48,
    name="qwen3.6-27b",
    hidden_size=5120,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    intermediate_size=17408,
    drafter_intermediate_size=17408,
    target_layer_ids=(1, 16, 31, 46, 61),
)

QWEN3_5_9B = qwen3_5_family(
    32,
    name="qwen3.5-9b",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    intermediate_size=12288,
    drafter_intermediate_size=12288,
    target_layer_ids=(1, 8, 15, 22, 29),
)

SCALE_MODELS = {model.name: model for model in (QWEN3_8B, QWEN3_5_9B, QWEN3_6_27B)}


def _text_fields(model: ScaleModel) -> dict[str, Any]:
    """The text model's config fields: the tiny fixtures' (untied, no special tokens) at the
    model's shapes, GDN layers and partial rotary for hybrids."""
    fields = target_config_fields(model)
    if model.hybrid:
        fields.update(model.hybrid)
        fields["layer_types"] = hybrid_layer_types(
            model.num_hidden_layers, model.hybrid["full_attention_interval"]
        )
        fields["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": model.rope_theta,
            "partial_rotary_factor": model.partial_rotary_factor,
        }
    else:
        fields["rope_theta"] = model.rope_theta
    return fields


def target_config(model: ScaleModel):
    """The transformers config of the target (and the class that builds it)."""
    if not model.hybrid:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(**_text_fields(model))
        config.architectures = [model.architecture]
        return config, Qwen3ForCausalLM
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = qwen3_5_config(Qwen3_5Config, _text_fields(model))
    config.architectures = [model.architecture]
    return config, Qwen3_5ForConditionalGeneration


def drafter_config(model: ScaleModel) -> DFlashDrafterConfig:
    return DFlashDrafterConfig(
        hidden_size=model.drafter_hidden_size,
        num_hidden_layers=model.drafter_layers,
        num_attention_heads=model.drafter_heads,
        num_key_value_heads=model.drafter_kv_heads,
        head_dim=model.drafter_head_dim,
        intermediate_size=model.drafter_intermediate_size,
        vocab_size=model.vocab_size,
        mask_token_id=model.mask_token_id,
        target_layer_ids=list(model.target_layer_ids),
        target_hidden_size=model.hidden_size,
        block_size=model.block_size,
        num_target_layers=model.num_hidden_layers,
        rope_theta=model.rope_theta,
        max_position_embeddings=model.max_position_embeddings,
    )


def parameter_count(model: ScaleModel) -> int:
    """The target's parameters, counted on the meta device (nothing allocated)."""
    config, cls = target_config(model)
    with torch.device("meta"):
        built = cls(config)
    return sum(p.numel() for p in built.parameters())


def head_std(model: ScaleModel) -> float:
    """The output head's init std that gives logits of std ``LOGIT_STD``."""
    return LOGIT_STD / math.sqrt(model.hidden_size)


def _output_head(built: torch.nn.Module) -> torch.Tensor:
    head = built.get_output_embeddings()
    return head.weight


def _successor_head(built: torch.nn.Module, seed: int) -> None:
    """Output head row ``successor[t]`` = ``LOGIT_STD x`` the unit direction of token ``t``'s
    embedding (``successor``: a seeded permutation). Where the final hidden state points along
    the current token's embedding (small layers against a large embedding), the successor's
    logit is ``LOGIT_STD x sqrt(hidden)`` and every other token's ``LOGIT_STD x N(0, 1)``: a
    margin no bf16 rounding flips, even sampled at T = 1."""
    embedding = built.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(seed + 7)
    successor = torch.randperm(embedding.shape[0], generator=gen).to(embedding.device)
    directions = embedding.float() / embedding.float().norm(dim=1, keepdim=True)
    head = _output_head(built)
    head[successor] = (LOGIT_STD * directions).to(head.dtype)


SHARD_SIZE = "4GB"  # safetensors shard size of the saved checkpoints


def build_target(model: ScaleModel, path: str, device: str = "cpu", seed: int = 0) -> str:
    """Save the target under ``path`` (bf16 safetensors; kept when already there)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    config, cls = target_config(model)
    torch.manual_seed(seed)
    # Built in bf16 directly: a 27B target in float32 would not fit beside its bf16 copy.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            built = cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        if model.embedding_std is not None:
            built.get_input_embeddings().weight.normal_(0.0, model.embedding_std)
        if model.successor_head:
            _successor_head(built, seed)
        else:
            _output_head(built).normal_(0.0, head_std(model))
    built.generation_config.eos_token_id = None
    built.generation_config.pad_token_id = None
    # Shards of a few GB: a 27B target saved into memory-backed storage (/dev/shm) leaves room
    # for one shard's serialised copy beside the model, not for a 50 GB one.
    built.save_pretrained(path, max_shard_size=SHARD_SIZE)
    with open(os.path.join(path, "scale_model.json"), "w") as f:
        json.dump(
            {
                "scale_model": model.name,
                "seed": seed,
                "logit_std": LOGIT_STD,
                "init_std": model.init_std,
                "embedding_std": model.embedding_std,
                "successor_head": model.successor_head,
            },
            f,
        )
    return path


def build_drafter(model: ScaleModel, path: str, seed: int = 0) -> str:
    """Save the drafter under ``path`` in vLLM's DFlash checkpoint format."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    random_drafter(drafter_config(model), seed=seed, init_std=model.init_std).save_pretrained(path)
    return path


def build(model: ScaleModel, root: str, device: str = "cpu", seed: int = 0) -> tuple[str, str]:
    """The target and the drafter of ``model`` under ``root`` (``target/``, ``drafter/``)."""
    name = model.name.replace("/", "_")
    target = build_target(model, os.path.join(root, name, "target"), device, seed)
    drafter = build_drafter(model, os.path.join(root, name, "drafter"), seed + 1)
    return target, drafter
