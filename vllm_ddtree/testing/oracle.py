"""The test-only controllable drafter: target-future logits in place of the drafter's.

Never on by default. ``VLLM_DDTREE_TEST_ORACLE`` names a JSON file
``{"p_top": float, "seed": int, "sequences": [[token, ...], ...]}`` of target-only greedy
sequences (prompt + continuation). For a request whose prompt starts one of them, the logits of
the drafter's mask position predicting sequence index ``i`` become noise in which
``sequence[i]`` is ranked first with probability ``p_top`` and second otherwise, so the tree
paths are exercised deeply even with random weights (``benchmarks/lossless_gpu.py``).

With ``"rank_model": {...}`` (the fields of ``synthetic_acceptance.RankModel``) they are
instead that model's calibrated synthetic logits: ``sequence[i]`` at a rank drawn per depth,
among ranked candidates whose spread says how sure the drafter is (scale models' speed
measurements), drawn as a fixed function of the sequence, the predicted index and the depth
(``synthetic_acceptance.DrawKeys``): the same in both forms, in any batch, on every engine.
``"rank_models": {name: {...}}`` with ``"sequence_models": [name, ...]`` (one per sequence)
gives each sequence its own model (prompts of several datasets in one batch).

Two forms of the same rule:
- ``HostOracle``: per request on the host, from the prompts and positions; the plain statement
  of the rule, which the tests hold the device form to.
- ``DeviceOracle`` (both runners): tensors only, no host synchronisation, so it runs inside the
  V2 speculator's CUDA graph and never makes a V1 step wait for the device (a host read of the
  drafter's positions would idle the GPU through the rest of every step's host work, a cost
  serving without the oracle never pays); each request state (V1: batch row) is bound to its
  sequence on the host when its request first appears there (``bind``).
"""

from __future__ import annotations

import inspect
import json

import torch

from vllm_ddtree.testing.synthetic_acceptance import (
    DrawKeys,
    RankModel,
    RankRows,
    sample_ranks,
    synthetic_logits,
)

TRUTH_MARGIN = 8.0  # the ranked-first token's lead over the noise's maximum


def _load(path: str) -> dict:
    """The oracle file, its rank models as ``"models"`` (a list, empty without rank models)
    and ``"model_of_sequence"`` (each sequence's index into it)."""
    with open(path) as f:
        spec = json.load(f)
    spec["sequences"] = [list(s) for s in spec["sequences"]]
    spec["models"], spec["model_of_sequence"] = [], [0] * len(spec["sequences"])
    if spec.get("rank_models") is not None:
        names = list(spec["rank_models"])
        spec["models"] = [RankModel(**spec["rank_models"][name]) for name in names]
        chosen = spec.get("sequence_models") or []
        if len(chosen) != len(spec["sequences"]) or set(chosen) - set(names):
            raise ValueError(
                f"oracle {path}: sequence_models must name one of {names} per sequence"
            )
        spec["model_of_sequence"] = [names.index(name) for name in chosen]
    elif spec.get("rank_model") is not None:
        spec["models"] = [RankModel(**spec["rank_model"])]
    return spec


def match_sequence(sequences: list[list[int]], prompt: list[int]) -> int:
    """Index of the first sequence that starts with ``prompt``, or -1."""
    return next((i for i, s in enumerate(sequences) if s[: len(prompt)] == list(prompt)), -1)


