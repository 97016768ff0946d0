"""Compile the project's Triton kernels for an NVIDIA architecture on a machine without a GPU.

``python -m tests.helpers.compile_kernels [--arch 90]`` calls each case's launcher (below) with
CPU tensors of the shapes and dtypes serving passes, under a driver that only compiles: every
kernel launch is compiled for ``sm_<arch>`` down to a cubin (Triton's own ptxas) and not run.
It prints one JSON line per compiled kernel: the case, the kernel, its dynamic shared memory
(Triton's allocation), warps, and the cubin's resource usage from ``cuobjdump`` (registers
per thread, stack and local memory: spills). Triton's interpreter, which the CPU tests run the
kernels under, never compiles them: a kernel it passes can still fail to compile, or spill,
on the GPU. ``tests/test_kernels_compile.py`` runs this in a fresh process (the compile-only
driver replaces Triton's active driver for the whole process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import torch

from benchmarks.bench_hybrid_ops import gdn_shapes
from vllm_ddtree.testing.scale_models import SCALE_MODELS, ScaleModel

# The served shapes: the scale models' (vllm_ddtree/testing/scale_models.py).
HYBRID = SCALE_MODELS["qwen3.6-27b"]
HYBRID_GDN = gdn_shapes(HYBRID)
DEPTH = HYBRID.block_size - 1  # a DFlash drafter's block: the bonus token, then its depths
# vLLM's attention block size on each target (the hybrid's: its page size made the GDN
# state's, as the 27B engines' log reads).
KV_BLOCK_SIZE = {"qwen3-8b": 16, "qwen3.6-27b": 864}


class CompileOnlyDriver:
    """What ``JITFunction.run`` asks Triton's active driver for, on a machine without one."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def compiling_for(arch: int) -> Iterator[list]:
    """Within: every Triton launch compiles for ``sm_<arch>`` and returns without running;
    yields the list of ``(kernel name, CompiledKernel)`` it fills."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list = []
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    driver.set_active(CompileOnlyDriver(arch))
    JITFunction.run = compile_only
    try:
        yield compiled
    finally:
        JITFunction.run = original


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump --dump-resource-usage`` of one kernel's cubin: REG, STACK, SHARED, LOCAL."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


# Cases: each calls launchers as serving calls them, with CPU tensors (never read: nothing runs).


def _gdn_packed(budget: int, rows: int = 4):
    """vLLM's speculative GDN call at Qwen3.6-27B's GDN heads: q/k/v views of one bf16 conv
    output, a/b views of one bf16 projection, the float32 SSM cache ``[blocks, Hv, V, K]``,
    the bf16 conv cache window-first, int32 block tables."""
    s = HYBRID_GDN
    hk, hv, dk, dv = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
    tokens = budget + 1
    n = rows * tokens
    mixed = torch.zeros(n, s.conv_dim, dtype=torch.bfloat16)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    gates = torch.zeros(n, 2 * hv, dtype=torch.bfloat16)
    blocks = rows * tokens + 1
    query_start_loc = (torch.arange(rows + 1) * tokens).to(torch.int32)
    parents = torch.full((rows, tokens), -1, dtype=torch.long)
    return dict(
        q=q.view(n, hk, dk),
        k=k.view(n, hk, dk),
        v=v.view(n, hv, dv),
        a=gates[:, :hv],
        b=gates[:, hv:],
        query_start_loc=query_start_loc,
        parents=parents,
        num_tokens=torch.full((rows,), tokens, dtype=torch.long),
        ssm_cache=torch.zeros(blocks, hv, dv, dk),
        conv_cache=torch.zeros(
            blocks, s.conv_kernel - 1 + budget, s.conv_dim, dtype=torch.bfloat16
        ),
        state_slots=torch.arange(rows * tokens, dtype=torch.int32).view(rows, tokens) + 1,
        mixed=mixed,
    )


def case_gdn_tree_verify(budget: int) -> None:
    """A GDN layer's two launches in the tree verify (``gdn_layer.tree_conv`` and
    ``tree_recurrence``)."""
    from vllm_ddtree.ops.tree_causal_conv import tree_causal_conv1d_packed
    from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta_packed

    c = _gdn_packed(budget)
    rows, tokens = c["parents"].shape
    channels = c["mixed"].shape[1]
    width = HYBRID_GDN.conv_kernel
    conv_state = c["conv_cache"].transpose(1, 2)
    tree_causal_conv1d_packed(
        c["mixed"],
        c["query_start_loc"],
        c["parents"],
        c["num_tokens"],
        conv_state,
        c["state_slots"][:, 0],
        torch.zeros(channels, width, dtype=torch.bfloat16),
        None,
        activation="silu",
        saved_inputs=torch.zeros(rows + 1, tokens, channels, dtype=torch.bfloat16),
        saved_index=torch.zeros(rows + 1, dtype=torch.int32),
        num_accepted=torch.ones(rows, dtype=torch.int32),
        saved_offset=torch.zeros(rows + 1, dtype=torch.int32),
    )
    hv = HYBRID_GDN.num_v_heads
    tree_gated_delta_packed(
        c["q"],
        c["k"],
        c["v"],
        c["a"],
        c["b"],
        torch.zeros(hv),
        torch.zeros(hv, dtype=torch.bfloat16),
        c["query_start_loc"],
        c["parents"],
        c["num_tokens"],
        c["ssm_cache"].transpose(-1, -2),
        c["state_slots"],
        torch.ones(rows, dtype=torch.int32),
        use_qk_l2norm=True,
        saved_slots=torch.zeros(rows + 1, tokens, dtype=torch.int32),
    )


def case_gdn_commit(budget: int) -> None:
    """The commit of every GDN layer after the walk (``ops/gdn_commit.py``)."""
    from vllm_ddtree.ops.gdn_commit import GDNStateLayers, commit_gdn_states

    c = _gdn_packed(budget, rows=2)
    rows, tokens = c["parents"].shape
    channels = c["mixed"].shape[1]
    shapes = HYBRID_GDN
    n = shapes.num_gdn_layers
    layers = GDNStateLayers.of(
        [c["ssm_cache"]] * n,
        [torch.zeros(rows + 1, tokens, dtype=torch.int32)] * n,
        [c["conv_cache"].transpose(1, 2)] * n,
        [torch.zeros(rows + 1, dtype=torch.int32)] * n,
        [torch.zeros(rows + 1, tokens, channels, dtype=torch.bfloat16)] * n,
        [torch.zeros(rows + 1, dtype=torch.int32)] * n,
        window=shapes.conv_kernel - 1,
    )
    accepted = torch.zeros(rows, DEPTH + 1, dtype=torch.long)
    num = torch.zeros(rows, dtype=torch.long)
    commit_gdn_states(layers, accepted, num, torch.full((rows,), budget))


def _trees(budget: int, rows: int = 2):
    """Best-first trees of ``budget`` nodes and depth ``DEPTH`` (the reference build)."""
    from vllm_ddtree.tree import build_trees

    gen = torch.Generator().manual_seed(budget)
    trees = build_trees(torch.randn(rows, DEPTH, 64, generator=gen) * 2, budget)
    return trees


def _attention_shapes(name: str) -> tuple[int, int, int, int, int]:
    """A scale model's attention layers, query heads, KV heads, head size and KV block size."""
    model: ScaleModel = SCALE_MODELS[name]
    layers = model.num_hidden_layers
    if model.hybrid:
        layers -= gdn_shapes(model).num_gdn_layers
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    return layers, heads, kv_heads, model.head_dim, KV_BLOCK_SIZE[name]


