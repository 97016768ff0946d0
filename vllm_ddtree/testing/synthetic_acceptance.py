"""Calibrated synthetic acceptance: drafter logits built around the target's own continuation.

A scale model's drafter has random weights, so its proposals would never be accepted. For speed
measurements its per-depth logits are replaced (after its real forward, behind the test oracle's
switch) by synthetic ones in which the token the target will produce at that depth has a rank
drawn from a per-depth model (``RankModel``):

* at depth ``d`` (1-based) the true token is ranked first with probability
  ``p_top x decay^(d - 1)``;
* otherwise its rank is ``1 + G`` with ``G`` geometric: ``P(G = g) ~ tail^g`` (capped at the
  candidates ``CANDIDATES - 1``);
* the drafter's distribution over its ranked candidates is ``softmax(-slope x rank)`` (the
  other tokens at -inf) where it ranks the true token first, ``softmax(-miss_slope x rank)``
  where it does not: a drafter is less sure where it is wrong, and a tree's best-first build
  spends its nodes where the drafter hesitates.

The chain accepts the true token at a depth only when it is ranked first, so its acceptance
length is ``1 + sum_k prod_{d <= k} p_top x decay^(d - 1)``; a tree of ``budget`` nodes also
catches true tokens ranked lower, as far as the budget reaches. ``simulate`` measures both by
building real trees (``tree.build_trees``) over synthetic logits and walking them
(``tree.follow_tree``); ``benchmarks/calibrate_acceptance.py`` fits the model's parameters to
published acceptance lengths. Only which tokens the drafter proposes changes: the engine, the
verify, the walk and the KV commit are the real ones, and output must still equal the target's.

In an engine the draws are keyed (``DrawKeys``): a fixed function of the request's reference
sequence, the position the row predicts and its depth, as a real drafter's proposals are a
function of the context. Engines that reach the same position of a request then propose the same
tokens there, whatever else they batched or drew before, and a repeated request is drafted
alike: a paired comparison of engines measures their cost and their trees, not their draws.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from vllm_ddtree.tree import build_trees, follow_tree

CANDIDATES = 64  # ranked tokens per depth (the rest at -inf)


@dataclass(frozen=True)
class RankModel:
    """Where the target's token ranks among the drafter's candidates, per depth."""

    p_top: float  # P(ranked first) at depth 1
    decay: float = 1.0  # per-depth factor of P(ranked first)
    tail: float = 0.5  # geometric ratio of the rank below the first
    slope: float = 3.0  # logit drop per rank where the true token is ranked first
    miss_slope: float = 1.0  # logit drop per rank where it is not

    def first_probability(self, depth: int) -> torch.Tensor:
        """float ``[depth]``: P(ranked first) at depths 1..depth."""
        return self.p_top * self.decay ** torch.arange(depth, dtype=torch.float64)

    def chain_acceptance(self, depth: int = 15) -> float:
        """The DFlash chain's expected acceptance length (accepted drafts + the bonus)."""
        return 1.0 + float(torch.cumprod(self.first_probability(depth), 0).sum())

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RankRows:
    """``RankModel`` parameters per row (float ``[rows]`` tensors each): rows of one batch may
    follow different models (prompts of different datasets in one batch)."""

    p_top: torch.Tensor
    decay: torch.Tensor
    tail: torch.Tensor
    slope: torch.Tensor
    miss_slope: torch.Tensor

    @staticmethod
    def table(models: list[RankModel], device: torch.device | str = "cpu") -> torch.Tensor:
        """float64 ``[M, 5]``: the models' parameters, the rows ``of`` gathers from."""
        fields = [[m.p_top, m.decay, m.tail, m.slope, m.miss_slope] for m in models]
        return torch.tensor(fields, dtype=torch.float64, device=device)

    @classmethod
    def of(cls, table: torch.Tensor, index: torch.Tensor) -> RankRows:
        """Row ``r`` follows model ``index[r]`` of ``table`` (device tensors only)."""
        return cls(*table[index.long()].unbind(1))

    @classmethod
    def broadcast(cls, model: RankModel, rows: int, device: torch.device | str) -> RankRows:
        table = cls.table([model], device)
        return cls.of(table, torch.zeros(rows, dtype=torch.long, device=device))

    def first_probability(self, depth: int) -> torch.Tensor:
        """float32 ``[rows, depth]``: P(ranked first) at depths 1..depth."""
        steps = torch.arange(depth, dtype=torch.float64, device=self.p_top.device)
        return (self.p_top.unsqueeze(1) * self.decay.unsqueeze(1) ** steps).float()


