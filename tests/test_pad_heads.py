"""benchmarks/pad_heads.py: zero-padded attention heads leave a target and a DFlash drafter
computing what they computed (float32), with head counts that tensor parallelism can split."""

import json
import os

import pytest
import torch

from tests.benchmark_modules import load_benchmark
from vllm_ddtree.dflash_drafter import DFlashDrafter, DFlashDrafterConfig, random_drafter

pad_heads = load_benchmark("pad_heads")


def test_padded_head_counts():
    assert pad_heads.padded_head_counts(9, 3, 2) == (12, 4)  # SmolLM2 at TP = 2
    assert pad_heads.padded_head_counts(9, 3, 3) == (9, 3)  # already shards
    assert pad_heads.padded_head_counts(8, 2, 4) == (16, 4)
    with pytest.raises(ValueError, match="do not group"):
        pad_heads.padded_head_counts(9, 2, 2)


@pytest.mark.parametrize("attention_bias", [False, True])
def test_padded_llama_target_has_the_same_logits(tmp_path, attention_bias):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.5,
        tie_word_embeddings=True,
        attention_bias=attention_bias,  # q/k/v biases get zero entries for the new heads
    )
    model = LlamaForCausalLM(config).eval()
    if attention_bias:
        with torch.no_grad():  # nonzero biases, so that the padding is tested
            for name, param in model.named_parameters():
                if name.endswith("proj.bias"):
                    param.normal_()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    model.save_pretrained(src)
    new_config = pad_heads.pad_checkpoint(src, dst, tp=2)
    assert (new_config["num_attention_heads"], new_config["num_key_value_heads"]) == (8, 4)
    padded = LlamaForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    assert padded.model.layers[0].self_attn.o_proj.weight.shape == (96, 8 * 16)
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        want = model(ids).logits
        got = padded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padded_dflash_drafter_drafts_the_same(tmp_path):
    cfg = DFlashDrafterConfig(
        hidden_size=72,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=8,
        intermediate_size=96,
        vocab_size=64,
        mask_token_id=63,
        target_layer_ids=[0, 2],
    )
    drafter = random_drafter(cfg, seed=1, init_std=0.2)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    drafter.save_pretrained(src, dtype=torch.float32)
    pad_heads.pad_checkpoint(src, dst, tp=2)
    with open(os.path.join(dst, "config.json")) as f:
        saved = json.load(f)
    assert (saved["num_attention_heads"], saved["num_key_value_heads"]) == (12, 4)
    assert saved["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [0, 2]}
    padded = DFlashDrafter.from_pretrained(dst)
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(11, cfg.feature_size, generator=gen)
    block = torch.randn(5, cfg.hidden_size, generator=gen)
    with torch.no_grad():
        want = drafter(block, torch.arange(11, 16), drafter.context_kv(features, torch.arange(11)))
        got = padded(block, torch.arange(11, 16), padded.context_kv(features, torch.arange(11)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
