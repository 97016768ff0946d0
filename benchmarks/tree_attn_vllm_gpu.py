"""TREE_ATTN inside vLLM on a GPU: same tokens as vLLM's own backends, eager and CUDA graphs.

Engines (one after another in this process, tiny random Qwen3 with sharp logits, greedy):
TRITON_ATTN float32 eager; TREE_ATTN float32 eager and with CUDA graphs; "method": "ddtree"
(TREE_ATTN chosen automatically for the target) float32 with CUDA graphs; FLASH_ATTN and
TREE_ATTN bf16 with CUDA graphs. References: HF transformers float32 greedy decoding on the
GPU (IEEE float32 matmuls) and the other engines. The TREE_ATTN float32 engines must agree with
each other and with the HF reference; other pairs are reported with the first divergence and
the target's top-2 logit gap there (TRITON_ATTN's float32 dots run in tf32, and bf16 near-ties
flip between two correct kernels). Writes JSON; exits non-zero when a must-match pair differs.

    python -m benchmarks.tree_attn_vllm_gpu --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time


def run_engine(target: str, prompts, max_tokens: int, **kwargs) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.time()
    llm = LLM(
        model=target,
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=16,
        gpu_memory_utilization=0.15,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    # Warm-up over the same batch, so Triton compiles every launch variant before timing.
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    t0 = time.time()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    elapsed = time.time() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    backend = llm.llm_engine.vllm_config.attention_config.backend
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "tokens": tokens,
        "backend": backend.name if backend else "auto",
        "tok_per_s": sum(map(len, tokens)) / elapsed,
        "engine_s": time.time() - start,
    }


def hf_greedy(target: str, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy continuations from HF transformers in IEEE float32 on the GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda().eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            generated = model.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )
            out.append(generated[0, len(prompt) :].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def first_divergence(a, b):
    for p, (x, y) in enumerate(zip(a, b, strict=True)):
        for i, (s, t) in enumerate(zip(x, y, strict=True)):
            if s != t:
                return p, i
    return None


def logit_gap(target: str, prompt: list[int], prefix: list[int]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + prefix], device=device)).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work", default="/tmp/vllm-ddtree-gpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from benchmarks.common import git_commit
    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_dflash, make_tiny_qwen3

    spec = TinyQwen3Spec(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    target = make_tiny_qwen3(os.path.join(args.work, "target"), spec)
    drafter = make_tiny_dflash(os.path.join(args.work, "drafter"), spec)
    prompts = [[(7 * p + 3 * i) % 1000 + 1 for i in range(8 + 5 * p)] for p in range(args.prompts)]
    graphs = {"enforce_eager": False}
    eager = {"enforce_eager": True}
    f32 = {"dtype": "float32"}
    runs = {
        "triton_f32_eager": {**f32, **eager, "attention_backend": "TRITON_ATTN"},
        "tree_f32_eager": {**f32, **eager, "attention_backend": "TREE_ATTN"},
        "tree_f32_graphs": {**f32, **graphs, "attention_backend": "TREE_ATTN"},
        "flash_bf16_graphs": {"dtype": "bfloat16", **graphs, "attention_backend": "FLASH_ATTN"},
        "tree_bf16_graphs": {"dtype": "bfloat16", **graphs, "attention_backend": "TREE_ATTN"},
        "ddtree_f32_graphs": {
            **f32,
            **graphs,
            "speculative_config": {"method": "ddtree", "model": drafter, "tree_budget": 16},
            "max_num_batched_tokens": 16 * 16 + 64,
        },
    }
    results = {}
    for name, kwargs in runs.items():
        try:
            results[name] = run_engine(target, prompts, args.max_tokens, **kwargs)
        except Exception as exc:  # noqa: BLE001 - record and go on with the other engines
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(name, {k: v for k, v in results[name].items() if k != "tokens"}, flush=True)

    results["hf_f32"] = {"tokens": hf_greedy(target, prompts, args.max_tokens)}
    comparisons = []
    for candidate, reference, exact in [
        ("tree_f32_eager", "hf_f32", True),
        ("tree_f32_graphs", "tree_f32_eager", True),
        ("ddtree_f32_graphs", "tree_f32_eager", True),
        ("triton_f32_eager", "hf_f32", False),
        ("tree_f32_eager", "triton_f32_eager", False),
        ("tree_bf16_graphs", "flash_bf16_graphs", False),
    ]:
        a, b = results.get(candidate, {}), results.get(reference, {})
        row = {"candidate": candidate, "reference": reference, "must_match": exact}
        if "tokens" not in a or "tokens" not in b:
            row["identical"] = False
            row["note"] = "an engine failed"
        else:
            where = first_divergence(a["tokens"], b["tokens"])
            row["identical"] = where is None
            if where is not None:
                p, i = where
                row["first_divergence"] = {"prompt": p, "token": i}
                row["logit_gap"] = logit_gap(target, prompts[p], b["tokens"][p][:i])
        comparisons.append(row)
        print(json.dumps(row), flush=True)

    os.makedirs(args.out, exist_ok=True)
    summary = {
        "commit": git_commit(),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "target": spec.__dict__,
        "engines": {
            k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()
        },
        "comparisons": comparisons,
    }
    with open(os.path.join(args.out, "tree_attn_vllm_gpu.json"), "w") as f:
        json.dump(summary, f, indent=1)
    failed = [c for c in comparisons if c["must_match"] and not c["identical"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
