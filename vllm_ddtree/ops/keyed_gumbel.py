"""Position-keyed Gumbel noise: one draw per (request, position), shared by target and drafter.

At temperature ``T > 0`` a position's token is ``argmax(logits / T + G(seed, key))``: Gumbel-max,
an exact sample from ``softmax(logits / T)`` when ``G`` is i.i.d. standard Gumbel noise over the
vocabulary. ``G`` is a pure function of the request's seed and the key (the position of the
logits row that chooses the token), so every token a DDTree step emits is the one target-alone
decoding with that noise emits; the tree only decides how many of them one step emits. The
drafter knows ``G`` before the target runs, so its tree is built from ``draft_logits / T +
G(seed, key)`` (*coupled* drafts): the first child at each depth is the drafter's own Gumbel-max
sample under the target's noise, equal to the target's token wherever the two distributions
agree, instead of the drafter's argmax, which the target's sample matches only with the
probability the target gives it.

Two sources of ``G``:

* ``keyed_gumbel_noise``: this project's (a splitmix64 hash of seed, key and token, 53-bit
  uniforms, float64 logs), in PyTorch on any device; the V1 runner samples the target's tokens
  with it (``spec_decode/v1_hooks._target_tokens``) and couples the drafts to it.
* ``perturb_like_vllm_v2``: vLLM 0.26.0's V2 sampler's own noise (Triton's Philox keyed by the
  request's seed and the row's position, as ``vllm/v1/worker/gpu/sample/gumbel.py`` draws it),
  applied in place to the drafter's logits inside its CUDA graph; the V2 runner's target tokens
  come from vLLM's sampler, so the drafts couple to them. CUDA only; its test compares it with
  vLLM's ``gumbel_sample``.

Shapes: ``seeds`` int64 ``[R]``; ``keys`` int64 ``[R, K]``; noise float32 ``[R, K, V]``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic on every device).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX_A = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX_B = -7723592293110705685  # 0x94D049BB133111EB

__all__ = [
    "couple_draft_logits",
    "keyed_gumbel_noise",
    "keyed_uniform",
    "perturb_like_vllm_v2",
]


def _shift_right(value: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (value >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(value: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic): a bijection whose output bits
    each depend on every input bit."""
    value = (value ^ _shift_right(value, 30)) * _MIX_A
    value = (value ^ _shift_right(value, 27)) * _MIX_B
    return value ^ _shift_right(value, 31)


