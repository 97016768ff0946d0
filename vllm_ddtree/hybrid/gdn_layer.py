"""DDTree on hybrid targets: vLLM's GatedDeltaNet layers verify a draft tree.

Serves the classes in ``config.GDN_TREE_ARCHITECTURES`` (other recurrent targets are refused
before the engine starts). vLLM 0.26.0's ``QwenGatedDeltaNetAttention._forward_core`` sends its
speculative rows (the requests with drafts, first in the batch) through two chain-shaped calls,
the depthwise conv1d update and the gated delta rule's recurrence (vLLM-CPU: its own
``_spec_forward``). In a forward that verifies trees (``step_of_this_forward``) exactly those
calls go to the tree path instead (``HybridTreeStep.tree_conv`` / ``tree_recurrence``, on the
CPU ``tree_spec_forward_cpu``), with this step's parent pointers (``ops/tree_causal_conv.py``,
``ops/tree_gated_delta.py``); every other call (prefill, plain decode) stays vLLM's. The plugin
routes them by wrapping the layer module's names.

State, in vLLM's speculative layout (``1 + budget`` blocks per request; its size:
``gdn_state.slot_layout_bytes``): node ``t``'s SSM state goes to block
``spec_state_indices[r, t]``; the step starts from block ``[r, num_accepted - 1]`` and reads the
conv window from column ``num_accepted - 1`` of block ``[r, 0]``, where vLLM's own bookkeeping
puts ``num_accepted`` = accepted drafts + 1. After the walk, ``HybridTreeStep.commit`` leaves
the accepted path where vLLM's chain would have left it (``ops/gdn_commit.py``, one launch for
every layer): the leaf's state in block ``[r, num_accepted]``, the conv block holding the path's
inputs in order. So vLLM's own state bookkeeping serves trees unchanged, the prefix-caching
``align`` layout included: there vLLM copies the state at each block boundary the accepted
tokens cross into that block (``postprocess_mamba``) and the running state into the block the
next step writes (``preprocess_mamba``); ``commit`` puts the boundary's path node where vLLM's
copy reads it (``boundary_depths``). The tree kernels keep the node inputs, the rows' state
blocks and window columns per layer in persistent buffers as they run (so CUDA graph replays,
which skip this Python, still fill them), made before vLLM captures any graph
(``HybridTreeStep.prepare_layers``); each layer's verify is two launches. SSM states are
float32 or bfloat16 (``--mamba-ssm-cache-dtype``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vllm_ddtree import envs
from vllm_ddtree.config import check_align_block_size
from vllm_ddtree.ops import use_triton
from vllm_ddtree.ops.gdn_commit import (
    GDNStateLayers,
    commit_gdn_states,
    commit_gdn_states_ref,
    speculative_rows,
)
from vllm_ddtree.ops.tree_causal_conv import (
    tree_causal_conv1d_packed,
    tree_causal_conv1d_packed_ref,
)
from vllm_ddtree.ops.tree_gated_delta import tree_gated_delta_packed, tree_gated_delta_packed_ref

logger = logging.getLogger("vllm.ddtree")


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def checking_indices() -> bool:
    """Whether ``VLLM_DDTREE_CHECK_INDICES=1`` and the device is not capturing a CUDA graph (a
    check syncs the host, which a capture forbids)."""
    if not envs.checking_indices():
        return False
    return not capturing()


def check_index_range(name: str, index: torch.Tensor, size: int, rows=None) -> None:
    """Raise unless every entry of ``index`` (any integer shape; only ``rows``, a bool mask
    over its first dimension, when given) lies in ``[0, size)``."""
    values = index[rows] if rows is not None else index
    bad = (values < 0) | (values >= size)
    if bool(bad.any()):
        where = torch.nonzero(bad)[:8].tolist()
        raise RuntimeError(
            f"vllm-ddtree: {name} out of range [0, {size}) at {where}: "
            f"{values[bad][:8].tolist()} ({envs.CHECK_INDICES}=1)"
        )


@dataclass
class GDNLayerStep:
    """One GDN layer's view of the step, in persistent buffers (rows = speculative rows).

    The buffers exist before any CUDA graph is captured (``HybridTreeStep.prepare_layers``):
    memory taken inside a capture belongs to vLLM's graph pool, where the temporaries of graphs
    captured earlier (the piecewise ones) live, so their replays would write over it.

    Attributes:
        conv_state: the ``[blocks, C, K - 1 + B]`` conv cache view vLLM passed (None until the
            layer's first call).
        conv_blocks: int32 ``[rows]``, each row's block 0.
        conv_offsets: int32 ``[rows]``, the column each row's committed window started at.
        inputs: ``[rows, T, C]``, the conv inputs of every tree token (T = 1 + B).
        window: ``K - 1``, the committed inputs the conv reads.
        ssm_state: float32 ``[blocks, Hv, V, K]`` SSM cache (set by the recurrence call).
        ssm_blocks: int32 ``[rows, T]``, each node's state block.
        number: the layer's place in call order (0 = the first GDN layer), for messages.
        written_at: the step whose eager call last filled ``conv_blocks`` / ``ssm_blocks``
            (kept only while ``VLLM_DDTREE_CHECK_INDICES=1``), with copies of what it wrote
            in ``expected_conv_blocks`` / ``expected_ssm_blocks``.
    """

    conv_state: torch.Tensor | None
    conv_blocks: torch.Tensor
    conv_offsets: torch.Tensor
    inputs: torch.Tensor
    window: int
    ssm_blocks: torch.Tensor
    ssm_state: torch.Tensor | None = None
    number: int = 0
    written_at: int = -1
    expected_conv_blocks: torch.Tensor | None = None
    expected_ssm_blocks: torch.Tensor | None = None


def boundary_depths(
    root_positions: torch.Tensor, num_accepted: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Per batch row, the depth on its accepted path at which the committed tokens reach a
    multiple of ``block_size`` (the last one, as vLLM's ``align`` postprocess picks it), or -1
    where they reach none this step. ``root_positions`` long ``[R]`` (the root token's
    position: ``running`` = position + 1 tokens are committed through the root),
    ``num_accepted`` long ``[R]`` (accepted drafts). Long ``[R]``."""
    running = root_positions.long() + 1
    aligned = (running + num_accepted.long()) // block_size * block_size
    return torch.where(aligned >= running, aligned - running, -1)


class HybridTreeStep:
    """Parent pointers of the step's trees, the GDN layers' buffers, and the commit.

    ``parents`` long ``[rows + 1, T]`` (tree indices, ``-1`` at the root) and ``num_tokens``
    long ``[rows + 1]`` (0 for rows without a tree); the last row takes what has no row.
    ``cache_config``: the engine's (vLLM's ``CacheConfig``), read when the commit runs: in the
    prefix-caching ``align`` layout the commit also places the states vLLM caches at block
    boundaries, and vLLM fixes the block size only after the model is loaded
    (``Platform.update_block_size_for_backend``), after this object is made.
    """

    def __init__(self, max_rows: int, tree_budget: int, device: torch.device, cache_config=None):
        self.max_rows = max_rows
        self.cache_config = cache_config
        self.tokens_per_row = tree_budget + 1  # a verify row: the root, then the nodes
        self.parents = torch.full(
            (max_rows + 1, self.tokens_per_row), -1, dtype=torch.long, device=device
        )
        self.num_tokens = torch.zeros(max_rows + 1, dtype=torch.long, device=device)
        self.layers: dict[int, GDNLayerStep] = {}
        self._conv_layer: GDNLayerStep | None = None
        # (the layers' cache addresses, their commit table): ``_state_layers``.
        self._state_table: tuple[tuple, GDNStateLayers] | None = None
        self.routed_calls = 0  # speculative GDN calls sent to the tree kernels
        self.step_number = 0  # publish() counts the verify steps
        self._routed_at_publish = 0

    @property
    def state_block_size(self) -> int | None:
        """Tokens per cached state block in vLLM's ``align`` layout (prefix caching); None in
        its plain layout."""
        cache = self.cache_config
        if cache is None or cache.mamba_cache_mode != "align":
            return None
        return cache.mamba_block_size

    def publish(self, parents: torch.Tensor, num_nodes: torch.Tensor, num_draft: torch.Tensor):
        """Before the forward: the trees' ``parents`` long ``[R, B]`` (tree index of each
        node's parent, 0 = root) and ``num_nodes`` long ``[R]``, batch rows -> spec rows."""
        self.step_number += 1
        self._routed_at_publish = self.routed_calls
        rows, has = speculative_rows(num_draft, self.max_rows)
        width = min(parents.shape[1], self.tokens_per_row - 1)
        table = torch.full(
            (parents.shape[0], self.tokens_per_row), -1, dtype=torch.long, device=parents.device
        )
        table[:, 1 : 1 + width] = parents[:, :width]
        self.num_tokens.zero_()
        self.parents.index_copy_(0, rows, table)
        self.num_tokens.index_copy_(0, rows, torch.where(has, num_nodes.long() + 1, 0))

    def _add_layer(
        self, key: int, channels: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> GDNLayerStep:
        """New (or resized) buffers for the GDN layer whose conv weight starts at ``key``."""
        if capturing():
            raise RuntimeError(
                "vllm-ddtree: a GatedDeltaNet layer reached the tree path for the first time "
                "inside a CUDA-graph capture; its buffers must exist before capture (memory "
                "taken there belongs to the graph pool, which other graphs' replays overwrite): "
                "HybridTreeStep.prepare_layers did not find this layer in the model"
            )
        rows, tokens = self.max_rows + 1, self.tokens_per_row
        known = self.layers.get(key)
        layer = GDNLayerStep(
            conv_state=None,
            conv_blocks=torch.zeros(rows, dtype=torch.int32, device=device),
            conv_offsets=torch.zeros(rows, dtype=torch.int32, device=device),
            inputs=torch.zeros(rows, tokens, channels, dtype=dtype, device=device),
            window=width - 1,
            ssm_blocks=torch.zeros(rows, tokens, dtype=torch.int32, device=device),
            number=known.number if known is not None else len(self.layers),
        )
        self.layers[key] = layer
        return layer

    def prepare_layers(self, model: torch.nn.Module) -> int:
        """Before CUDA graphs are captured (and vLLM's memory profile, once its block sizes are
        fixed): buffers for every GatedDeltaNet layer of ``model`` (vLLM's
        ``QwenGatedDeltaNetAttention``, found by its ``conv1d`` and ``A_log``), keyed as the
        calls find them; a tree too wide for the ``align`` layout's state blocks is refused
        (``config.check_align_block_size``). Returns how many layers have buffers."""
        if self.state_block_size is not None:
            check_align_block_size(self.tokens_per_row - 1, self.state_block_size)
        for module in model.modules():
            conv = getattr(module, "conv1d", None)
            weight = getattr(conv, "weight", None)
            if weight is None or not hasattr(module, "A_log") or weight.dim() != 3:
                continue
            key = weight.data_ptr()
            known = self.layers.get(key)
            channels, width = weight.shape[0], weight.shape[-1]
            if known is None or known.inputs.shape[-1] != channels:
                self._add_layer(key, channels, width, weight.dtype, weight.device)
        return len(self.layers)

    def _layer(
        self, conv_state: torch.Tensor, weight: torch.Tensor, x: torch.Tensor
    ) -> GDNLayerStep:
        """The calling layer's buffers, keyed by its conv weight: several GDN layers can share
        one cache tensor (vLLM's hybrid allocator gives one tensor to a layer of each KV-cache
        group, each addressing its own blocks), so the cache cannot tell them apart."""
        key = weight.data_ptr()
        layer = self.layers.get(key)
        if layer is None or layer.inputs.dtype != x.dtype or layer.inputs.shape[-1] != x.shape[-1]:
            layer = self._add_layer(key, x.shape[-1], weight.shape[-1], x.dtype, x.device)
        layer.conv_state = conv_state  # the cache the engine uses now (not a profiling one)
        return layer

    def watch(self, where: str) -> None:
        """With ``VLLM_DDTREE_CHECK_INDICES=1`` (outside CUDA-graph capture): raise, naming
        ``where`` (the operations since the last watch), if any GDN layer's state-block
        buffers no longer hold what this step's eager calls wrote there: something wrote over
        them. A no-op otherwise."""
        if not checking_indices():
            return
        for layer in self.layers.values():
            if layer.written_at != self.step_number:
                continue
            for name, buffer, expected in (
                ("conv", layer.conv_blocks, layer.expected_conv_blocks),
                ("SSM", layer.ssm_blocks, layer.expected_ssm_blocks),
            ):
                if expected is None or buffer is None:
                    continue
                found = buffer[: expected.shape[0]]
                changed = (found != expected).reshape(expected.shape[0], -1).any(1)
                if bool(changed.any()):
                    rows = torch.nonzero(changed).flatten()[:4].tolist()
                    raise RuntimeError(
                        f"vllm-ddtree: GDN layer {layer.number}'s {name} state blocks were "
                        f"written over {where} (step {self.step_number}, rows {rows}: "
                        f"{found[rows].tolist()} instead of {expected[rows].tolist()}; "
                        f"{envs.CHECK_INDICES}=1)"
                    )

    def _check_every_layer_called(self) -> None:
        """With the index checks on, after a step whose layers ran eagerly (not a full CUDA
        graph replay, where no Python runs): every GDN layer must have gone through the tree
        path this step, or its buffers still describe an earlier step."""
        if self.routed_calls == self._routed_at_publish:
            return  # a full-graph replay: the graph filled the buffers
        stale = [
            layer.number for layer in self.layers.values() if layer.written_at != self.step_number
        ]
        if stale and bool((self.num_tokens > 0).any()):
            raise RuntimeError(
                f"vllm-ddtree: GDN layers {stale} did not run through the tree path in step "
                f"{self.step_number}, whose trees the commit applies ({envs.CHECK_INDICES}=1)"
            )

    def tree_conv(
        self,
        x,
        conv_state,
        weight,
        bias,
        activation,
        *,
        conv_state_indices,
        num_accepted_tokens,
        query_start_loc,
        max_query_len,
        validate_data: bool = False,
    ):
        """vLLM's speculative ``causal_conv1d_update`` over trees, called as vLLM calls it:
        ``x`` ``[n, C]`` (row ``s`` from ``query_start_loc[s]``), ``conv_state``
        ``[blocks, C, K - 1 + B]``, each row's window from column
        ``num_accepted_tokens[s] - 1``; returns ``[n, C]`` (``validate_data``, vLLM's input
        checks, is not used). One launch on CUDA, which also keeps the nodes' inputs and the
        rows' conv blocks and window columns in the layer's buffers for the commit. vLLM may
        schedule fewer drafts than the budget (e.g. near ``max_model_len``): a row then has
        fewer tokens, and its tree was cut to match."""
        num_rows, total = conv_state_indices.shape[0], x.shape[0]
        assert int(max_query_len) == self.tokens_per_row, "verify rows are 1 + tree_budget"
        if self.routed_calls == 0:
            logger.info(
                "vllm-ddtree: GatedDeltaNet tree path active (first speculative conv call: "
                "%d rows, %d tokens, conv state %s)",
                num_rows,
                total,
                tuple(conv_state.shape),
            )
        self.routed_calls += 1
        layer = self._layer(conv_state, weight, x)
        check = checking_indices()
        if check:
            self.watch(f"before GDN layer {layer.number}'s conv call")
            check_index_range("conv state block", conv_state_indices, conv_state.shape[0])
            ends = query_start_loc[: num_rows + 1].long()
            check_index_range("conv query_start_loc", ends, total + 1)
        conv = tree_causal_conv1d_packed if use_triton(x.device) else tree_causal_conv1d_packed_ref
        out = conv(
            x,
            query_start_loc,
            self.parents[:num_rows],
            self.num_tokens[:num_rows],
            conv_state,
            conv_state_indices,
            weight,
            bias,
            activation="silu" if activation in (True, "silu", "swish") else None,
            saved_inputs=layer.inputs,
            saved_index=layer.conv_blocks,
            num_accepted=num_accepted_tokens,
            saved_offset=layer.conv_offsets,
        )
        self._conv_layer = layer
        if check:
            layer.written_at = self.step_number
            layer.expected_conv_blocks = layer.conv_blocks[:num_rows].clone()
            layer.expected_ssm_blocks = None
            self.watch(f"in GDN layer {layer.number}'s tree conv")
        return out

    def tree_recurrence(
        self,
        *,
        A_log,
        a,
        b,
        dt_bias,
        q,
        k,
        v,
        initial_state,
        cu_seqlens,
        ssm_state_indices,
        num_accepted_tokens,
        use_qk_l2norm_in_kernel: bool = False,
        inplace_final_state: bool = True,
    ):
        """vLLM's speculative ``fused_sigmoid_gating_delta_rule_update`` over trees, called as
        vLLM calls it: ``q``/``k`` ``[1, n, Hk, K]``, ``v`` ``[1, n, Hv, V]`` (row ``s`` from
        ``cu_seqlens[s]``), ``a``/``b`` ``[>= n, Hv]``, ``initial_state`` float32
        ``[blocks, Hv, V, K]``, ``ssm_state_indices`` ``[>= S, 1 + B]``. Returns
        ``(out [1, n, Hv, V], initial_state)`` like vLLM's function; every node's state is
        written into ``initial_state`` (``inplace_final_state``, as vLLM's speculative call
        asks). One launch on CUDA (the gates computed in it), which also keeps the rows' state
        blocks in the layer's buffer for the commit.

        With full CUDA graphs vLLM pads ``ssm_state_indices`` to the graph's batch (null-block
        rows) but passes ``cu_seqlens`` for the ``S`` real rows only: the rows are those."""
        assert inplace_final_state, "the tree path writes every node's state in place"
        num_rows = cu_seqlens.shape[0] - 1
        ssm_state_indices = ssm_state_indices[:num_rows]
        layer = self._conv_layer
        assert layer is not None, "the conv call comes first in each GDN layer"
        check = checking_indices()
        if check:
            self.watch("between a GDN layer's conv and recurrence calls")
            blocks = initial_state.shape[0]
            check_index_range("SSM state block", ssm_state_indices, blocks)
            column = (num_accepted_tokens[:num_rows].long() - 1).clamp(min=0).unsqueeze(1)
            start = ssm_state_indices.long().gather(1, column)
            check_index_range("SSM start block", start, blocks)
        on_gpu = use_triton(q.device)
        recurrence = tree_gated_delta_packed if on_gpu else tree_gated_delta_packed_ref
        out = recurrence(
            q[0],
            k[0],
            v[0],
            a,
            b,
            A_log,
            dt_bias,
            cu_seqlens,
            self.parents[:num_rows],
            self.num_tokens[:num_rows],
            initial_state.transpose(-1, -2),
            ssm_state_indices,
            num_accepted_tokens,
            use_qk_l2norm=bool(use_qk_l2norm_in_kernel),
            saved_slots=layer.ssm_blocks,
        )
        layer.ssm_state = initial_state
        if check:
            layer.expected_ssm_blocks = layer.ssm_blocks[:num_rows].clone()
            self.watch(f"in GDN layer {layer.number}'s tree recurrence")
        return out.unsqueeze(0), initial_state

    def commit(
        self,
        accepted: torch.Tensor,
        num_accepted: torch.Tensor,
        num_draft: torch.Tensor,
        root_positions: torch.Tensor | None = None,
    ):
        """After the walk: ``accepted`` long ``[R, L + 1]`` (tree indices, root first),
        ``num_accepted`` long ``[R]`` (accepted drafts), ``root_positions`` long ``[R]`` (each
        root token's position; needed with ``state_block_size``), per batch row. Every GDN
        layer's caches left as vLLM's chain leaves them after this path (the module docstring;
        ``ops/gdn_commit.py``, one launch for all layers on CUDA)."""
        if checking_indices():
            self._check_commit(accepted, num_accepted, num_draft)
        layers = self._state_layers()
        if layers is None:
            return
        boundary = None
        block_size = self.state_block_size
        if block_size is not None:
            assert root_positions is not None, "the align layout needs the roots' positions"
            boundary = boundary_depths(root_positions, num_accepted, block_size)
        commit = commit_gdn_states if use_triton(accepted.device) else commit_gdn_states_ref
        commit(layers, accepted, num_accepted.long(), num_draft.long(), boundary)

    def _state_layers(self) -> GDNStateLayers | None:
        """The GDN layers the commit updates (those the tree path has called), as one table,
        rebuilt only when a layer's caches change (vLLM's profiling run uses others)."""
        called = [
            layer
            for layer in self.layers.values()
            if layer.conv_state is not None and layer.ssm_state is not None
        ]
        if not called:
            return None
        key = tuple((layer.conv_state.data_ptr(), layer.ssm_state.data_ptr()) for layer in called)
        if self._state_table is None or self._state_table[0] != key:
            windows = {layer.window for layer in called}
            assert len(windows) == 1, f"GDN layers with different conv widths: {windows}"
            table = GDNStateLayers.of(
                [layer.ssm_state for layer in called],
                [layer.ssm_blocks for layer in called],
                [layer.conv_state for layer in called],
                [layer.conv_blocks for layer in called],
                [layer.inputs for layer in called],
                [layer.conv_offsets for layer in called],
                window=windows.pop(),
            )
            self._state_table = (key, table)
        return self._state_table[1]

    def _check_commit(self, accepted, num_accepted, num_draft) -> None:
        """``VLLM_DDTREE_CHECK_INDICES=1``: every index the commit reads, in range."""
        rows, _ = speculative_rows(num_draft, self.max_rows)
        spare = self.max_rows + 1
        taken = torch.zeros(spare, dtype=torch.long, device=accepted.device)
        taken.index_copy_(0, rows, num_accepted.long())
        path = torch.zeros((spare, accepted.shape[1]), dtype=torch.long, device=accepted.device)
        path.index_copy_(0, rows, accepted.clamp(min=0))
        valid = self.num_tokens > 0
        self.watch("before the GDN commit")
        self._check_every_layer_called()
        check_index_range("accepted drafts", taken, accepted.shape[1], valid)
        check_index_range("accepted node", path, self.tokens_per_row, valid)
        for layer in self.layers.values():
            if layer.conv_state is None:
                continue  # prepared before capture, never called yet
            name = f"GDN layer {layer.number} conv block"
            check_index_range(name, layer.conv_blocks, layer.conv_state.shape[0], valid)
            if layer.ssm_state is not None:
                name = f"GDN layer {layer.number} SSM block"
                check_index_range(name, layer.ssm_blocks, layer.ssm_state.shape[0], valid)


def hybrid_tree_step(vllm_config, tree_budget: int, device) -> HybridTreeStep:
    """A DDTree worker's GatedDeltaNet tree path (either runner): the step object the GDN
    layers' speculative calls reach in a tree verify and the runner hooks publish the trees to
    and commit through, sized for the engine; with prefix caching (vLLM's
    ``align`` state layout) it also places the states vLLM caches at block boundaries, of the
    size vLLM fixes once the model is loaded (read then: ``HybridTreeStep.state_block_size``).
    Made before any CUDA graph is captured."""
    return HybridTreeStep(
        max_rows=vllm_config.scheduler_config.max_num_seqs,
        tree_budget=tree_budget,
        device=torch.device(device),
        cache_config=vllm_config.cache_config,
    )


def prepare_before_capture(step: HybridTreeStep | None, model, when: str) -> None:
    """The GDN tree path's per-layer buffers for ``model``, allocated once, before vLLM
    profiles memory or captures a graph (``HybridTreeStep.prepare_layers``); nothing for a
    dense target (``step`` None)."""
    if step is not None:
        found = step.prepare_layers(model)
        logger.info("vllm-ddtree: buffers for %d GatedDeltaNet layers %s", found, when)


def step_of_this_forward() -> HybridTreeStep | None:
    """The DDTree step of the forward vLLM is running, when it verifies trees on a hybrid
    target: found through the TREE_ATTN metadata of the same forward (its builder was handed
    the step state, ``StepState.bind_tree_attention``), as vLLM's own layers find their
    metadata; None outside a forward or in an engine without DDTree."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return None
    for layer_metadata in metadata.values():
        source = getattr(layer_metadata, "tree_source", None)
        if source is not None:
            return getattr(source, "hybrid", None)
    return None


def tree_spec_forward_cpu(
    step: HybridTreeStep, layer, md, x, b, a, conv_buf, ssm_state
) -> torch.Tensor:
    """vLLM-CPU's speculative GDN rows (its ``_spec_forward``) over trees, with the same
    conventions as the CUDA path: ``x`` ``[n, C]`` bf16, ``b``/``a`` ``[n, Hv]``, ``conv_buf``
    ``[slots, C, K - 1 + B]`` (committed window first), ``ssm_state`` the CPU kernels' view
    ``[slots, Hv, K, V]``; returns ``[n, Hv, V]``."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _unpacked_conv_weight

    rows = md.num_spec_decodes
    indices = md.spec_state_indices_tensor[:rows]
    starts = md.spec_query_start_loc[: rows + 1]
    y = step.tree_conv(
        x,
        conv_buf,
        _unpacked_conv_weight(layer),
        layer.conv1d.bias,
        layer.activation,
        conv_state_indices=indices[:, 0],
        num_accepted_tokens=md.num_accepted_tokens[:rows],
        query_start_loc=starts,
        max_query_len=indices.shape[-1],
    )
    q, k, v = layer.rearrange_mixed_qkv(y)
    out, _ = step.tree_recurrence(
        A_log=layer.A_log,
        a=a,
        b=b,
        dt_bias=layer.dt_bias,
        q=q,
        k=k,
        v=v,
        initial_state=ssm_state.transpose(-1, -2),  # the [slots, Hv, V, K] view it expects
        cu_seqlens=starts,
        ssm_state_indices=indices,
        num_accepted_tokens=md.num_accepted_tokens[:rows],
        use_qk_l2norm_in_kernel=True,
    )
    return out[0]
