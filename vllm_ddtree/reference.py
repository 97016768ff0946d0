"""The DDTree reference engine: a plain PyTorch / transformers generate loop (batch 1).

This is the oracle the vLLM path is checked against and the place to debug correctness. One
round, top to bottom:

1. draft: the DFlash drafter sees the committed context (target hidden states) and the block
   ``[bonus, mask x L]``, and returns logits for the L masked positions;
2. tree build: ``build_trees`` picks the ``budget`` most probable prefixes;
3. verify: the target runs ``[bonus, node_1 .. node_N]`` in one forward, with position ids
   ``start + depth`` and a dense additive mask (whole past + ancestors only inside the tree);
4. walk: the target's token at every node (argmax, or one sample per node at T > 0) is followed
   down the tree (``follow_tree``); accepted nodes plus one bonus token are committed;
5. commit: K/V rows of the accepted nodes are moved to contiguous positions in every layer and
   the cache is cropped; the accepted nodes' target hidden states become drafter context.

Greedy output equals the target's greedy decoding; at T > 0 every emitted token is a sample of
the target conditioned on the emitted prefix (sample-and-walk, exact without draft
probabilities). Each stage is timed, and ``trace=True`` keeps a ``RoundTrace`` per round.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from vllm_ddtree.dflash_drafter import DFlashDrafter
from vllm_ddtree.tree import ancestor_mask, build_trees, follow_tree, summarize

STAGES = ("draft", "tree_build", "verify", "commit")


class DraftSource(Protocol):
    """Anything that proposes per-depth logits for the next ``depth`` tokens."""

    depth: int

    def reset(self) -> None:
        """Forget all context (a new prompt starts)."""

    def extend_context(
        self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Append committed tokens: ids long ``[n]``, target features ``[n, F]``, positions
        long ``[n]``."""

    def draft_logits(self, bonus_token: int, position: int) -> torch.Tensor:
        """float ``[depth, V]``: logits for positions ``position + 1 .. position + depth``
        given the bonus token at ``position``."""


class DFlashDraftSource:
    """Runs a ``DFlashDrafter`` against an HF target (its embedding and LM head).

    The drafter's context cache holds, per draft layer, the K/V projected from the committed
    tokens' target features; the block's own K/V are never kept (as in DFlash).
    """

    def __init__(self, drafter: DFlashDrafter, target: nn.Module, depth: int | None = None):
        cfg = drafter.config
        max_depth = cfg.block_size - 1
        self.depth = max_depth if depth is None else depth
        if not 1 <= self.depth <= max_depth:
            raise ValueError(f"depth must be in 1..{max_depth} (block_size - 1), got {depth}")
        self.drafter = drafter
        self.embed = drafter.embed_tokens or target.get_input_embeddings()
        self.lm_head = drafter.lm_head or target.get_output_embeddings()
        self.mask_token_id = cfg.mask_token_id
        self.target_layer_ids = list(cfg.target_layer_ids)
        self._context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def feature_layers(self) -> list[int]:
        """Indices into HF ``hidden_states`` (layer id + 1: index 0 is the embedding)."""
        return [i + 1 for i in self.target_layer_ids]

    def reset(self) -> None:
        self._context_kv = None

    @torch.no_grad()
    def extend_context(self, token_ids, features, positions) -> None:
        dtype = self.drafter.fc.weight.dtype
        new_kv = self.drafter.context_kv(features.to(dtype), positions)
        if self._context_kv is None:
            self._context_kv = new_kv
        else:
            self._context_kv = [
                (torch.cat([k, nk]), torch.cat([v, nv]))
                for (k, v), (nk, nv) in zip(self._context_kv, new_kv, strict=True)
            ]

    @torch.no_grad()
    def draft_logits(self, bonus_token: int, position: int) -> torch.Tensor:
        assert self._context_kv is not None, "extend_context must run before drafting"
        device = self._context_kv[0][0].device
        block = torch.full((self.depth + 1,), self.mask_token_id, dtype=torch.long, device=device)
        block[0] = bonus_token
        positions = torch.arange(position, position + self.depth + 1, device=device)
        dtype = self.drafter.fc.weight.dtype
        hidden = self.drafter(self.embed(block).to(dtype), positions, self._context_kv)
        return self.lm_head(hidden[1:].to(self.lm_head.weight.dtype)).float()


