"""The experimental V2-runner path (``vllm_ddtree/runner_v2.py``) on the CPU: vLLM's V2 runner
cannot run here, so these check what can be checked without it: the seams it wraps still exist
with the parameters it uses, the walk's output is what V2's ``post_update`` consumes, and the
runner choice follows ``VLLM_DDTREE_RUNNER``. Its end-to-end check is
``benchmarks/lossless_gpu.py --runner v2`` on a GPU host."""

import pytest
import torch

from tests.test_tree_ops import walked_batch
from vllm_ddtree.tree import follow_tree

pytest.importorskip("vllm")


def test_the_v2_seams_exist_with_the_parameters_the_hooks_use():
    from vllm_ddtree.runner_v2 import check_v2_signatures

    check_v2_signatures()


def test_install_wraps_the_v2_runner_once(monkeypatch):
    from vllm.v1.worker.gpu import model_runner

    from vllm_ddtree import runner_v2

    runner = model_runner.GPUModelRunner
    for owner, name in (
        (runner, "prepare_attn"),
        (runner, "sample"),
        (model_runner, "init_speculator"),
    ):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    runner_v2.install(model_runner)
    wrapped = (runner.prepare_attn, runner.sample, model_runner.init_speculator)
    runner_v2.install(model_runner)
    assert (runner.prepare_attn, runner.sample, model_runner.init_speculator) == wrapped
    assert all(fn.__wrapped__ is not fn for fn in wrapped)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_walk_in_v2_sampler_format(seed):
    """Per request: the accepted nodes' tokens then the bonus (what target-alone decoding
    would have produced), ``num_sampled`` = accepted + 1, rows laid out root first from
    ``first_row`` (V2's ``cu_num_logits``), requests without drafts emitting their bonus only."""
    from vllm_ddtree.runner_v2 import tree_sampler_output

    tree, target = walked_batch(4, 5, 50, 12, seed)
    num_reqs, width = tree.token_ids.shape
    accepted_ref, num_accepted_ref, bonus_ref = follow_tree(tree, target)
    num_draft = torch.full((num_reqs,), width)
    first_row = torch.arange(num_reqs) * (width + 1)
    chosen = target.reshape(-1)
    sampled, num_sampled, accepted, num_accepted = tree_sampler_output(
        tree, chosen, first_row, num_draft, width + 1
    )
    assert sampled.dtype == torch.int64 and num_sampled.dtype == torch.int32
    assert torch.equal(num_accepted, num_accepted_ref)
    assert torch.equal(num_sampled.long(), num_accepted_ref + 1)
    assert int(num_accepted_ref.max()) >= 2  # the walks went deep
    for r in range(num_reqs):
        n = int(num_accepted_ref[r])
        path = accepted_ref[r, 1 : n + 1]
        want = [*tree.token_ids[r, path - 1].tolist(), int(bonus_ref[r])]
        assert sampled[r, : n + 1].tolist() == want
        assert (sampled[r, n + 1 :] == -1).all()


def test_the_v2_runner_is_opt_in(monkeypatch, tmp_path, tiny_target_path, tiny_drafter_path):
    """DDTree pins vLLM's V1 runner unless VLLM_DDTREE_RUNNER=v2; VLLM_USE_V2_MODEL_RUNNER=1
    alone is refused naming the switch."""
    from tests.test_vllm_config import engine_config
    from vllm_ddtree.config import DDTreeConfigError, v2_requested

    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(DDTreeConfigError, match="VLLM_DDTREE_RUNNER=v2"):
        engine_config(tiny_target_path, spec)
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    assert v2_requested()
    # The pin is lifted: vLLM's own choice applies, and vLLM-CPU refuses V2 ("requires Triton").
    with pytest.raises(Exception, match="Model Runner V2 requires Triton"):
        engine_config(tiny_target_path, spec)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    config = engine_config(tiny_target_path, spec)
    assert config.use_v2_model_runner is False  # vLLM's choice on the CPU platform
    assert config.speculative_config.num_speculative_tokens == 8