def _rows(model: RankModel | RankRows, rows: int, device) -> RankRows:
    return model if isinstance(model, RankRows) else RankRows.broadcast(model, rows, device)


_MASK32 = 0xFFFFFFFF
# Streams of keyed draws: P(ranked first), the rank below the first, the other candidates.
_FIRST, _BELOW, _OTHERS = 1, 2, 3
_STREAMS = _OTHERS - _FIRST + 1  # (consecutive)


def _mix32(x):
    """A 32-bit integer hash of ``x`` (a long tensor or an int, each in [0, 2^32)); the
    multipliers stay below 2^31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class DrawKeys:
    """What a row's draws are a function of: long ``sequence`` ``[R]`` (the request's reference
    sequence) and long ``position`` ``[R, D]`` (the sequence index each depth predicts), under
    ``seed``."""

    sequence: torch.Tensor
    position: torch.Tensor
    seed: int = 0

    def uniform(self, stream: int) -> torch.Tensor:
        """float64 ``[R, D]`` in [0, 1): the draw of ``stream`` at each row and depth, a fixed
        function of (seed, stream, sequence, position, depth); device tensors only."""
        return self.uniforms(stream, 1)[0]

    def uniforms(self, first: int, count: int) -> torch.Tensor:
        """float64 ``[count, R, D]``: ``uniform(first + i)`` for each ``i``, hashed together
        (each hash step one device op for all the streams). The streams' salts are hashed on
        the device: no host tensor is copied in, so it runs in a CUDA graph."""
        device = self.position.device
        depth = self.position.shape[1]
        seeded = (self.seed * 0x9E3779B9) & _MASK32
        salt = _mix32((torch.arange(first, first + count, device=device) + seeded) & _MASK32)
        h = _mix32((self.sequence.long() & _MASK32).unsqueeze(0) ^ salt.unsqueeze(1))
        h = _mix32(h.unsqueeze(2) ^ (self.position.long() & _MASK32).unsqueeze(0))
        h = _mix32(h ^ torch.arange(depth, device=device))
        return h.double() / float(1 << 32)

    def drawn(self) -> KeyedDraws:
        """Every stream a row's synthetic logits take, drawn at once (``sample_ranks`` and
        ``synthetic_logits`` read them as they read ``uniform``): a third of the device ops
        of drawing them one by one, which an eager step pays in host time."""
        return KeyedDraws(self.uniforms(_FIRST, _STREAMS))


@dataclass(frozen=True)
class KeyedDraws:
    """``DrawKeys.drawn``: float64 ``draws`` ``[streams, R, D]`` from stream ``_FIRST`` on."""

    draws: torch.Tensor

    def uniform(self, stream: int) -> torch.Tensor:
        """``DrawKeys.uniform(stream)``, already drawn."""
        return self.draws[stream - _FIRST]


def sample_ranks(
    model: RankModel | RankRows,
    rows: int,
    depth: int,
    gen: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    keys: DrawKeys | KeyedDraws | None = None,
) -> torch.Tensor:
    """long ``[rows, depth]``: the true token's rank at each depth (0 = first), from one model
    or per row (``RankRows``); device tensors only, so it runs inside a CUDA graph. Drawn from
    ``keys`` (``DrawKeys``) where given, else from ``gen`` (None: the device's generator)."""
    params = _rows(model, rows, device)
    if keys is not None:
        first, uniform = keys.uniform(_FIRST).float(), keys.uniform(_BELOW).float()
    else:
        first = torch.rand(rows, depth, generator=gen, dtype=torch.float32, device=device)
        uniform = torch.rand(rows, depth, generator=gen, dtype=torch.float32, device=device)
    first = first < params.first_probability(depth)
    # Geometric rank below the first: floor(log u / log tail); a tail of 0 gives 0.
    log_tail = params.tail.clamp(min=1e-30).log().float().unsqueeze(1)
    below = torch.floor(uniform.clamp_min(1e-12).log() / log_tail).long()
    below = torch.where(params.tail.unsqueeze(1) > 0, below, torch.zeros_like(below))
    rank = (1 + below).clamp(max=CANDIDATES - 1)
    return torch.where(first, torch.zeros_like(rank), rank)


def synthetic_logits(
    model: RankModel | RankRows,
    truth: torch.Tensor,
    ranks: torch.Tensor,
    vocab_size: int,
    gen: torch.Generator | None = None,
    keys: DrawKeys | KeyedDraws | None = None,
) -> torch.Tensor:
    """float32 ``[R, D, V]``: at row ``r``, depth ``d``, ``CANDIDATES`` distinct tokens ranked
    by logit ``-slope x rank`` (``-miss_slope x rank`` where the true token is not first; one
    model or per row, as ``sample_ranks``), the
    true token ``truth[r, d]`` at rank ``ranks[r, d]``, every other token at -inf. The other
    candidates are drawn from ``keys`` where given, else from ``gen``."""
    rows, depth = truth.shape
    device = truth.device
    # The other candidates: CANDIDATES - 1 consecutive token ids a random shift past the truth
    # (offsets 1 .. V - 1 from it, so distinct and never the truth), without a draw and a top-k
    # over the whole vocabulary per mask row (which cost more than the drafter's output head).
    shifts = vocab_size - CANDIDATES + 1
    if keys is not None:
        shift = (keys.uniform(_OTHERS) * shifts).long().clamp(max=shifts - 1).unsqueeze(-1)
    else:
        shift = torch.randint(0, shifts, (rows, depth, 1), generator=gen, device=device)
    steps = torch.arange(1, CANDIDATES, device=device)
    others = (truth.unsqueeze(-1) + shift + steps) % vocab_size  # [R, D, C - 1]
    slots = torch.arange(CANDIDATES, device=device).view(1, 1, -1).expand(rows, depth, -1)
    # Candidate slot k holds rank k: the truth at its rank, the others filling the remaining.
    before = slots < ranks.unsqueeze(-1)
    other_index = torch.where(before, slots, slots - 1).clamp(min=0, max=CANDIDATES - 2)
    tokens = torch.where(
        slots == ranks.unsqueeze(-1),
        truth.unsqueeze(-1).expand(-1, -1, CANDIDATES),
        others.gather(2, other_index),
    )
    logits = torch.full((rows, depth, vocab_size), float("-inf"), device=device)
    params = _rows(model, rows, device)
    sure, unsure = params.slope.float().unsqueeze(1), params.miss_slope.float().unsqueeze(1)
    slope = torch.where(ranks == 0, sure, unsure).unsqueeze(-1)
    logits.scatter_(2, tokens, (-slope * slots).float())
    return logits


def simulate(
    model: RankModel,
    budgets: list[int],
    rounds: int = 2000,
    depth: int = 15,
    vocab_size: int = 256,
    seed: int = 0,
) -> dict[str, float]:
    """Mean acceptance length of the chain (``"chain"``) and of trees of each budget
    (``"b{budget}"``) over ``rounds`` synthetic drafter blocks."""
    gen = torch.Generator().manual_seed(seed)
    truth = torch.randint(0, vocab_size, (rounds, depth), generator=gen)
    ranks = sample_ranks(model, rounds, depth, gen)
    logits = synthetic_logits(model, truth, ranks, vocab_size, gen)
    first_miss = (ranks != 0).long().argmax(dim=1)
    all_first = (ranks == 0).all(dim=1)
    chain = torch.where(all_first, torch.full_like(first_miss, depth), first_miss)
    out = {"chain": 1.0 + float(chain.double().mean())}
    for tree_budget in budgets:
        trees = build_trees(logits, tree_budget)
        # The target's token at every tree index: the truth one depth below that node.
        node_depth = torch.cat(
            [torch.zeros(rounds, 1, dtype=torch.long), trees.depths.long()], dim=1
        ).clamp(max=depth - 1)
        target = truth.gather(1, node_depth)
        _, num_accepted, _ = follow_tree(trees, target)
        out[f"b{tree_budget}"] = 1.0 + float(num_accepted.double().mean())
    return out
