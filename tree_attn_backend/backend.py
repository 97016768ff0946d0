"""TREE_ATTN: a vLLM v1 attention backend for per-request draft trees over paged KV.

The four pieces of a vLLM backend (modelled on ``vllm/v1/attention/backends/triton_attn.py``):

* ``TreeAttentionMetadata``: what one step's attention needs, built once per step;
* ``TreeAttentionMetadataBuilder``: turns vLLM's ``CommonAttentionMetadata`` (plus the tree
  structure from the source it was handed, ``tree_verify.bind_tree_source``) into that dataclass,
  copying the tree into persistent buffers so CUDA graphs replay with fresh trees;
* ``TreeAttentionBackend``: capability queries, answered honestly;
* ``TreeAttentionImpl``: KV cache update and the attention call (Triton kernel on CUDA, the
  PyTorch reference on the CPU platform).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from tree_attn_backend.ops.context_attention import (
    committed_context_lens,
    context_attention,
    flash_attention_version,
    split_bound,
)
from tree_attn_backend.ops.tree_attention import tree_attention, tree_attention_ref
from tree_attn_backend.tree_verify import TreeVerifySource
from vllm_ddtree import envs

logger = init_logger("vllm.tree_attn_backend")

BACKEND_NAME = "TREE_ATTN"
MAX_TREE_TOKENS = 1025  # budget 1024 + root
MASK_WORDS = (MAX_TREE_TOKENS + 31) // 32
# Who computes the committed context's share of the attention: "triton" (the tree kernel over
# every key), "flash_attn" (vLLM's FlashAttention where it serves the shape, then the tree
# kernel over the in-block keys) or "auto", the default: FlashAttention for batches of at least
# FLASH_CONTEXT_MIN_TOKENS query tokens. At Qwen3-8B's attention on an H200 FlashAttention's
# path was faster in every verify shape of 65 query tokens or more and lost at one request with
# 16-32 nodes over a short context (benchmarks/results/2026-12-04_cd5632b_kernels-context-paths);
# in the 8B engine it served budget 16 at 16 requests 3-5% faster and one request 4-5% slower
# (benchmarks/results/2026-12-04_cd5632b_scale-8b-flash-context).
CONTEXT_CHOICES = envs.VARIABLES[envs.TREE_ATTN_CONTEXT].choices
FLASH_CONTEXT_MIN_TOKENS = 64


@dataclass
class TreeAttentionMetadata:
    """One step's attention inputs.

    |---------- context_len ----------|-- query_len (tree: root + nodes) --|
    |------------------------------ seq_len ------------------------------|

    Query token ``i`` of a tree request sees the context and its own ancestors (bit-packed in
    ``tree_mask``); every other request is causal.
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]
    positions: torch.Tensor | None  # int [T], RoPE positions (sliding windows)
    is_tree: torch.Tensor  # int32 [R]
    tree_mask: torch.Tensor  # int32 [T, MASK_WORDS]
    has_trees: bool
    # The committed context (seq_len - query_len) of each request (filled wherever
    # FlashAttention may serve: a graph captured on its path reads them when replayed), and the
    # FlashAttention version that computes this batch's share (None: the tree kernel reads every
    # key); its split-KV bound (0: FlashAttention's own choice, outside FULL CUDA graphs).
    context_lens: torch.Tensor | None = None
    context_fa_version: int | None = None
    context_max_splits: int = 0
    # The source the builder was handed (the DDTree step state); layers of the same forward
    # that verify trees too (hybrid GatedDeltaNet) reach the step through it.
    tree_source: TreeVerifySource | None = None