class HostOracle:
    """Target-future drafter logits computed per request on the host (the reference form)."""

    def __init__(self, path: str, vocab_size: int):
        spec = _load(path)
        self.sequences = spec["sequences"]
        self.p_top = float(spec.get("p_top", 1.0))
        self.rank_table = RankRows.table(spec["models"]) if spec["models"] else None
        self.model_of_sequence = spec["model_of_sequence"]
        self.seed = int(spec.get("seed", 0))
        self.gen = torch.Generator().manual_seed(self.seed)
        self.vocab_size = vocab_size

    def logits(self, prompts: list[list[int]], bonus_positions: list[int], depth: int):
        """float32 ``[R, depth, V]``: row ``r``, depth ``d`` predicts sequence index
        ``bonus_positions[r] + 1 + d``."""
        if self.rank_table is not None:
            return self._ranked_logits(prompts, bonus_positions, depth)
        return self._p_top_logits(prompts, bonus_positions, depth)

    def _p_top_logits(self, prompts, bonus_positions, depth: int) -> torch.Tensor:
        out = torch.randn(len(prompts), depth, self.vocab_size, generator=self.gen)
        for r, (prompt, position) in enumerate(zip(prompts, bonus_positions, strict=True)):
            index = match_sequence(self.sequences, prompt)
            if index < 0:
                continue
            sequence = self.sequences[index]
            for d in range(depth):
                at = position + 1 + d
                if at >= len(sequence):
                    break
                row = out[r, d]
                top = float(row.max())
                truth = sequence[at]
                if torch.rand(1, generator=self.gen).item() < self.p_top:
                    row[truth] = top + TRUTH_MARGIN
                else:
                    rival = int(row.argmax()) if int(row.argmax()) != truth else (truth + 1)
                    row[rival % self.vocab_size] = top + TRUTH_MARGIN
                    row[truth] = top + TRUTH_MARGIN - 1.0
        return out

    def _ranked_logits(self, prompts, bonus_positions, depth: int) -> torch.Tensor:
        """The rank models' synthetic logits around each request's sequence (its sequence's
        model; noise where a request has none, or past its end)."""
        rows = len(prompts)
        truth = torch.zeros(rows, depth, dtype=torch.long)
        valid = torch.zeros(rows, depth, dtype=torch.bool)
        model_index = torch.zeros(rows, dtype=torch.long)
        sequence_index = torch.full((rows,), -1, dtype=torch.long)
        for r, (prompt, position) in enumerate(zip(prompts, bonus_positions, strict=True)):
            index = match_sequence(self.sequences, prompt)
            if index < 0:
                continue
            model_index[r] = self.model_of_sequence[index]
            sequence_index[r] = index
            ahead = self.sequences[index][position + 1 : position + 1 + depth]
            truth[r, : len(ahead)] = torch.tensor(ahead, dtype=torch.long)
            valid[r, : len(ahead)] = True
        predicted = torch.tensor(bonus_positions, dtype=torch.long).unsqueeze(1) + 1
        keys = DrawKeys(sequence_index, predicted + torch.arange(depth), self.seed).drawn()
        params = RankRows.of(self.rank_table, model_index)
        ranks = sample_ranks(params, rows, depth, keys=keys)
        ranked = synthetic_logits(params, truth, ranks, self.vocab_size, keys=keys)
        if bool(valid.all()):
            return ranked
        noise = torch.randn(rows, depth, self.vocab_size, generator=self.gen)
        return torch.where(valid.unsqueeze(-1), ranked, noise)


