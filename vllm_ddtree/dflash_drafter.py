"""A plain PyTorch DFlash block-diffusion drafter, in vLLM's DFlash checkpoint format.

The same network vLLM 0.26.0 runs as ``DFlashDraftModel`` (``qwen3_dflash.py``): target hidden
states of ``dflash_config.target_layer_ids`` are concatenated, fused by ``fc`` and normalised by
``hidden_norm``; every draft layer takes K/V from those context features and from the block
tokens, Q from the block tokens only, with non-causal attention inside the block. Block tokens
are ``[bonus, mask x (block_size - 1)]`` embedded with the target's embedding; outputs go through
``norm`` and the target's LM head (the drafter's own when the checkpoint has one).

Checkpoint layout (what vLLM's ``DFlashQwen3ForCausalLM.load_weights`` reads): ``config.json``
with ``architectures: ["DFlashDraftModel"]``, ``dflash_config`` and ``block_size``;
``model.safetensors`` with ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and
``layers.{i}.{self_attn.{q,k,v,o}_proj,self_attn.{q,k}_norm,mlp.{gate,up,down}_proj,
input_layernorm,post_attention_layernorm}.weight`` (optional ``embed_tokens``/``lm_head``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

WEIGHTS_NAME = "model.safetensors"


@dataclass
class DFlashDrafterConfig:
    """The fields of a DFlash drafter's ``config.json`` this module uses."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    head_dim: int | None = None
    target_hidden_size: int | None = None
    block_size: int = 16
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_target(
        cls, target: Any, num_layers: int, target_layer_ids: list[int], **fields: Any
    ) -> DFlashDrafterConfig:
        """A drafter shaped like ``target`` (an HF config or any object with its attribute
        names): the target's hidden size, heads, head dim, MLP width and vocabulary, the last
        vocabulary id as mask token; ``fields`` set the rest (block size, RoPE, eps, ...)."""
        head_dim = getattr(target, "head_dim", None) or (
            target.hidden_size // target.num_attention_heads
        )
        return cls(
            hidden_size=target.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=target.intermediate_size,
            vocab_size=target.vocab_size,
            mask_token_id=target.vocab_size - 1,
            target_layer_ids=target_layer_ids,
            num_target_layers=target.num_hidden_layers,
            **fields,
        )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features ``fc`` takes."""
        return (self.target_hidden_size or self.hidden_size) * len(self.target_layer_ids)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` vLLM's DFlash path loads."""
        out = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.resolved_head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.target_hidden_size is not None:
            out["target_hidden_size"] = self.target_hidden_size
        out.update(self.extra)
        return out

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> DFlashDrafterConfig:
        dflash = cfg.get("dflash_config")
        if not isinstance(dflash, dict):
            raise ValueError("not a DFlash drafter config: no 'dflash_config'")
        rope = cfg.get("rope_parameters") or {}
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=list(dflash["target_layer_ids"]),
            head_dim=cfg.get("head_dim"),
            target_hidden_size=cfg.get("target_hidden_size"),
            block_size=cfg.get("block_size", dflash.get("block_size", 16)),
            num_target_layers=cfg.get("num_target_layers"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 1_000_000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            hidden_act=cfg.get("hidden_act", "silu"),
            attention_bias=cfg.get("attention_bias", False),
        )


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` over its last dim divided by its root mean square (in float32), back in ``x``'s
    dtype: Qwen3's RMSNorm before its weight."""
    normalized = x.float()
    normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + eps)
    return normalized.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding. ``x``: ``[T, heads, head_dim]``; ``positions``: long ``[T]``."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim)
    )
    angles = positions.float().unsqueeze(-1) * inv_freq  # [T, head_dim / 2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(1)
    sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        hd = cfg.resolved_head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.rope_theta = cfg.rope_theta
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def key_value(
        self, states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V ``[T, kv_heads, head_dim]`` of ``states`` ``[T, hidden]``."""
        k = self.k_norm(self.k_proj(states).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(states).view(-1, self.num_kv_heads, self.head_dim)
        return apply_rope(k, positions, self.rope_theta), v

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
    ) -> torch.Tensor:
        q = self.q_norm(self.q_proj(hidden).view(-1, self.num_heads, self.head_dim))
        q = apply_rope(q, positions, self.rope_theta)
        k, v = self.key_value(hidden, positions)
        k = torch.cat([context_k, k], 0)
        v = torch.cat([context_v, v], 0)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        # Non-causal: every block query sees the whole context and the whole block.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=False
        )
        return self.o_proj(out.transpose(0, 1).reshape(hidden.shape[0], -1))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, positions, context_k, context_v):
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), positions, context_k, context_v
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    """The DFlash draft network (no embedding/LM head unless the checkpoint has them)."""

    def __init__(self, cfg: DFlashDrafterConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: nn.Linear | None = None

    def context_states(self, target_features: torch.Tensor) -> torch.Tensor:
        """``[T, feature_size]`` concatenated target hidden states -> ``[T, hidden]`` context."""
        return self.hidden_norm(self.fc(target_features))

    def context_kv(
        self, target_features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, the K/V ``[T, kv_heads, head_dim]`` the context contributes."""
        ctx = self.context_states(target_features)
        return [layer.self_attn.key_value(ctx, positions) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Draft hidden states ``[Q, hidden]`` for block embeddings ``[Q, hidden]``."""
        hidden = block_embeds
        for layer, (ck, cv) in zip(self.layers, context_kv, strict=True):
            hidden = layer(hidden, block_positions, ck, cv)
        return self.norm(hidden)

    # --- checkpoint I/O in vLLM's DFlash format ---
    def save_pretrained(self, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
        os.makedirs(path, exist_ok=True)
        cfg = self.config.to_hf_dict()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
        with open(os.path.join(path, "config.json")) as f:
            cfg = DFlashDrafterConfig.from_hf_dict(json.load(f))
        model = cls(cfg)
        state = load_file(os.path.join(path, WEIGHTS_NAME))
        if "embed_tokens.weight" in state:
            model.embed_tokens = nn.Embedding(*state["embed_tokens.weight"].shape)
        if "lm_head.weight" in state:
            vocab, hidden = state["lm_head.weight"].shape
            model.lm_head = nn.Linear(hidden, vocab, bias=False)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"DFlash checkpoint {path}: missing weights {missing}, unexpected {unexpected}"
            )
        return model.to(dtype)


def random_drafter(
    cfg: DFlashDrafterConfig, seed: int = 0, init_std: float = 0.02
) -> DFlashDrafter:
    """A DFlash drafter with seeded random weights (tests, demos without a trained drafter)."""
    gen = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * init_std)
    return model
