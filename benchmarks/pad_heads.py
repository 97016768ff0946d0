"""Zero-pad a checkpoint's attention heads so that tensor parallelism can shard it.

SmolLM2-135M-Instruct has 9 query / 3 KV heads: vLLM cannot split them over 2 GPUs. Adding
whole KV groups (here 1, giving 12 / 4) with zero ``q``/``k``/``v`` rows and zero ``o_proj``
columns leaves the function unchanged: a padded head attends uniformly over zero values and its
output meets zero ``o_proj`` weights, so every hidden state, logit and DFlash target feature is
the original's (up to the order of float additions in the wider ``o_proj`` GEMM). The DFlash
drafter is padded the same way (its ``q_norm``/``k_norm`` act per head dim and stay as they are).

Works on any single-file HF checkpoint whose attention weights are named
``...self_attn.{q,k,v,o}_proj.{weight,bias}`` (Llama / Qwen3 layout, and vLLM's DFlash drafter
format); ``config.json`` gets the new head counts and an explicit ``head_dim``.

    python -m benchmarks.pad_heads SRC DST --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_NAME = "model.safetensors"


def padded_head_counts(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int]:
    """``(query heads, KV heads)`` after adding whole KV groups until ``tp`` divides the KV
    heads (a query-to-KV group keeps its size, so ``tp`` divides the query heads too)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    group = num_heads // num_kv_heads
    kv = -(-num_kv_heads // tp) * tp
    return kv * group, kv


def pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` ``[r, ...]`` -> ``[rows, ...]`` with zero rows appended (same dtype)."""
    extra = weight.new_zeros((rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, extra], dim=0)


def pad_attention_state(
    state: dict[str, torch.Tensor],
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    new_heads: int,
    new_kv_heads: int,
) -> dict[str, torch.Tensor]:
    """Every ``self_attn`` projection of ``state`` padded: ``q_proj`` ``[H*d, hidden]`` ->
    ``[H'*d, hidden]``, ``k_proj``/``v_proj`` ``[KV*d, hidden]`` -> ``[KV'*d, hidden]`` (zero rows
    appended: the new heads come after the old ones, in new KV groups), ``o_proj``
    ``[hidden, H*d]`` -> ``[hidden, H'*d]`` (zero columns). Other tensors are returned as they
    are."""
    rows = {"q_proj": (num_heads, new_heads), "k_proj": (num_kv_heads, new_kv_heads)}
    rows["v_proj"] = rows["k_proj"]
    out = {}
    for name, tensor in state.items():
        parts = name.split(".")
        projection = parts[-2] if len(parts) >= 2 else ""
        if "self_attn" not in parts:
            out[name] = tensor
        elif projection in rows:
            old, new = rows[projection]
            if tensor.shape[0] != old * head_dim:
                raise ValueError(f"{name}: {tuple(tensor.shape)} is not {old} heads x {head_dim}")
            out[name] = pad_rows(tensor, new * head_dim)
        elif projection == "o_proj" and parts[-1] == "weight":
            if tensor.shape[1] != num_heads * head_dim:
                raise ValueError(f"{name}: {tuple(tensor.shape)} is not {num_heads} heads")
            out[name] = pad_rows(tensor.t(), new_heads * head_dim).t().contiguous()
        else:
            out[name] = tensor
    return out


def pad_checkpoint(src: str, dst: str, tp: int) -> dict:
    """Write ``src`` (an HF checkpoint folder, one ``model.safetensors``) to ``dst`` with heads
    padded for ``tp``; other files (tokenizer, generation config) are copied. Returns the new
    ``config.json`` dict."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    kv_heads = kv_heads or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    new_heads, new_kv = padded_head_counts(heads, kv_heads, tp)
    state = load_file(os.path.join(src, WEIGHTS_NAME))
    padded = pad_attention_state(state, head_dim, heads, kv_heads, new_heads, new_kv)
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name not in ("config.json", WEIGHTS_NAME) and os.path.isfile(path):
            shutil.copy(path, os.path.join(dst, name))
    config.update(num_attention_heads=new_heads, num_key_value_heads=new_kv, head_dim=head_dim)
    config["padded_heads"] = {"from": [heads, kv_heads], "tensor_parallel_size": tp}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(padded, os.path.join(dst, WEIGHTS_NAME), metadata={"format": "pt"})
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size to shard for")
    args = parser.parse_args()
    config = pad_checkpoint(args.src, args.dst, args.tp)
    print(
        f"{args.dst}: {config['num_attention_heads']} query / {config['num_key_value_heads']} "
        f"KV heads (from {config['padded_heads']['from']})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
