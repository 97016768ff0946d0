"""Test-only float32 GDN prefill (float32_gdn_prefill.py): the chain equals decoding token by
token, and only float32 calls leave vLLM's kernel."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.testing.float32_gdn_prefill import _wrap_forward, chunk_gated_delta_rule_as_chain

HK, HV, DK, DV = 2, 4, 16, 8


def sequential(q, k, v, g, beta, state, l2norm=True):
    """Plain float64 gated delta rule over one sequence: outputs ``[L, Hv, V]`` and the final
    state in vLLM's ``[Hv, V, K]`` layout."""
    h = state.double().transpose(-1, -2)  # [Hv, K, V]
    outs = []
    for t in range(q.shape[0]):
        qn = q[t].double().repeat_interleave(HV // HK, 0)
        kn = k[t].double().repeat_interleave(HV // HK, 0)
        if l2norm:
            qn = qn / torch.sqrt((qn * qn).sum(-1, keepdim=True) + 1e-6)
            kn = kn / torch.sqrt((kn * kn).sum(-1, keepdim=True) + 1e-6)
        h = h * torch.exp(g[t].double())[:, None, None]
        u = beta[t].double()[:, None] * (v[t].double() - torch.einsum("hkv,hk->hv", h, kn))
        h = h + kn[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", h, qn * DK**-0.5))
    return torch.stack(outs), h.transpose(-1, -2)


def packed_case(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, total, HK, DK, generator=gen)
    k = torch.randn(1, total, HK, DK, generator=gen)
    v = torch.randn(1, total, HV, DV, generator=gen)
    g = -torch.rand(1, total, HV, generator=gen)
    beta = torch.rand(1, total, HV, generator=gen)
    state = torch.randn(len(lengths), HV, DV, DK, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, g, beta, state, cu


def test_packed_sequences_equal_token_by_token_decoding():
    lengths = [5, 1, 9]
    q, k, v, g, beta, state, cu = packed_case(lengths)
    o, final = chunk_gated_delta_rule_as_chain(q, k, v, g, beta, state, cu, True)
    assert o.shape == (1, sum(lengths), HV, DV) and final.shape == state.shape
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        want, want_state = sequential(
            q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], state[s]
        )
        torch.testing.assert_close(o[0, a:b].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[s].double(), want_state, atol=1e-5, rtol=1e-5)


def test_only_float32_calls_leave_vllms_kernel():
    calls = []

    def vllm_kernel(self, *args, **kwargs):
        calls.append(args[0].dtype)
        return "vllm", None

    forward = _wrap_forward(vllm_kernel)
    q, k, v, g, beta, state, cu = packed_case([3, 4])
    assert forward(None, q.bfloat16(), k, v, g, beta, state, True, cu)[0] == "vllm"
    assert calls == [torch.bfloat16]
    out = torch.zeros(7, HV, DV)
    o, final = forward(
        None, q, k, v, g, beta, state, False, cu, use_qk_l2norm_in_kernel=True, core_attn_out=out
    )
    assert calls == [torch.bfloat16] and final is None
    torch.testing.assert_close(out, o[0])
    want, _ = sequential(q[0, :3], k[0, :3], v[0, :3], g[0, :3], beta[0, :3], state[0])
    torch.testing.assert_close(o[0, :3].double(), want, atol=1e-5, rtol=1e-5)


def test_install_wraps_both_forwards_of_vllms_op_once(monkeypatch):
    import importlib

    from vllm_ddtree.compat.gdn_dispatch import GDN_MODULE
    from vllm_ddtree.testing import float32_gdn_prefill

    module = importlib.import_module(GDN_MODULE)
    op = module.ChunkGatedDeltaRule
    originals = {name: getattr(op, name) for name in ("forward_native", "forward_cuda")}
    for name, fn in originals.items():
        monkeypatch.setattr(op, name, fn)  # restored after the test
    float32_gdn_prefill.install()
    float32_gdn_prefill.install()
    for name, fn in originals.items():
        assert getattr(op, name).__wrapped__ is fn


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton path needs a GPU")
def test_on_gpu_the_kernel_chain_equals_token_by_token_decoding():
    lengths = [37, 1, 64, 5]
    case = [t.cuda() for t in packed_case(lengths, seed=3)]
    o, final = chunk_gated_delta_rule_as_chain(*case, True)
    q, k, v, g, beta, state, cu = (t.cpu() for t in case)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        want, want_state = sequential(
            q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], state[s]
        )
        torch.testing.assert_close(o[0, a:b].cpu().double(), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[s].cpu().double(), want_state, atol=1e-4, rtol=1e-4)
