"""The GatedDeltaNet tree-op bench (``benchmarks/bench_hybrid_ops.py``) on the CPU: its cases
and report, through the PyTorch references on a shrunk hybrid."""

from __future__ import annotations

import json

import torch

from benchmarks import bench_hybrid_ops
from vllm_ddtree.testing.scale_models import SCALE_MODELS


def test_the_27b_shapes_give_48_gdn_layers_of_its_heads():
    shapes = bench_hybrid_ops.gdn_shapes(SCALE_MODELS["qwen3.6-27b"])
    heads = (shapes.num_k_heads, shapes.num_v_heads, shapes.head_k_dim, shapes.head_v_dim)
    assert heads == (16, 48, 128, 128)
    assert shapes.num_gdn_layers == 48 and shapes.conv_dim == 10240 and shapes.conv_kernel == 4


def test_a_budgets_tree_has_its_nodes_and_every_parent_before_its_child():
    for budget in (16, 64):
        parents = bench_hybrid_ops.tree_parents(budget)
        assert parents.numel() == budget + 1 and parents[0] == -1
        assert bool((parents[1:] < torch.arange(1, budget + 1)).all())
        assert bool((parents[1:] >= 0).all())
        assert int(parents.max()) > 0, "the tree is deeper than one level"
    assert bench_hybrid_ops.chain_parents().tolist() == list(range(-1, 15))


def test_the_cpu_run_reports_every_case_and_op(tmp_path):
    out = tmp_path / "ops"
    assert (
        bench_hybrid_ops.main(
            [
                "--cpu",
                "--budgets",
                "8,16",
                "--block-v",
                "8,32",
                "--num-warps",
                "2,4",
                "--replays",
                "1",
                "--rounds",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads((out / "hybrid_ops.json").read_text())
    cases = {(r["case"], r["op"], r["block_v"], r["num_warps"]) for r in summary["rows"]}
    for case in ("chain", "b8", "b16"):
        launches = {(case, "tree recurrence", b, w) for b in (8, 32) for w in (2, 4)}
        assert launches <= cases
        assert (case, "tree conv", None, None) in cases
    for case in ("b8", "b16"):  # the commit on the CPU: the PyTorch ops only
        assert (case, "commit, PyTorch ops (eager)", None, None) in cases
    assert all(r["model_ms"] == r["layer_ms"] * summary["layers"] for r in summary["rows"])
    report = (out / "hybrid_ops.md").read_text()
    assert "| b16 | 17 | tree conv | - |" in report
    assert "| b16 | 17 | tree recurrence | 32 / 2 |" in report


def test_vllms_chain_recurrence_reads_a_live_state_and_writes_one_per_token(monkeypatch):
    """Run on a GPU only (vLLM's kernel is Triton): here its call is checked against vLLM's
    signature and against what its kernel does with the indices. It starts from block
    ``ssm_state_indices[r, num_accepted_tokens[r] - 1]`` and returns at once where that block
    is 0 (vLLM's null block), and stores token ``t``'s state to block ``[r, t]`` where that is
    not 0: the chain's verify stores every token's state, so every block here must be live."""
    import inspect

    from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating

    calls = []

    def update(*args, **kwargs):
        inspect.signature(fused_sigmoid_gating.fused_sigmoid_gating_delta_rule_update).bind(
            *args, **kwargs
        )
        calls.append(kwargs)
        return kwargs["v"], None

    monkeypatch.setattr(fused_sigmoid_gating, "fused_sigmoid_gating_delta_rule_update", update)
    shapes = bench_hybrid_ops.gdn_shapes(SCALE_MODELS["qwen3.6-27b"].shrunk(16))
    bench_hybrid_ops.vllm_chain_recurrence(shapes, torch.device("cpu"))()
    (kwargs,) = calls
    chain = bench_hybrid_ops.CHAIN_TOKENS
    blocks, accepted = kwargs["ssm_state_indices"], kwargs["num_accepted_tokens"]
    assert blocks.shape == (1, chain) and kwargs["cu_seqlens"].tolist() == [0, chain]
    assert int(blocks[0, int(accepted[0]) - 1]) > 0, "the kernel starts from the null block"
    assert bool((blocks > 0).all()) and len(set(blocks.flatten().tolist())) == chain
    assert int(blocks.max()) < kwargs["initial_state"].shape[0]
    assert kwargs["inplace_final_state"] and kwargs["v"].shape[1] == chain


def test_vllms_chain_conv_is_called_as_its_gdn_layer_calls_it(monkeypatch):
    """Run on a GPU only (vLLM's kernel is Triton): here its call is checked against vLLM's
    signature, the window the chain's drafts need and the speculative arguments."""
    import inspect

    from vllm.model_executor.layers.mamba.ops import causal_conv1d

    calls = []

    def update(*args, **kwargs):
        inspect.signature(causal_conv1d.causal_conv1d_update).bind(*args, **kwargs)
        calls.append((args, kwargs))
        return args[0]

    monkeypatch.setattr(causal_conv1d, "causal_conv1d_update", update)
    shapes = bench_hybrid_ops.gdn_shapes(SCALE_MODELS["qwen3.6-27b"].shrunk(16))
    bench_hybrid_ops.vllm_chain_conv(shapes, torch.device("cpu"))()
    ((args, kwargs),) = calls
    x, conv_state = args[0], args[1]
    chain = bench_hybrid_ops.CHAIN_TOKENS
    assert x.shape == (chain, shapes.conv_dim)
    assert conv_state.shape[1:] == (shapes.conv_dim, shapes.conv_kernel - 1 + chain - 1)
    assert kwargs["max_query_len"] == chain and kwargs["query_start_loc"].tolist() == [0, chain]


def test_the_commit_case_walks_the_deepest_path_into_a_block_of_its_own():
    parents = bench_hybrid_ops.tree_parents(16)
    path = bench_hybrid_ops.deepest_path(parents)
    assert path[0] == 0 and len(path) > 2
    assert all(int(parents[child]) == parent for parent, child in zip(path, path[1:], strict=False))
    shapes = bench_hybrid_ops.gdn_shapes(SCALE_MODELS["qwen3.6-27b"].shrunk(16))
    (commit,) = bench_hybrid_ops.model_commit(shapes, parents, torch.device("cpu")).values()
    layers = commit.args[0]
    commit()  # the leaf's state (block 1) copied to the destination (block 2)
    assert layers.num_layers == shapes.num_gdn_layers
    assert all(torch.equal(s[2], s[1]) for s in layers.ssm_states)
