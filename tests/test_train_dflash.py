"""The drafter training forward (benchmarks/train_dflash.py) computes what inference computes:
for every anchor of a batch, the same block logits as the DFlash reference draft source, which
is the network vLLM runs as ``DFlashDraftModel``."""

import json
import os

import pytest
import torch

from tests.benchmark_modules import load_benchmark
from vllm_ddtree.dflash_drafter import random_drafter
from vllm_ddtree.reference import DFlashDraftSource
from vllm_ddtree.testing import TinyQwen3Spec, tiny_drafter_config, tiny_qwen3_config


def load_train_module():
    return load_benchmark("train_dflash")


@pytest.fixture(scope="module")
def pair():
    from transformers import Qwen3ForCausalLM

    spec = TinyQwen3Spec(num_hidden_layers=3, hidden_size=128, intermediate_size=256)
    config = tiny_qwen3_config(spec)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(config).eval()
    cfg = tiny_drafter_config(spec, num_layers=2, target_layer_ids=[0, 2])
    drafter = random_drafter(cfg, seed=1, init_std=0.1).eval()
    return target, drafter


def test_batched_training_logits_equal_the_reference_drafter(pair):
    target, drafter = pair
    train = load_train_module()
    source = DFlashDraftSource(drafter, target)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([40, 29])
    tokens = torch.randint(0, 1000, (2, 40), generator=gen)
    anchors = torch.tensor([[1, 17, 38], [5, 20, 28]])
    with torch.no_grad():
        hidden = target(input_ids=tokens, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in source.feature_layers()], dim=-1)
        logits = train.drafter_block_logits(
            drafter,
            target.get_input_embeddings(),
            target.get_output_embeddings(),
            features,
            tokens,
            lengths,
            anchors,
        )
        for b in range(2):
            for j, anchor in enumerate(anchors[b].tolist()):
                # Inference: context = the target features of positions < anchor.
                source.reset()
                source.extend_context(
                    tokens[b, :anchor], features[b, :anchor], torch.arange(anchor)
                )
                want = source.draft_logits(int(tokens[b, anchor]), anchor)
                torch.testing.assert_close(logits[b, j], want, rtol=1e-4, atol=1e-4)


def test_labels_stop_at_each_sequence_end():
    train = load_train_module()
    tokens = torch.arange(20).view(2, 10)
    labels = train.block_labels(tokens, torch.tensor([10, 6]), torch.tensor([[2], [3]]), 4)
    assert labels.tolist() == [[[3, 4, 5]], [[14, 15, -100]]]


def test_training_runs_and_writes_a_vllm_dflash_checkpoint(tmp_path, pair):
    """Two CPU steps end to end from a responses file: checkpoint in vLLM's DFlash format."""
    target, _ = pair
    train = load_train_module()
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    work = tmp_path / "work"
    work.mkdir()
    gen = torch.Generator().manual_seed(0)
    with open(work / "responses.jsonl", "w") as f:
        for _ in range(12):
            prompt = torch.randint(0, 1000, (8,), generator=gen).tolist()
            response = torch.randint(0, 1000, (30,), generator=gen).tolist()
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    args = type("Args", (), {})()
    args.__dict__.update(
        target=str(target_dir),
        responses=str(work / "responses.jsonl"),
        out=str(tmp_path / "drafter"),
        layers=1,
        feature_layers="0,2",
        minutes=0.0,
        batch_size=2,
        anchors=3,
        max_len=64,
        lr=1e-3,
        warmup=1,
        validation=4,
        validation_batches=1,
        seed=0,
        device="cpu",
    )
    record = train.train(args)
    assert len(record["validation_top1_accuracy_per_position"]) == 15
    with open(tmp_path / "drafter" / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert os.path.isfile(tmp_path / "drafter" / "model.safetensors")


def test_training_time_is_cut_to_finish_within_the_limit():
    module = load_train_module()
    training_seconds, reserve = module.training_seconds, module.FINISH_RESERVE_SECONDS
    assert training_seconds(4.5, None, 300.0) == 270.0
    # 250 s of generation before training, 520 s allowed: train for what is left.
    assert training_seconds(4.5, 520.0, 250.0) == 520.0 - 250.0 - reserve
    assert training_seconds(4.5, 520.0, 600.0) == 0.0
