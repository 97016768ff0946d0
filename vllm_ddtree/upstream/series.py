"""The patch series: one reviewable step per patch, in the order a reviewer reads them.

Each ``PatchStep`` lists the project modules it generates (their in-tree paths from
``layout.MODULES``), the project tests it brings (``layout.TESTS``), new package markers, the
hand-written ``edits`` and its commit message: what, why, how tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ddtree.upstream.edits import INTERPRETER_MARKER, TREE_ATTN_MEMBER, Edit


@dataclass(frozen=True)
class PatchStep:
    subject: str
    body: str
    modules: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    # New packages: in-tree path of the ``__init__.py`` -> its docstring.
    packages: dict[str, str] = field(default_factory=dict)
    edits: tuple[Edit, ...] = ()


SERIES: tuple[PatchStep, ...] = (
    PatchStep(
        subject="[Spec Decode] DDTree: best-first draft trees from per-depth distributions",
        body="""\
DDTree (Diffusion Draft Tree, Ringel & Romano 2026) turns a block-diffusion drafter's
per-position distributions (DFlash) into a tree of the `budget` most probable prefixes,
found best-first, which the target verifies in one forward. This adds the tree itself:
construction from each depth's top candidates, ancestor masks, and the walk's helpers as
PyTorch references, plus the module of its environment variables.

Nothing calls it yet; the TREE_ATTN backend and the proposer follow in this series.

Tests: tests/v1/spec_decode/ddtree/test_tree.py checks the best-first construction against
brute-force enumeration of every prefix, the masks against the parents, and the candidates'
log-probabilities against a float32 log-softmax (CPU).""",
        modules=("vllm_ddtree.envs", "vllm_ddtree.tree"),
        tests=("tests/test_tree.py",),
        packages={
            "vllm/v1/spec_decode/ddtree/__init__.py": "DDTree speculative decoding.",
            "tests/v1/spec_decode/ddtree/__init__.py": "",
        },
    ),
    PatchStep(
        subject="[Attention] TREE_ATTN: tree attention over paged KV as Triton kernels",
        body="""\
A tree verify's query tokens see their request's whole committed context and, inside the
request's own tokens, only their ancestors. TREE_ATTN serves such batches (mixed with
prefills and decodes, which attend causally) from vLLM's paged KV cache: a Triton kernel
with the tree structure bit-packed per query row, split-KV for small batches, sliding
windows by position, and, on CUDA in half precision, the committed context through vLLM's
FlashAttention with its log-sum-exp, merged by the tree kernel over the in-block keys. A
PyTorch reference serves the CPU platform. The builder copies each step's trees into
persistent buffers, so FULL CUDA graphs replay with fresh trees.

vLLM removed its earlier TREE_ATTN backend; DDTree's verify needs one. The backend takes
`AttentionBackendEnum.TREE_ATTN`.

Tests: tests/v1/attention/test_tree_attention.py checks the kernel against the float32
reference over mixed batches (GQA, head sizes 32-128, windows, empty trees, split-KV, a
context merged from elsewhere, tiles of several mask words, capture-shaped batches), natively
on CUDA and under TRITON_INTERPRET=1 on CPU machines; FlashAttention's context path against
the reference and inside a CUDA graph on GPUs.""",
        modules=(
            "tree_attn_backend.ops.tree_attention",
            "tree_attn_backend.ops.context_attention",
            "tree_attn_backend.tree_verify",
            "tree_attn_backend.backend",
            "tree_attn_backend.testing",
            "tests.interpreter",
        ),
        tests=("tests/test_tree_attention_kernel.py",),
        edits=(TREE_ATTN_MEMBER, INTERPRETER_MARKER),
    ),
)