class DeviceOracle:
    """Target-future drafter logits from device tensors only (both runners; CUDA-graph safe)."""

    def __init__(self, path: str, vocab_size: int, max_num_reqs: int, device: torch.device):
        spec = _load(path)
        self.sequences = spec["sequences"]
        self.p_top = float(spec.get("p_top", 1.0))
        self.rank_table = RankRows.table(spec["models"], device) if spec["models"] else None
        self.model_of_sequence = torch.tensor(
            spec["model_of_sequence"] or [0], dtype=torch.long, device=device
        )
        self.vocab_size = vocab_size
        self.seed = int(spec.get("seed", 0))
        longest = max((len(s) for s in self.sequences), default=1)
        table = torch.full((max(1, len(self.sequences)), longest), -1, dtype=torch.long)
        for i, sequence in enumerate(self.sequences):
            table[i, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        self.tokens = table.to(device)  # long [S, L]: -1 past a sequence's end
        self.sequence_of_state = torch.full((max_num_reqs,), -1, dtype=torch.long, device=device)
        self.bound: dict[int, str] = {}  # request-state index -> request id

    def bind(self, states: list[int], req_ids: list[str], prompt_of) -> None:
        """Point each request state at its sequence (host side, once per new request);
        ``prompt_of(state)`` returns that request's prompt token ids."""
        for state, req_id in zip(states, req_ids, strict=True):
            if self.bound.get(state) == req_id:
                continue
            self.bound[state] = req_id
            self.sequence_of_state[state] = match_sequence(self.sequences, prompt_of(state))

    def logits(
        self, predicted_positions: torch.Tensor, states: torch.Tensor, depth: int = 1
    ) -> torch.Tensor:
        """float32 ``[n, V]`` for ``n`` mask rows: row ``i`` predicts index
        ``predicted_positions[i]`` (long ``[n]``) of the sequence bound to request state
        ``states[i]`` (``[n]``, -1 for padding rows: pure noise); rows come ``depth`` per
        request, depth 1 first (the depth a ``rank_model`` ranks by)."""
        n = predicted_positions.shape[0]
        device = self.tokens.device
        out = torch.randn(n, self.vocab_size, device=device, dtype=torch.float32)
        sequence = self.sequence_of_state[states.long().clamp(min=0)]
        at = predicted_positions.long().clamp(0, self.tokens.shape[1] - 1)
        truth = self.tokens[sequence.clamp(min=0), at]
        valid = (states >= 0) & (sequence >= 0) & (predicted_positions < self.tokens.shape[1])
        valid &= truth >= 0
        truth = truth.clamp(min=0)
        if self.rank_table is not None:
            blocks = truth.view(-1, depth)
            model_index = self.model_of_sequence[sequence.clamp(min=0)].view(-1, depth)[:, 0]
            params = RankRows.of(self.rank_table, model_index)
            keys = DrawKeys(
                sequence.view(-1, depth)[:, 0],
                predicted_positions.long().view(-1, depth),
                self.seed,
            ).drawn()
            ranks = sample_ranks(params, blocks.shape[0], depth, device=device, keys=keys)
            ranked = synthetic_logits(params, blocks, ranks, self.vocab_size, keys=keys)
            return torch.where(valid.unsqueeze(-1), ranked.view(n, -1), out)
        top, argmax = out.max(dim=-1)
        first = torch.rand(n, device=device) < self.p_top
        rival = torch.where(argmax == truth, (truth + 1) % self.vocab_size, argmax)
        rows = torch.arange(n, device=device)
        demoted = valid & ~first
        out[rows, rival] = torch.where(demoted, top + TRUTH_MARGIN, out[rows, rival])
        truth_value = torch.where(first, top + TRUTH_MARGIN, top + TRUTH_MARGIN - 1.0)
        out[rows, truth] = torch.where(valid, truth_value, out[rows, truth])
        return out


class OracleDraftSource:
    """The oracle as the draft source a proposer or speculator is given
    (``spec_decode/draft_source.py``): its logits replace the drafter's, for trees and for the
    DFlash chain, on both runners, after the drafter's logits are computed (their cost paid)."""

    def __init__(self, path: str, vocab_size: int, max_num_reqs: int, device: torch.device):
        self.oracle = DeviceOracle(path, vocab_size, max_num_reqs, device)

    def v1_logits(self, proposer, logits: torch.Tensor, num_reqs: int, depth: int):
        """``[R, depth, V]`` from the device's bonus positions: no host synchronisation (one
        would idle the GPU through the host's work of every step, a cost serving without the
        oracle never pays). Batch row ``r`` is the oracle's request state ``r``, bound to its
        request's sequence on the host when the row's request changes."""
        runner = proposer.runner
        req_ids = list(runner.input_batch.req_ids[:num_reqs])

        def prompt_of(row: int) -> list[int]:
            return list(runner.requests[req_ids[row]].prompt_token_ids or [])

        self.oracle.bind(list(range(num_reqs)), req_ids, prompt_of)
        device = logits.device
        ahead = 1 + torch.arange(depth, device=device)
        predicted = proposer._bonus_positions(num_reqs, depth).long().unsqueeze(1) + ahead
        rows = torch.arange(num_reqs, device=device).repeat_interleave(depth)
        return self.oracle.logits(predicted.view(-1), rows, depth).view(num_reqs, depth, -1)

    def v1_chain_drafts(self, proposer, hidden_states, sampling_metadata, vllm_drafts):
        """vLLM's DFlash chain drafting from the oracle's logits in place of its drafter's, as
        vLLM drafts from its own (greedy, or sampled with the probabilities its rejection
        sampler takes), so chain and trees are measured on the same synthetic acceptance."""
        depth = proposer.num_speculative_tokens
        num_reqs = hidden_states.shape[0] // depth
        drafter = proposer.model.compute_logits(hidden_states).view(num_reqs, depth, -1)
        logits = self.v1_logits(proposer, drafter, num_reqs, depth).view(num_reqs * depth, -1)
        if not proposer._enable_probabilistic_draft_probs or sampling_metadata.all_greedy:
            return logits.argmax(dim=-1), None
        return proposer._sample_from_logits(logits, sampling_metadata)

    def v2_bind(self, runner, input_batch) -> None:
        """Bind this step's new requests to their sequences (host reads of their prompts,
        before the step's proposal)."""
        states = [int(s) for s in input_batch.idx_mapping_np[: input_batch.num_reqs]]
        token_ids = runner.req_states.all_token_ids.gpu
        prompt_len = runner.req_states.prompt_len.np

        def prompt_of(state: int) -> list[int]:
            return token_ids[state, : int(prompt_len[state])].tolist()

        self.oracle.bind(states, list(input_batch.req_ids[: input_batch.num_reqs]), prompt_of)

    def v2_logits(self, logits, positions, idx_mapping, depth: int):
        """The mask rows' logits from vLLM's Gumbel keys (``positions``: predicted - 2)."""
        return self.oracle.logits(positions + 2, idx_mapping, depth)

    def v2_chain_speculator(self, vllm_config, device, vllm_speculator):
        """vLLM's V2 DFlash chain speculator drafting from the oracle's logits."""
        return chain_oracle_speculator_class()(vllm_config, device, self)


def chain_oracle_speculator_class():
    """vLLM's V2 DFlash chain speculator, sampling its drafts from the oracle's logits (made on
    first use: vLLM's V2 speculator is imported only where the V2 runner runs)."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    sample_draft_signature = inspect.signature(DFlashSpeculator.sample_draft)

    class ChainOracleSpeculator(DFlashSpeculator):
        _speculator_name = "DFlash (test oracle)"

        def __init__(self, vllm_config, device, source: OracleDraftSource):
            super().__init__(vllm_config, device)
            self.draft_source = source

        def sample_draft(
            self, hidden_states, positions, idx_mapping, temperature, seeds, *args, **kwargs
        ):
            """vLLM's chain sampling (greedy, or its Gumbel draw keyed like the target's) over
            the oracle's logits for these mask rows; vLLM's arguments bound by name."""
            bound = sample_draft_signature.bind(
                self,
                hidden_states,
                positions,
                idx_mapping,
                temperature,
                seeds,
                *args,
                **kwargs,
            )
            depth = self.num_speculative_steps
            drafter = self.model.compute_logits(hidden_states)  # the drafter's: their cost
            logits = self.draft_source.v2_logits(drafter, positions, idx_mapping, depth)
            draft_logits = bound.arguments["draft_logits"]
            if draft_logits is None:
                return logits.argmax(dim=-1)
            return gumbel_sample(
                logits,
                idx_mapping,
                temperature,
                seeds,
                positions + 1,
                apply_temperature=True,
                output_processed_logits=draft_logits,
                output_processed_logits_col=bound.arguments["draft_step"],
                use_fp64=self.use_fp64_gumbel,
            )

    return ChainOracleSpeculator
