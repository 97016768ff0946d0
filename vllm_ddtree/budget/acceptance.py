"""What every smaller tree budget would have accepted, learned from the trees verified.

A best-first tree of budget ``B`` holds the best-first tree of every budget ``b < B`` as its
first ``b`` nodes, and a node's ancestors come before it. The walk of the cut tree follows the
same target tokens (at T = 0, and under keyed sampling, the target's token at a node does not
depend on the tree), so it accepts the longest prefix of the accepted path whose nodes are all
among the first ``b``: since tree indices grow along a path, the path's nodes with index at
most ``b`` (``accepted_within_budgets``). One verified tree therefore tells the acceptance of
every budget up to the nodes it verified; ``OnlineAcceptance`` keeps decayed sums of them per
candidate budget on the device (no host synchronisation per step) for ``"auto"`` to read.

A budget learns only from trees at least that wide, and "auto" serves wide trees where few
requests run: to a batch's last requests, which accept least. So a budget's estimate is its
gain over the next narrower budget on the trees both saw, applied to the narrower one's
estimate, down to the narrowest, which every tree tells.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_ddtree.config import get_ddtree_config

HALF_LIFE_STEPS = 256.0  # a verified step's weight halves after this many more steps


def accepted_within_budgets(
    accepted: torch.Tensor, num_accepted: torch.Tensor, budgets: torch.Tensor
) -> torch.Tensor:
    """long ``[R, C]``: the drafted tokens each request's tree would have accepted cut to each
    of ``budgets`` (long ``[C]``) nodes. ``accepted``: long ``[R, L + 1]``, the accepted tree
    indices, root first (``follow_tree``); ``num_accepted``: long ``[R]``."""
    path = accepted[:, 1:]  # [R, L]: tree index i is node i - 1 in best-first order
    depth = torch.arange(1, path.shape[1] + 1, device=path.device)
    on_path = depth.unsqueeze(0) <= num_accepted.unsqueeze(1)
    within = on_path.unsqueeze(2) & (path.unsqueeze(2) <= budgets.view(1, 1, -1))
    return within.sum(dim=1)


def paired_estimates(
    budgets: list[int], accepted: list[float], trees: list[float], narrower: list[float]
) -> dict[int, tuple[float, float]]:
    """``{budget: (tokens per verify step, trees behind it)}`` from ``OnlineAcceptance``'s
    sums by budget (ascending): the narrowest budget's mean, then each wider budget's
    tokens per step over the next narrower one's on the same trees, times that one's
    estimate. Budgets without a tree are left out (and every wider one: they have fewer)."""
    estimates: dict[int, tuple[float, float]] = {}
    tokens = 0.0
    for c, budget in enumerate(budgets):
        n = trees[c]
        if n <= 0:
            break
        if c == 0:
            tokens = 1.0 + accepted[0] / n
        else:
            tokens *= (n + accepted[c]) / (n + narrower[c])
        estimates[budget] = (tokens, n)
    return estimates


class OnlineAcceptance:
    """Decayed per-budget acceptance of one engine's verified trees.

    Each step, every request whose verified tree had at least ``b`` nodes adds one tree to
    budget ``b``'s count, its counterfactual accepted tokens to its sum, and those of the next
    narrower budget to a third sum (the pair ``snapshot`` compares); all decay by
    ``0.5 ** (1 / half_life_steps)`` per step, so a workload shift is followed within a few
    half-lives. A budget above the nodes a request verified learns nothing from it."""

    def __init__(
        self,
        budgets: list[int],
        half_life_steps: float,
        device: torch.device,
        copy_event: Callable[[], Any] | None = None,
    ):
        self.budgets = sorted(set(budgets))
        self._budgets = torch.tensor(self.budgets, dtype=torch.long, device=device)
        self._decay = 0.5 ** (1.0 / half_life_steps)
        # By budget, decayed over the trees at least that wide: row 0 its accepted drafted
        # tokens, row 1 the trees, row 2 the next narrower budget's accepted drafted tokens
        # (the budget's own for the narrowest).
        self._sums = torch.zeros(3, len(self.budgets), dtype=torch.float64, device=device)
        # Host copies of ``_sums``, made without waiting (see ``_publish``): two pinned
        # buffers taking turns, each with the event of its last copy.
        on_cuda = torch.device(device).type == "cuda"
        # What marks a host copy's end (``query()``: finished); None where copies are
        # synchronous (CPU).
        self._copy_event = copy_event or (torch.cuda.Event if on_cuda else None)
        self._host = [
            torch.zeros(self._sums.shape, dtype=self._sums.dtype, pin_memory=on_cuda)
            for _ in range(2)
        ]
        self._copied: list = [None, None]
        self._newest: int | None = None  # the buffer given the latest copy
        self._last_read: dict[int, tuple[float, float]] = {}

    def observe(
        self, accepted: torch.Tensor, num_accepted: torch.Tensor, num_nodes: torch.Tensor
    ) -> None:
        """One step's walk (``accepted``, ``num_accepted`` as ``follow_tree``) over trees of
        ``num_nodes`` verified nodes (long ``[R]``; 0 for a request without a tree)."""
        counts = accepted_within_budgets(accepted, num_accepted, self._budgets)
        known = num_nodes.unsqueeze(1) >= self._budgets.unsqueeze(0)  # [R, C]
        narrower = torch.cat((counts[:, :1], counts[:, :-1]), dim=1)
        step = torch.stack(
            (
                torch.where(known, counts, 0).sum(0),
                known.sum(0),
                torch.where(known, narrower, 0).sum(0),
            )
        ).to(self._sums)
        self._sums.mul_(self._decay).add_(step)
        self._publish()

    def _publish(self) -> None:
        """Copy the sums to the host behind this step's work (non-blocking, on the device's
        stream), into the buffer not given the latest copy: ``snapshot`` reads whichever
        finished, and the engine core's read between steps never waits for the device's
        queue (a host read of device tensors would: a bubble in the asynchronous schedule at
        every refresh)."""
        turn = 0 if self._newest is None else self._newest ^ 1
        if self._copied[turn] is not None and not self._copied[turn].query():
            return  # the device is two steps behind: this buffer's copy is still to come
        self._host[turn].copy_(self._sums, non_blocking=True)
        if self._copy_event is not None:
            event = self._copy_event()
            event.record()
            self._copied[turn] = event
        self._newest = turn

    def snapshot(self) -> dict[int, tuple[float, float]]:
        """``{budget: (tokens per verify step, decayed trees behind it)}`` as of the newest
        finished host copy (on a GPU at most a step or two behind; never a wait for the
        device); budgets without a tree left out. Tokens per step: for the narrowest budget 1
        + its mean accepted drafted tokens; for a wider one the next narrower budget's times
        their ratio on the trees at least this wide (``paired_estimates``)."""
        newest = self._newest
        for turn in () if newest is None else (newest, newest ^ 1):
            event = self._copied[turn]
            # Synchronous copies (no events) are done as made; otherwise a buffer without an
            # event was never copied into.
            if self._copy_event is None or (event is not None and event.query()):
                self._last_read = paired_estimates(self.budgets, *self._host[turn].tolist())
                break
        return dict(self._last_read)


def moves_online(vllm_config) -> bool:
    """Whether this engine's "auto" moves its budget online: several budgets to move between
    (``DDTreeConfig.online_budgets``), each with its verify graphs (V2: the schedule's widths)
    or without graphs at all (V1: its graphs have one width), on one data-parallel rank."""
    from vllm.config import CUDAGraphMode

    ddtree = get_ddtree_config(vllm_config.speculative_config)
    if ddtree is None or len(ddtree.online_budgets) < 2:
        return False
    parallel_config = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel_config, "data_parallel_size", 1) > 1:
        return False  # each rank would move by its own acceptance: ranks must verify alike
    return (
        ddtree.runner == "v2" or vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    )


def make_tracker(vllm_config, device: torch.device):
    """The worker's ``OnlineAcceptance`` for an engine that moves its budget online, else
    None."""
    if not moves_online(vllm_config):
        return None
    ddtree = get_ddtree_config(vllm_config.speculative_config)
    return OnlineAcceptance(list(ddtree.online_budgets), HALF_LIFE_STEPS, device)