def case_tree_attention(model: str, budget: int) -> None:
    """TREE_ATTN's kernels for one verify: the whole-sequence launch with its KV split over
    segments (and their combine), and the launch that merges a context computed elsewhere
    (``context_attention``), with the model's heads and bf16 paged KV."""
    from tree_attn_backend.ops.tree_attention import default_scale, pack_tree_mask, tree_attention

    _, heads, kv_heads, head_size, block_size = _attention_shapes(model)
    rows, tokens = 2, budget + 1
    n = rows * tokens
    q = torch.zeros(n, heads, head_size, dtype=torch.bfloat16)
    cache = torch.zeros(8, block_size, kv_heads, head_size, dtype=torch.bfloat16)
    visible = torch.ones(rows, tokens, tokens, dtype=torch.bool).tril()
    common = dict(
        q=q,
        key_cache=cache,
        value_cache=cache,
        query_start_loc=(torch.arange(rows + 1) * tokens).to(torch.int32),
        seq_lens=torch.full((rows,), 400 + tokens, dtype=torch.int32),
        block_table=torch.zeros(rows, 8, dtype=torch.int32),
        scale=default_scale(head_size),
        max_query_len=tokens,
        tree_mask=pack_tree_mask(visible).view(n, -1),
        is_tree=torch.ones(rows, dtype=torch.int32),
        positions=torch.zeros(n, dtype=torch.long),
    )
    tree_attention(**common, num_segments=8)
    tree_attention(
        **common,
        context_out=torch.zeros(n, heads, head_size, dtype=torch.bfloat16),
        context_lse=torch.zeros(heads, n),
    )


