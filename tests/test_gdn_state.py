"""GDN tree-state memory: shapes from Qwen3-Next / Qwen3.5 configs, the two layouts' sizes, and
the start-up check's message."""

import pytest
from transformers import Qwen3_5Config, Qwen3NextConfig

from vllm_ddtree.config import MAX_TREE_BUDGET, DDTreeConfigError
from vllm_ddtree.hybrid.gdn_state import (
    GIB,
    GDNStateShapes,
    check_scratch_fits,
    largest_fitting_budget,
    scratch_layout_bytes,
    slot_layout_bytes,
    ssm_state_bytes,
)

# 48 layers, one full-attention layer in 4: 36 GDN layers of 16 key / 32 value heads of 128.
NEXT = Qwen3NextConfig(num_hidden_layers=48, full_attention_interval=4)


def test_shapes_from_qwen3_next_and_sharded_heads():
    shapes = GDNStateShapes.from_hf_config(NEXT)
    assert (shapes.num_gdn_layers, shapes.num_k_heads, shapes.num_v_heads) == (36, 16, 32)
    assert shapes.conv_dim == 2 * 16 * 128 + 32 * 128
    assert ssm_state_bytes(shapes) == 32 * 128 * 128 * 4
    half = GDNStateShapes.from_hf_config(NEXT, tensor_parallel_size=2)
    assert (half.num_k_heads, half.num_v_heads) == (8, 16)
    with pytest.raises(DDTreeConfigError, match="linear_num_key_heads=16.*tensor_parallel_size=3"):
        GDNStateShapes.from_hf_config(NEXT, tensor_parallel_size=3)


def test_shapes_from_a_multimodal_qwen3_5_config_read_its_text_config():
    config = Qwen3_5Config(
        text_config={"num_hidden_layers": 8, "linear_num_value_heads": 48, "layer_types": None}
    )
    shapes = GDNStateShapes.from_hf_config(config)
    assert (shapes.num_gdn_layers, shapes.num_v_heads) == (6, 48)


def test_persistent_slots_per_node_cost_far_more_than_the_shared_scratch():
    shapes = GDNStateShapes.from_hf_config(NEXT)
    slots = slot_layout_bytes(shapes, max_num_seqs=16, tree_budget=64)
    scratch = scratch_layout_bytes(shapes, max_num_seqs=16, tree_budget=64)
    # Slots: 16 x 65 blocks of 36 layers x (2 MiB SSM + a 67-wide bf16 conv window).
    per_block = 36 * (32 * 128 * 128 * 4 + shapes.conv_dim * 67 * 2)
    assert slots == 16 * 65 * per_block
    # Scratch: 1040 nodes' float32 states of one layer + every layer's bf16 node inputs.
    assert scratch == 1040 * 32 * 128 * 128 * 4 + 1040 * 36 * (shapes.conv_dim + 64) * 2
    assert slots > 40 * scratch and scratch < 3 * GIB


def test_largest_fitting_budget_is_the_edge_of_the_scratch_cost():
    shapes = GDNStateShapes.from_hf_config(NEXT, tensor_parallel_size=2)
    available = 4 * GIB
    fits = largest_fitting_budget(shapes, 32, available)
    assert 1 <= fits < MAX_TREE_BUDGET
    assert scratch_layout_bytes(shapes, 32, fits) <= available
    assert scratch_layout_bytes(shapes, 32, fits + 1) > available
    assert largest_fitting_budget(shapes, 32, 1) == 0
    assert largest_fitting_budget(shapes, 1, 100 * GIB) == MAX_TREE_BUDGET


