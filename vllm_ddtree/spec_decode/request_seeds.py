"""Each request's sampling seed on the V1 runner, for the keyed noise (``ops/keyed_gumbel.py``).

A request with ``SamplingParams.seed`` uses it (its output is then a function of the seed
alone, whatever the batch or the tree budget); any other request gets a random 63-bit seed the
first time a step sees it, from torch's default CPU generator: vLLM seeds it alike on every
worker and every rank sees the same requests in the same order, so tensor-parallel ranks agree
on the seed (and so on every tree and sample). The drafter (end of a step) and the sampler (the
next step) read the same table, kept on the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_ddtree.spec_decode.step_state import runner_step_state


def as_int64(seed: int) -> int:
    """``seed``'s low 64 bits as an int64 (two's complement): vLLM accepts seeds up to
    2**64 - 1, the noise hashes the seed's 64 bits, and distinct seeds stay distinct."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _random_seed() -> int:
    """A 63-bit seed from torch's default CPU generator."""
    return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.long).item())


class RequestSeeds:
    """Seeds by request id; entries of finished requests are dropped as the table grows."""

    def __init__(self, keep: Callable[[str], bool]):
        """``keep(req_id)``: whether a request is still live (e.g. in the runner's requests)."""
        self._seeds: dict[str, int] = {}
        self._keep = keep

    def seeds(
        self,
        req_ids: Sequence[str],
        explicit_seed: Callable[[str], int | None],
        device: torch.device,
    ) -> torch.Tensor:
        """int64 ``[R]``: the seed of each request of ``req_ids`` (``explicit_seed(req_id)``:
        its ``SamplingParams.seed`` or ``None``)."""
        values = []
        for req_id in req_ids:
            seed = self._seeds.get(req_id)
            if seed is None:
                explicit = explicit_seed(req_id)
                seed = as_int64(int(explicit)) if explicit is not None else _random_seed()
                self._seeds[req_id] = seed
            values.append(seed)
        if len(self._seeds) > 4 * len(req_ids) + 1024:
            self._seeds = {k: v for k, v in self._seeds.items() if self._keep(k)}
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def runner_seeds(runner) -> RequestSeeds:
    """The V1 runner's seed table (created on first use, kept in its ``RunnerState``)."""
    state = runner_step_state(runner)
    if state.seeds is None:
        state.seeds = RequestSeeds(keep=lambda req_id: req_id in runner.requests)
    return state.seeds


def batch_seeds(runner, num_reqs: int, device: torch.device) -> torch.Tensor:
    """int64 ``[num_reqs]``: the seeds of the runner's first ``num_reqs`` batch rows."""

    def explicit_seed(req_id: str) -> int | None:
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        return getattr(params, "seed", None)

    req_ids = list(runner.input_batch.req_ids[:num_reqs])
    return runner_seeds(runner).seeds(req_ids, explicit_seed, device)
