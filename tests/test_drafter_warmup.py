"""vllm_ddtree/spec_decode/drafter_warmup.py: vLLM's DFlash input kernel compiled at start for
every block size it can take on a V2 engine (its launches recorded here; the kernel itself
needs a GPU: the 8B scale-model grid runs it)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_ddtree.spec_decode import drafter_warmup


def test_the_block_size_follows_vllms_rule():
    """vLLM's ``prepare_dflash_inputs``: ``min(256, triton.next_power_of_2(max(1, widest +
    drafter query)))``."""
    triton = pytest.importorskip("triton")
    for width in range(1, 600):
        for query in (1, 8, 16):
            expected = min(256, triton.next_power_of_2(max(1, width + query)))
            assert drafter_warmup.drafter_block_size(width, query) == expected, (width, query)


def test_one_width_per_block_size_the_kernel_can_take():
    """A drafter query of 16: block sizes 32, 64, 128 and 256, from requests of 16, 48, 112
    and 240 tokens (each width lands on its block size); none past the token budget."""
    widths = drafter_warmup.widths_to_warm(16, 8192)
    assert widths == [16, 48, 112, 240]
    assert [drafter_warmup.drafter_block_size(w, 16) for w in widths] == [32, 64, 128, 256]
    assert drafter_warmup.widths_to_warm(16, 100) == [16, 48]
    assert drafter_warmup.widths_to_warm(8, 8192) == [8, 24, 56, 120, 248]


def stand_ins(monkeypatch, fail_at: int | None = None):
    """A runner and a DFlash speculator of two draft KV-cache groups, with vLLM's launcher
    and dummy batch replaced by recorders; the list each launch is recorded in."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.v1.worker.gpu import input_batch
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash

    launches = []

    def make_dummy(num_reqs, num_tokens, input_buffers):
        return SimpleNamespace(num_reqs=num_reqs, num_tokens=num_tokens, buffers=input_buffers)

    def prepare(*args):
        batch = args[7]
        if fail_at is not None and batch.num_tokens == fail_at:
            raise RuntimeError("no driver")
        launches.append((batch.num_reqs, batch.num_tokens, args))

    monkeypatch.setattr(input_batch.InputBatch, "make_dummy", staticmethod(make_dummy))
    monkeypatch.setattr(dflash, "prepare_dflash_inputs", prepare)
    runner = SimpleNamespace(
        max_num_tokens=8256,
        input_buffers=SimpleNamespace(device=torch.device("cpu")),
        req_states=SimpleNamespace(last_sampled_tokens="last", next_prefill_tokens="next"),
    )
    speculator = SimpleNamespace(
        num_query_per_req=16,
        draft_kv_cache_group_ids=[3, 5],
        input_buffers="drafter inputs",
        block_tables=SimpleNamespace(
            slot_mappings={3: "slots 3", 5: "slots 5"},
            input_block_tables={3: "table 3", 5: "table 5"},
            kernel_block_sizes={3: 16, 5: 32},
        ),
        context_positions="context positions",
        _context_slot_mappings=["context slots 0", "context slots 1"],
        sample_indices="indices",
        sample_pos="pos",
        sample_idx_mapping="mapping",
        parallel_drafting_token_id=151669,
        num_speculative_steps=15,
        max_num_reqs=64,
        max_num_tokens=8256,
        max_model_len=482,
        sample_from_anchor=False,
    )
    return runner, speculator, launches


def test_the_kernel_is_launched_once_per_block_size_and_group_with_the_engines_buffers(
    monkeypatch,
):
    runner, speculator, launches = stand_ins(monkeypatch)
    warmed = drafter_warmup.warm_drafter_inputs(runner, speculator)
    assert warmed == [16, 48, 112, 240]
    assert [(n, width) for n, width, _ in launches] == [
        (1, w) for w in (16, 16, 48, 48, 112, 112, 240, 240)
    ]
    _, _, args = launches[1]  # width 16, the second draft KV-cache group
    assert args[:7] == (
        "drafter inputs",
        "slots 5",
        "context positions",
        "context slots 1",
        "indices",
        "pos",
        "mapping",
    )
    assert [int(args[8][0]), int(args[9][0])] == [1, 0]  # one sampled, none rejected
    assert args[10:] == ("last", "next", "table 5", 32, 151669, 16, 15, 64, 8256, 482, False)


def test_a_failed_warm_up_is_a_warning_not_an_engine_failure(monkeypatch, caplog):
    """The engine serves without the warm-up (the kernel compiles when a width is first
    served): a failure logs what failed and returns the widths warmed before it."""
    runner, speculator, launches = stand_ins(monkeypatch, fail_at=48)
    with caplog.at_level(logging.WARNING, logger="vllm.ddtree"):
        warmed = drafter_warmup.warm_drafter_inputs(runner, speculator)
    assert warmed == [16] and len(launches) == 2
    assert "RuntimeError: no driver" in caplog.text
    assert "compiles at the first step that needs each block size instead" in caplog.text


def test_every_ddtree_v2_engine_warms_the_kernel_after_capture(monkeypatch):
    """The V2 capture wrapper (``v2_hooks``' functions around vLLM's capture): after vLLM
    captured its graphs, a DDTree engine (fixed budget or "auto") warms the kernel; an engine
    without DDTree is left alone."""
    pytest.importorskip("vllm")
    from vllm_ddtree.compat import v2_runner
    from vllm_ddtree.config import DDTreeConfig
    from vllm_ddtree.spec_decode import v2_hooks
    from vllm_ddtree.spec_decode.step_state import StepState

    warmed = []
    monkeypatch.setattr(v2_hooks, "warm_drafter_inputs", lambda runner, spec: warmed.append(runner))
    capture = v2_runner._wrap_capture_model(lambda runner: "captured")
    ddtree = DDTreeConfig(32, 8, 15, runner="v2")
    runner = SimpleNamespace(speculator=SimpleNamespace(ddtree=ddtree, state=StepState()))
    assert capture(runner) == "captured" and warmed == [runner]
    chain = SimpleNamespace(speculator=SimpleNamespace())
    assert capture(chain) == "captured" and warmed == [runner]