def keyed_uniform(seeds: torch.Tensor, keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float64 ``[R, K, V]`` uniforms in (0, 1), a pure function of (seed, key, token).

    Args:
        seeds: int64 ``[R]``, one per request.
        keys: int64 ``[R, K]``, the positions whose noise is wanted.
        vocab_size: ``V``.
    """
    assert seeds.dim() == 1 and keys.dim() == 2 and keys.shape[0] == seeds.shape[0]
    stream = _mix64(_mix64(seeds.long()).unsqueeze(1) + keys.long() * _GOLDEN)  # [R, K]
    tokens = torch.arange(vocab_size, dtype=torch.long, device=keys.device) * _GOLDEN
    bits = _mix64(stream.unsqueeze(2) + tokens)  # [R, K, V]
    # The top 53 bits, centred in their interval: never exactly 0 or 1.
    return (_shift_right(bits, 11).to(torch.float64) + 0.5) * 2.0**-53


def keyed_gumbel_noise(seeds: torch.Tensor, keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 ``[R, K, V]`` standard Gumbel noise ``-log(-log(u))`` of ``keyed_uniform``."""
    return (-torch.log(-torch.log(keyed_uniform(seeds, keys, vocab_size)))).float()


def couple_draft_logits(
    draft_logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """The drafter's logits coupled to the target's keyed noise (``keyed_gumbel_noise``).

    Args:
        draft_logits: float ``[R, L, V]``, row ``d`` for the token at depth ``d + 1``.
        temperature: float ``[R]``; rows of requests at ``T <= 0`` (greedy) are returned as
            they are.
        seeds: int64 ``[R]``.
        keys: int64 ``[R, L]``, the key of the target row that will choose each depth's token
            (the position of its parent).

    Returns:
        float32 ``[R, L, V]``: ``draft_logits / T + G(seed, key)`` for sampled requests, the
        drafter's logits for the others.
    """
    # Every row computed and the greedy rows put back (no host test of which rows sample: it
    # would wait for the device mid-step; the caller skips all-greedy batches by its host flag).
    sampled = (temperature > 0).view(-1, 1, 1)
    noise = keyed_gumbel_noise(seeds, keys, draft_logits.shape[-1])
    scale = torch.where(sampled, temperature.float().view(-1, 1, 1), 1.0)
    logits = draft_logits.float()
    return torch.where(sampled, logits / scale + noise, logits)


if HAS_TRITON:
    try:  # vLLM's own pieces of its sampler's noise (CUDA builds)
        from vllm.triton_utils import tldevice
        from vllm.v1.worker.gpu.sample.gumbel import tl_rand32, tl_rand64

        HAS_VLLM_GUMBEL = True
    except Exception:  # pragma: no cover - vLLM-CPU builds have no Triton helpers
        HAS_VLLM_GUMBEL = False
else:  # pragma: no cover
    HAS_VLLM_GUMBEL = False


if HAS_VLLM_GUMBEL:

    @triton.jit
    def _perturb_like_vllm_v2_kernel(
        logits_ptr,
        logits_stride,
        idx_mapping_ptr,
        temperature_ptr,
        seeds_ptr,
        keys_ptr,
        vocab_size,
        BLOCK_SIZE: tl.constexpr,
        USE_FP64: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        state = tl.load(idx_mapping_ptr + row).to(tl.int64)
        if state < 0:  # a CUDA-graph padding row
            return
        temperature = tl.load(temperature_ptr + state).to(tl.float32)
        if temperature == 0.0:  # greedy: the tree keeps the drafter's distribution
            return
        block = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = block < vocab_size
        logits = tl.load(logits_ptr + row * logits_stride + block, mask=mask).to(tl.float32)
        logits = logits / temperature
        # The noise vLLM's sampler adds at this key (gumbel_block_argmax, vLLM 0.26.0).
        gumbel_seed = tl.randint(tl.load(seeds_ptr + state), tl.load(keys_ptr + row))
        if USE_FP64:
            uniform = tl_rand64(gumbel_seed, block, includes_zero=False)
            noise = (-tl.log(-tl.log(uniform))).to(tl.float32)
        else:
            uniform = tl_rand32(gumbel_seed, block, includes_zero=False)
            noise = -tl.log(-tldevice.log1p(-uniform))
        tl.store(logits_ptr + row * logits_stride + block, logits + noise, mask=mask)


def perturb_like_vllm_v2(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    keys: torch.Tensor,
    use_fp64: bool = False,
) -> None:
    """In place, on CUDA: each sampled row of ``logits`` becomes ``logits / T + G``, with the
    Gumbel noise vLLM 0.26.0's V2 sampler adds at that row's key (no host synchronisation:
    safe inside a CUDA graph).

    Args:
        logits: float32 ``[rows, V]`` (contiguous rows).
        idx_mapping: int ``[rows]``, each row's request state (``-1``: padding, untouched).
        temperature: float ``[max_num_reqs]``, seeds: int64 ``[max_num_reqs]``: by request
            state, as vLLM's sampling states hold them.
        keys: int64 ``[rows]``: the position vLLM's sampler keys the noise by (the position
            of the row that chooses the token: the predicted token's position minus one).
        use_fp64: vLLM's ``model_config.use_fp64_gumbel``.
    """
    if not HAS_VLLM_GUMBEL:
        raise RuntimeError("vllm-ddtree: vLLM's V2 Gumbel noise needs vLLM's Triton build")
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    block_size = 8192
    _perturb_like_vllm_v2_kernel[(num_rows, triton.cdiv(vocab_size, block_size))](
        logits,
        logits.stride(0),
        idx_mapping,
        temperature,
        seeds,
        keys,
        vocab_size,
        BLOCK_SIZE=block_size,
        USE_FP64=use_fp64,
    )