class TreeAttentionMetadataBuilder(AttentionMetadataBuilder[TreeAttentionMetadata]):
    # Uniform verify batches (every request 1 + budget tokens) are graph-captured.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    tree_source: TreeVerifySource | None = None  # handed by tree_verify.bind_tree_source
    context_fa_version: int | None = None  # FlashAttention computes the context's share
    context_min_tokens: int = 0  # ... of batches of at least this many query tokens

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        scheduler = vllm_config.scheduler_config
        max_tokens = scheduler.max_num_batched_tokens
        self._is_tree = torch.zeros(scheduler.max_num_seqs, dtype=torch.int32, device=device)
        self._tree_mask = torch.zeros((max_tokens, MASK_WORDS), dtype=torch.int32, device=device)
        self._context_lens = torch.zeros(scheduler.max_num_seqs, dtype=torch.int32, device=device)
        choice = envs.tree_attn_context()
        if choice != "triton":
            self.context_fa_version = flash_attention_version(
                kv_cache_spec.head_size, kv_cache_spec.dtype, torch.device(device)
            )
            self.context_min_tokens = FLASH_CONTEXT_MIN_TOKENS if choice == "auto" else 0
        compilation = vllm_config.compilation_config
        self._full_graphs = compilation.cudagraph_mode.has_full_cudagraphs()
        self._max_graph_tokens = compilation.max_cudagraph_capture_size or 0
        self._graph_splits = vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph
        if torch.device(device).type != "cuda":
            path = "PyTorch reference"
        elif self.context_fa_version is not None:
            path = f"FlashAttention {self.context_fa_version} over the context"
            if self.context_min_tokens:
                path += f" of batches of {self.context_min_tokens} query tokens or more"
            path += ", Triton kernel"
        else:
            path = "Triton kernel"
        logger.info_once("TREE_ATTN: tree attention backend active (%s)", path)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TreeAttentionMetadata:
        cad = common_attn_metadata
        num_reqs, num_tokens = cad.num_reqs, cad.num_actual_tokens
        is_tree = self._is_tree[:num_reqs]
        tree_mask = self._tree_mask[:num_tokens]
        source = self.tree_source
        published = source.published_trees() if source is not None else None
        if source is not None:
            source.record_slot_mapping(cad.slot_mapping)
        if published is not None:
            # CUDA-graph batches are padded past the published requests/tokens: the padding
            # requests are plain causal, their mask rows unused.
            reqs = min(num_reqs, published.is_tree.shape[0])
            rows = min(num_tokens, published.tree_mask.shape[0])
            words = published.tree_mask.shape[1]
            is_tree[:reqs].copy_(published.is_tree[:reqs], non_blocking=True)
            is_tree[reqs:].zero_()
            tree_mask[:rows, :words].copy_(published.tree_mask[:rows], non_blocking=True)
        else:
            is_tree.zero_()
        context_lens = fa_version = None
        max_splits = 0
        if self.context_fa_version is not None:
            context_lens = committed_context_lens(
                cad.query_start_loc, cad.seq_lens[:num_reqs], out=self._context_lens[:num_reqs]
            )
            if num_tokens >= self.context_min_tokens:
                fa_version = self.context_fa_version
                if self._full_graphs and num_tokens <= self._max_graph_tokens:
                    max_splits = self._graph_splits  # fixed at capture, as vLLM's own backend
        return TreeAttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=cad.max_query_len,
            max_seq_len=cad.max_seq_len,
            query_start_loc=cad.query_start_loc,
            seq_lens=cad.seq_lens,
            block_table=cad.block_table_tensor,
            slot_mapping=cad.slot_mapping,
            positions=cad.positions,
            is_tree=is_tree,
            tree_mask=tree_mask,
            has_trees=published is not None,
            context_lens=context_lens,
            context_fa_version=fa_version,
            context_max_splits=max_splits,
            tree_source=source,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata):
        metadata = self.build(0, common_attn_metadata)
        metadata.seq_lens.fill_(1)  # as TRITON_ATTN: capture with short sequences
        if metadata.context_lens is not None:
            metadata.context_lens.zero_()  # and no context (the kernel clamps the negative)
        return metadata


class TreeAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[TreeAttentionImpl]:
        return TreeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeAttentionMetadataBuilder]:
        return TreeAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if block_size % 16 != 0:
            raise ValueError(f"TREE_ATTN needs a KV block size multiple of 16, got {block_size}")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % 16 == 0

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 256]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in cls.get_supported_head_sizes()

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


class TreeAttentionImpl(AttentionImpl[TreeAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unsupported,
    ) -> None:
        for name, value in (("alibi_slopes", alibi_slopes), ("logits_soft_cap", logits_soft_cap)):
            if value:
                raise NotImplementedError(f"TREE_ATTN does not support {name}")
        if unsupported.get("sinks") is not None:
            raise NotImplementedError("TREE_ATTN does not support attention sinks")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"TREE_ATTN serves decoder attention only, not {attn_type}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[T, Hkv, D]`` to their slots (``-1`` = padding, skipped)."""
        key_cache, value_cache = kv_cache.unbind(0)
        if key.is_cuda:
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
                triton_reshape_and_cache_flash,
            )

            triton_reshape_and_cache_flash(
                key,
                value,
                key_cache,
                value_cache,
                slot_mapping,
                self.kv_cache_dtype,
                layer._k_scale,
                layer._v_scale,
            )
            return
        num_tokens = slot_mapping.shape[0]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        block_size = key_cache.shape[1]
        blocks, offsets = slots // block_size, slots % block_size  # caches may be strided views
        key_cache[blocks, offsets] = key[:num_tokens][valid].to(key_cache.dtype)
        value_cache[blocks, offsets] = value[:num_tokens][valid].to(value_cache.dtype)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TreeAttentionMetadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query`` ``[T, Hq, D]`` -> ``output`` ``[T, Hq, D]`` (tree rows masked to ancestors)."""
        assert output is not None, "TREE_ATTN writes into vLLM's output buffer"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("TREE_ATTN does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        num_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        args = dict(
            q=query[:num_tokens],
            key_cache=key_cache,
            value_cache=value_cache,
            query_start_loc=attn_metadata.query_start_loc,
            seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table,
            scale=self.scale,
            tree_mask=attn_metadata.tree_mask,
            is_tree=attn_metadata.is_tree,
            positions=attn_metadata.positions,
            sliding_window=self.sliding_window,
            out=output[:num_tokens],
        )
        if query.is_cuda:
            md = attn_metadata
            if md.context_fa_version is not None and not self.sliding_window:
                splits = 0
                if md.context_max_splits:
                    splits = split_bound(
                        md.context_max_splits, num_tokens, self.num_heads, self.head_size
                    )
                args["context_out"], args["context_lse"] = context_attention(
                    args["q"],
                    key_cache,
                    value_cache,
                    md.query_start_loc,
                    md.context_lens,
                    md.block_table,
                    self.scale,
                    max_query_len=md.max_query_len,
                    max_context_len=md.max_seq_len,
                    fa_version=md.context_fa_version,
                    num_splits=splits,
                )
            tree_attention(**args, max_query_len=md.max_query_len)
        else:
            tree_attention_ref(**args)
        return output