@dataclass
class RoundTrace:
    """One DDTree round, for debugging."""

    start: int  # committed tokens in the target cache before the round
    bonus_token: int  # the root
    tree: dict  # summarize() of the round's tree
    node_tokens: list[int]
    node_parents: list[int]
    target_tokens: list[int]  # target's token at every tree index (0 = root)
    accepted_path: list[int]  # tree indices, root first
    acceptance_length: int  # tokens committed this round = accepted nodes + 1
    emitted: list[int]


@dataclass
class GenerationResult:
    """Output of ``DDTreeReference.generate``."""

    token_ids: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    traces: list[RoundTrace] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per target forward (accepted drafts + 1), over decode rounds."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def decode_tokens_per_second(self) -> float:
        decode_time = self.total_seconds - self.prefill_seconds
        return (len(self.token_ids) - 1) / decode_time if decode_time > 0 else float("nan")


def _choose_tokens(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """long ``[n]``: argmax (T = 0) or one independent sample per row of ``logits`` ``[n, V]``."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _forward(target: nn.Module, **kwargs):
    """``target(**kwargs)`` with the KV cache passed as ``past_key_values`` (accepted by every
    transformers 4.5x/5.x; newer releases warn that it is being renamed)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        return target(**kwargs)


def _compact_cache(cache, start: int, accepted_rows: torch.Tensor) -> None:
    """Move K/V rows ``start + accepted_rows`` to ``start .. start + len - 1`` and crop.

    ``accepted_rows`` is increasing (parents precede children), so the in-place copy never
    overwrites a row it still has to read.
    """
    keep = accepted_rows.numel()
    contiguous = torch.equal(accepted_rows, torch.arange(keep, device=accepted_rows.device))
    if not contiguous:
        src = start + accepted_rows
        for layer in cache.layers:
            layer.keys[:, :, start : start + keep] = layer.keys[:, :, src]
            layer.values[:, :, start : start + keep] = layer.values[:, :, src]
    to_remove = cache.get_seq_length() - (start + keep)
    if to_remove > 0:
        cache.crop(-to_remove)  # negative: "remove this many" in every transformers 4.5x/5.x


class DDTreeReference:
    """DDTree decoding of one sequence with an HF causal LM target.

    Args:
        target: an HF ``*ForCausalLM`` (sdpa or eager attention; custom 4-D masks).
        draft_source: a ``DraftSource``, usually ``DFlashDraftSource(drafter, target)``.
        budget: tree nodes per round (root excluded).
        top_k: per-depth candidate cap (None: no cap beyond the budget).
    """

    def __init__(
        self,
        target: nn.Module,
        draft_source: DraftSource,
        tree_budget: int = 64,
        top_k: int | None = None,
        feature_layers: list[int] | None = None,
    ):
        self.target = target
        self.draft_source = draft_source
        self.tree_budget = tree_budget
        self.top_k = top_k
        if feature_layers is None:
            feature_layers = getattr(draft_source, "feature_layers", lambda: [])()
        self.feature_layers = feature_layers

    def _features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``[T, F]``: concatenated target hidden states the drafter reads (batch row 0)."""
        if not self.feature_layers:
            return hidden_states[-1][0, :, :0]
        return torch.cat([hidden_states[i][0] for i in self.feature_layers], dim=-1)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int] | torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        trace: bool = False,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (a list or long
        ``[T]``); stops after ``eos_token_id``. Returns the new tokens and per-round stats."""
        from transformers import DynamicCache

        device = next(self.target.parameters()).device
        dtype = next(self.target.parameters()).dtype
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).flatten()
        result = GenerationResult(token_ids=[])
        if max_new_tokens <= 0:
            return result
        t_begin = time.perf_counter()

        # Prefill: the prompt's K/V, its features for the drafter, the first token.
        cache = DynamicCache(config=self.target.config)
        out = _forward(
            self.target,
            input_ids=prompt[None],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        bonus = int(_choose_tokens(out.logits[0, -1:], temperature, generator)[0])
        self.draft_source.reset()
        start = prompt.numel()
        self.draft_source.extend_context(
            prompt, self._features(out.hidden_states), torch.arange(start, device=device)
        )
        result.token_ids.append(bonus)
        result.prefill_seconds = time.perf_counter() - t_begin
        stage = result.stage_seconds

        while len(result.token_ids) < max_new_tokens and bonus != eos_token_id:
            t0 = time.perf_counter()
            draft_logits = self.draft_source.draft_logits(bonus, start)
            t1 = time.perf_counter()
            tree = build_trees(draft_logits[None], self.tree_budget, self.top_k)
            num_nodes = int(tree.num_nodes[0])
            visible = ancestor_mask(tree)[0, : num_nodes + 1, : num_nodes + 1]
            t2 = time.perf_counter()

            input_ids = torch.cat(
                [torch.tensor([bonus], device=device), tree.token_ids[0, :num_nodes]]
            )
            depths = torch.cat(
                [torch.zeros(1, dtype=torch.long, device=device), tree.depths[0, :num_nodes]]
            )
            mask = torch.zeros((num_nodes + 1, start + num_nodes + 1), dtype=dtype, device=device)
            mask[:, start:] = torch.where(visible, 0.0, float("-inf")).to(dtype)
            out = _forward(
                self.target,
                input_ids=input_ids[None],
                position_ids=(start + depths)[None],
                attention_mask=mask[None, None],
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
            )
            chosen = _choose_tokens(out.logits[0], temperature, generator)
            target_tokens = torch.full(
                (1, tree.tree_budget + 1), -1, dtype=torch.long, device=device
            )
            target_tokens[0, : num_nodes + 1] = chosen
            accepted, num_accepted, new_bonus = follow_tree(tree, target_tokens)
            t3 = time.perf_counter()

            n_acc = int(num_accepted[0])
            path = accepted[0, : n_acc + 1]
            _compact_cache(cache, start, path)
            self.draft_source.extend_context(
                input_ids[path],
                self._features(out.hidden_states)[path],
                start + torch.arange(n_acc + 1, device=device),
            )
            emitted = tree.token_ids[0, path[1:] - 1].tolist() + [int(new_bonus[0])]
            t4 = time.perf_counter()

            if trace:
                result.traces.append(
                    RoundTrace(
                        start=start,
                        bonus_token=bonus,
                        tree=summarize(tree, num_accepted)[0],
                        node_tokens=tree.token_ids[0, :num_nodes].tolist(),
                        node_parents=tree.parents[0, :num_nodes].tolist(),
                        target_tokens=chosen.tolist(),
                        accepted_path=path.tolist(),
                        acceptance_length=n_acc + 1,
                        emitted=emitted,
                    )
                )
            stage["draft"] += t1 - t0
            stage["tree_build"] += t2 - t1
            stage["verify"] += t3 - t2
            stage["commit"] += t4 - t3
            result.acceptance_lengths.append(n_acc + 1)
            start += n_acc + 1
            bonus = int(new_bonus[0])
            for token in emitted:
                if len(result.token_ids) >= max_new_tokens:
                    break
                result.token_ids.append(token)
                if token == eos_token_id:
                    bonus = token
                    break
        result.total_seconds = time.perf_counter() - t_begin
        return result


@torch.no_grad()
def autoregressive_generate(
    target: nn.Module,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """The target alone, one token per forward (the baseline DDTree must reproduce)."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).flatten()
    result = GenerationResult(token_ids=[])
    t_begin = time.perf_counter()
    cache = DynamicCache(config=target.config)
    input_ids = prompt[None]
    while len(result.token_ids) < max_new_tokens:
        out = _forward(target, input_ids=input_ids, past_key_values=cache, use_cache=True)
        token = int(_choose_tokens(out.logits[0, -1:], temperature, generator)[0])
        if not result.token_ids:
            result.prefill_seconds = time.perf_counter() - t_begin
        result.token_ids.append(token)
        if token == eos_token_id:
            break
        input_ids = torch.tensor([[token]], device=device)
    result.total_seconds = time.perf_counter() - t_begin
    return result