def case_kv_commit(model: str) -> None:
    """The accepted nodes' K/V moved in every attention layer (``ops/kv_commit.py``)."""
    from vllm_ddtree.ops.kv_commit import PagedKVLayers, commit_accepted_kv_at

    layers, _, kv_heads, head_size, block_size = _attention_shapes(model)
    caches = [torch.zeros(8, block_size, kv_heads, head_size, dtype=torch.bfloat16)] * layers
    rows = 2
    commit_accepted_kv_at(
        PagedKVLayers.of(caches, caches),
        torch.zeros(rows * 65, dtype=torch.int32),
        torch.arange(rows) * 65,
        torch.zeros(rows, DEPTH + 1, dtype=torch.long),
        torch.zeros(rows, dtype=torch.long),
    )


def case_tree_step(budget: int) -> None:
    """A step's small kernels around the verify: the inputs (depth positions, ancestor
    masks), the walk in V2's sampler format, the accepted path's drafter rows."""
    from vllm_ddtree.ops.drafter_rows import move_path_rows_triton
    from vllm_ddtree.ops.tree_inputs import tree_step_inputs_triton
    from vllm_ddtree.ops.tree_walk import walk_and_emit_triton

    trees = _trees(budget)
    rows, width = trees.token_ids.shape
    total = rows * (width + 1)
    starts = torch.arange(rows) * (width + 1)
    num_draft = torch.full((rows,), width)
    tree_step_inputs_triton(
        trees, starts, num_draft, num_draft + 1, torch.zeros(total, dtype=torch.long), total
    )
    chosen = torch.zeros(total, dtype=torch.long)
    accepted, num_accepted, _, _ = walk_and_emit_triton(
        trees, chosen, starts, num_draft, width + 1, sampled_dtype=torch.int64
    )
    features = [torch.zeros(total, 4096, dtype=torch.bfloat16) for _ in range(5)]
    move_path_rows_triton(
        torch.zeros(total, dtype=torch.int32),
        torch.zeros(total, dtype=torch.long),
        features,
        starts,
        accepted,
        num_accepted,
        num_draft,
        width,
    )


def case_tree_build(vocab: int, budget: int) -> None:
    """The drafter's trees from its bf16 logits: each depth's top candidates over the
    vocabulary, then the best-first build (``ops/tree_build.py``)."""
    from vllm_ddtree.config import DEFAULT_TOP_K_CAP
    from vllm_ddtree.ops.tree_build import build_trees_triton

    top_k = min(budget, DEFAULT_TOP_K_CAP)  # "tree_top_k"'s default
    build_trees_triton(torch.zeros(1, DEPTH, vocab, dtype=torch.bfloat16), budget, top_k)


CASES: dict[str, Callable[[], None]] = {
    **{
        f"gdn_tree_verify_b{budget}": (lambda budget=budget: case_gdn_tree_verify(budget))
        for budget in (16, 32, 64, 128)
    },
    **{
        f"gdn_commit_b{budget}": (lambda budget=budget: case_gdn_commit(budget))
        for budget in (32, 128)
    },
    "tree_attention_8b_b64": lambda: case_tree_attention("qwen3-8b", 64),
    "tree_attention_27b_b32": lambda: case_tree_attention("qwen3.6-27b", 32),
    "kv_commit_8b": lambda: case_kv_commit("qwen3-8b"),
    "kv_commit_27b": lambda: case_kv_commit("qwen3.6-27b"),
    "tree_step_b64": lambda: case_tree_step(64),
    "tree_step_b512": lambda: case_tree_step(512),
    "tree_build_8b_b64": lambda: case_tree_build(SCALE_MODELS["qwen3-8b"].vocab_size, 64),
    "tree_build_27b_b512": lambda: case_tree_build(HYBRID.vocab_size, 512),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    parser.add_argument("--cases", default="", help="comma-separated case names (all if empty)")
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
    with compiling_for(args.arch) as compiled:
        for name in names:
            start = len(compiled)
            CASES[name]()
            for kernel_name, kernel in compiled[start:]:
                row = {
                    "case": name,
                    "kernel": kernel_name,
                    "arch": args.arch,
                    "shared": kernel.metadata.shared,
                    "num_warps": kernel.metadata.num_warps,
                    **resource_usage(kernel.asm["cubin"]),
                }
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