def test_check_names_the_budget_that_fits():
    shapes = GDNStateShapes.from_hf_config(NEXT)
    check_scratch_fits(shapes, 16, 64, available_bytes=8 * GIB)  # fits: no error
    fits = largest_fitting_budget(shapes, 64, 8 * GIB)
    with pytest.raises(DDTreeConfigError) as error:
        check_scratch_fits(shapes, 64, 1024, available_bytes=8 * GIB)
    message = str(error.value)
    assert "tree_budget=1024 with max_num_seqs=64" in message
    assert f"tree_budget <= {fits} fits" in message and "36 GDN layers" in message
    with pytest.raises(DDTreeConfigError, match="no tree_budget fits; lower max_num_seqs"):
        check_scratch_fits(shapes, 64, 8, available_bytes=GIB // 1024)


def test_the_tiny_hybrid_target_is_a_qwen3_next_with_real_gdn_head_shapes(tmp_path):
    from transformers import AutoConfig

    from vllm_ddtree.testing import TinyQwen3Spec, make_tiny_qwen3_next

    path = make_tiny_qwen3_next(str(tmp_path / "hybrid"), TinyQwen3Spec(num_hidden_layers=4))
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["Qwen3NextForCausalLM"] and not config.tie_word_embeddings
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    shapes = GDNStateShapes.from_hf_config(config)
    assert (shapes.num_gdn_layers, shapes.head_k_dim, shapes.head_v_dim) == (3, 128, 128)
    # vLLM's packed GDN decode needs more value heads than key heads (contiguous a/b rows).
    assert config.linear_num_value_heads == 2 * config.linear_num_key_heads


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_the_tiny_qwen3_5_classes_are_what_vllm_serves_them_with(arch, tmp_path):
    """The Qwen3.5/3.6 fixtures (``lossless_gpu.py --hybrid --hybrid-arch qwen3_5`` or
    ``qwen3_5_moe``): the multimodal classes vLLM 0.26.0 maps those checkpoints to, whose text
    model has the Qwen3-Next fixture's GDN layout, untied embeddings and a vision tower text
    prompts never run; the MoE one routes every token to all its experts, saved one per name
    as the released checkpoints hold them (what vLLM's expert loader reads)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from vllm_ddtree import testing
    from vllm_ddtree.config import GDN_TREE_ARCHITECTURES

    make, architecture = testing.HYBRID_TARGETS[arch]
    path = make(str(tmp_path / arch), testing.TinyQwen3Spec(num_hidden_layers=4))
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [architecture] and architecture in GDN_TREE_ARCHITECTURES
    text = config.text_config
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert not text.tie_word_embeddings and text.vocab_size == testing.TinyQwen3Spec().vocab_size
    shapes = GDNStateShapes.from_hf_config(config)
    assert (shapes.num_gdn_layers, shapes.num_k_heads, shapes.num_v_heads) == (3, 2, 4)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and "model.language_model.embed_tokens.weight" in names
    assert any(name.startswith("model.visual.") for name in names)
    if arch == "qwen3_5_moe":
        assert text.num_experts_per_tok == text.num_experts == 4
        mlp = "model.language_model.layers.0.mlp"
        assert {f"{mlp}.experts.{e}.gate_proj.weight" for e in range(4)} <= names
        assert f"{mlp}.shared_expert.up_proj.weight" in names and f"{mlp}.gate.weight" in names


def test_bf16_states_halve_the_slot_layout_and_the_check_names_them():
    """``mamba_ssm_cache_dtype`` bfloat16: 2 bytes per SSM state element, so the check admits
    what float32 states could not, and names the dtype when it refuses."""
    from vllm_ddtree.hybrid.gdn_state import check_slot_layout_fits

    shapes = GDNStateShapes.from_hf_config(NEXT, tensor_parallel_size=2)
    float_bytes = slot_layout_bytes(shapes, 4, 32, ssm_bytes=4)
    bf16_bytes = slot_layout_bytes(shapes, 4, 32, ssm_bytes=2)
    # 4 requests x 33 blocks x every GDN layer's SSM state, at half the bytes.
    assert float_bytes - bf16_bytes == 4 * 33 * shapes.num_gdn_layers * ssm_state_bytes(shapes, 2)
    check_slot_layout_fits(shapes, 4, 32, bf16_bytes, ssm_bytes=2)  # fits: no error
    with pytest.raises(DDTreeConfigError, match="128x128 float32 plus the conv window"):
        check_slot_layout_fits(shapes, 4, 32, bf16_bytes, ssm_bytes=4)
    with pytest.raises(DDTreeConfigError, match="128x128 bfloat16 plus the conv window"):
        check_slot_layout_fits(shapes, 4, 32, bf16_bytes - 1, ssm_bytes=2)
