"""The plugin's side of the hybrid tree path: vLLM's GatedDeltaNet calls routed by wrapping
its layer module's names (``compat/gdn_dispatch.py``), its GDN metadata build wrapped
(``gdn_dispatch.build_wrapper``) and the V1 runner's wrappers on hybrid
targets (``compat/v1_runner.py``). In vLLM's tree the layer and the runner make these calls
themselves (upstream patches 9 and 14), so these tests stay with the plugin."""

import pytest
import torch

from tests.test_gdn_layer import GDNLikeModule, layer_table_step
from tests.test_gdn_metadata import (
    OTHER_STEPS,
    TREE_STEPS,
    assert_same_metadata,
    make_builder,
    step_inputs,
)


def test_install_routes_only_the_speculative_gdn_calls_of_a_ddtree_forward(monkeypatch):
    """vLLM's module-level functions are wrapped: in a forward whose TREE_ATTN metadata carries
    a DDTree step state with a hybrid step, the speculative calls (those with
    ``num_accepted_tokens``) go to that step; every other call, and every call outside such a
    forward, to vLLM's function."""
    import importlib
    from types import SimpleNamespace

    from vllm.forward_context import override_forward_context

    from vllm_ddtree.compat import gdn_dispatch
    from vllm_ddtree.hybrid import gdn_layer
    from vllm_ddtree.spec_decode.step_state import StepState

    module = importlib.import_module(gdn_dispatch.GDN_MODULE)
    calls = []
    monkeypatch.setattr(module, "causal_conv1d_update", lambda *a, **k: calls.append("conv"))
    monkeypatch.setattr(
        module, "fused_sigmoid_gating_delta_rule_update", lambda *a, **k: calls.append("rec")
    )
    gdn_dispatch.install(torch.device("cpu"))
    step = gdn_layer.HybridTreeStep(max_rows=2, tree_budget=2, device=torch.device("cpu"))
    monkeypatch.setattr(step, "tree_conv", lambda *a, **k: calls.append("tree_conv"))
    monkeypatch.setattr(step, "tree_recurrence", lambda *a, **k: calls.append("tree_rec"))
    indices = torch.zeros(2, 3, dtype=torch.int32)
    conv, rec = module.causal_conv1d_update, module.fused_sigmoid_gating_delta_rule_update
    speculative = dict(num_accepted_tokens=indices[0], query_start_loc=indices[0], max_query_len=3)

    def every_call():
        conv(1, 2, 3, 4, "silu", conv_state_indices=indices[:, 0], validate_data=True)  # decode
        conv(1, 2, 3, 4, "silu", conv_state_indices=indices[:, 0], **speculative)
        rec(q=1, ssm_state_indices=indices[:, 0], num_accepted_tokens=None)  # plain decode
        rec(
            cu_seqlens=indices[0],
            A_log=1,
            a=2,
            b=3,
            dt_bias=4,
            q=5,
            k=6,
            v=7,
            initial_state=8,
            ssm_state_indices=indices,
            num_accepted_tokens=indices[0],
        )

    tree_forward = SimpleNamespace(
        attn_metadata={
            "model.layers.0.linear_attn": SimpleNamespace(),  # a GDN layer's metadata
            "model.layers.3.self_attn": SimpleNamespace(tree_source=StepState(hybrid=step)),
        }
    )
    with override_forward_context(tree_forward):
        every_call()
    assert calls == ["conv", "tree_conv", "rec", "tree_rec"]
    gdn_dispatch.install(torch.device("cpu"))
    assert module.causal_conv1d_update is conv, "installing twice does not wrap twice"
    calls.clear()
    every_call()  # outside a forward
    plain_forward = SimpleNamespace(
        attn_metadata={"model.layers.3.self_attn": SimpleNamespace(tree_source=StepState())}
    )
    with override_forward_context(plain_forward):  # a dense DDTree engine's forward
        every_call()
    assert calls == ["conv", "conv", "rec", "rec"] * 2


def test_every_hybrid_architecture_accepted_uses_the_gdn_layer_the_tree_path_routes():
    """The hybrid targets DDTree accepts (Qwen3-Next, Qwen3.5 dense and MoE) are vLLM 0.26.0
    models whose GatedDeltaNet layer is ``QwenGatedDeltaNetAttention`` from the module whose
    speculative calls ``gdn_layer`` routes to the tree kernels; a vLLM that moves the layer
    fails here instead of silently verifying trees as chains."""
    import importlib.util

    pytest.importorskip("vllm")
    from vllm.model_executor.models.registry import _VLLM_MODELS

    from vllm_ddtree.compat.gdn_dispatch import GDN_MODULE
    from vllm_ddtree.config import GDN_TREE_ARCHITECTURES

    for architecture in GDN_TREE_ARCHITECTURES:
        module_name, class_name = _VLLM_MODELS[architecture]
        # Read, not imported: the Qwen3.5 modules import torchvision, absent on the CPU.
        spec = importlib.util.find_spec(f"vllm.model_executor.models.{module_name}")
        with open(spec.origin) as f:
            source = f.read()
        assert f"class {class_name}(" in source, architecture
        assert f"from {GDN_MODULE} import" in source, architecture
        assert "QwenGatedDeltaNetAttention(" in source, architecture


def test_a_step_with_a_prefill_never_replays_the_full_verify_graph():
    """vLLM calls a batch a uniform decode (and replays the FULL graph of ``1 + budget``-token
    verify rows) when every request has ``1 + budget`` tokens scheduled; a prompt of exactly
    that length has too. The hooks make such a step run piecewise: a FULL graph's GDN layers
    run only the tree branch, on buffers vLLM fills for tree rows alone."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.compat.v1_runner import _wrap_determine_batch_execution
    from vllm_ddtree.spec_decode.step_state import runner_step_state
    from vllm_ddtree.spec_decode.v1_hooks import rows_without_drafts

    budget = 8
    # vLLM's own rule: one 9-token prefill at budget 8 is a "uniform decode" batch.
    assert GPUModelRunner._is_uniform_decode(
        max_num_scheduled_tokens=1 + budget,
        uniform_decode_query_len=1 + budget,
        num_tokens=1 + budget,
        num_reqs=1,
    )
    assert rows_without_drafts(None)  # no request has drafts (e.g. prefills only)
    assert rows_without_drafts(SimpleNamespace(num_draft_tokens=[budget, 0]))
    assert not rows_without_drafts(SimpleNamespace(num_draft_tokens=[budget, budget]))

    seen = []

    def original(  # vLLM 0.26.0's parameters (its row in compat/seams.py)
        self,
        num_tokens,
        num_reqs,
        num_scheduled_tokens_np=None,
        max_num_scheduled_tokens=None,
        use_cascade_attn=False,
        allow_microbatching=False,
        force_eager=False,
        force_uniform_decode=None,
    ):
        seen.append(force_uniform_decode)

    wrapped = _wrap_determine_batch_execution(original)
    runner = SimpleNamespace()
    runner_step_state(runner).rows_without_drafts = True
    wrapped(runner, num_tokens=9, num_reqs=1)
    assert seen[-1] is False
    wrapped(runner, num_tokens=9, num_reqs=1)  # the answer belongs to one step
    assert seen[-1] is None
    runner_step_state(runner).rows_without_drafts = False  # every request verifies a tree
    wrapped(runner, num_tokens=18, num_reqs=2)
    assert seen[-1] is None
    runner_step_state(runner).rows_without_drafts = True  # a capture says what it captures
    wrapped(runner, num_tokens=9, num_reqs=1, force_uniform_decode=True)
    assert seen[-1] is True
    runner_step_state(runner).rows_without_drafts = True  # bound by name, not by position
    wrapped(runner, 9, 1, None, 9, False, False, False, None)
    assert seen[-1] is False


def test_a_chain_served_for_ddtree_gets_the_same_guard():
    """Where "tree_budget": "auto" chose vLLM's DFlash chain, a prompt of 1 + 15 tokens is the
    same trap (vLLM issue #49918): the hooks mark such a step for the chain's engines too, and
    leave plain DFlash engines alone."""
    from types import SimpleNamespace

    from vllm_ddtree.compat import DDTREE_CHAIN_ATTR
    from vllm_ddtree.compat.v1_runner import _wrap_prepare_inputs
    from vllm_ddtree.handles import HANDLE
    from vllm_ddtree.spec_decode.step_state import runner_step_state

    with_a_prefill = SimpleNamespace(num_draft_tokens=[15, 0])
    prepare = _wrap_prepare_inputs(lambda self, out, counts: (None, with_a_prefill))
    served = SimpleNamespace(drafter=None, speculative_config=SimpleNamespace())
    setattr(served.speculative_config, DDTREE_CHAIN_ATTR, True)
    prepare(served, None, [16, 16])
    assert runner_step_state(served).rows_without_drafts is True
    plain = SimpleNamespace(drafter=None, speculative_config=SimpleNamespace())
    prepare(plain, None, [16, 16])
    assert not hasattr(plain, HANDLE)  # a plain DFlash runner gets no DDTree state


def test_layer_buffers_exist_while_vllm_profiles_memory(monkeypatch):
    """vLLM sizes the KV cache from the memory its profiling run used: the GDN tree buffers
    are made before that run (they were made only before capture, after the KV cache took its
    share), so they are counted as the engine's own memory."""
    from types import SimpleNamespace

    from vllm_ddtree.compat import v1_runner
    from vllm_ddtree.spec_decode import v1_hooks
    from vllm_ddtree.spec_decode.step_state import StepState

    gen = torch.Generator().manual_seed(4)
    layer, _, step = layer_table_step(2, 4, gen)
    model = torch.nn.Sequential(GDNLikeModule(layer))
    drafter = SimpleNamespace(state=StepState(hybrid=step))
    monkeypatch.setattr(v1_hooks, "ddtree_proposer", lambda runner: drafter)
    seen = []
    profile_run = v1_runner._wrap_profile_run(lambda runner: seen.append(len(step.layers)))
    profile_run(SimpleNamespace(get_model=lambda: model))
    assert seen == [1]


def recording_builder_class():
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from vllm_ddtree.compat import gdn_dispatch

    calls = []

    class Recording(GDNAttentionMetadataBuilder):
        pass

    def vllms_build(self, *args, **kwargs):
        calls.append(args)
        return GDNAttentionMetadataBuilder.build(self, *args, **kwargs)

    Recording.build = gdn_dispatch.build_wrapper(vllms_build)  # as the seam installs it
    return Recording, calls


@pytest.mark.parametrize("method, vllm_builds", [("ddtree", False), ("dflash", True)])
def test_the_wrapper_builds_tree_steps_only_in_ddtree_engines(method, vllm_builds):
    """A DDTree engine's tree step never reaches vLLM's build (its host masks wait on the
    device); a DFlash chain's engine keeps vLLM's build; both give vLLM's metadata."""
    Recording, calls = recording_builder_class()
    builder = make_builder(method)
    builder.__class__ = Recording
    common, accepted, drafts_cpu = step_inputs(*TREE_STEPS[3])
    built = builder.build(
        common_prefix_len=0,
        common_attn_metadata=common,
        num_accepted_tokens=accepted,
        num_decode_draft_tokens_cpu=drafts_cpu,
    )
    assert bool(calls) == vllm_builds
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    vllms = GDNAttentionMetadataBuilder.build(make_builder(method), 0, common, accepted, drafts_cpu)
    assert_same_metadata(built, vllms)
    calls.clear()  # a prefill beside a tree: vLLM's build in both engines
    common, accepted, drafts_cpu = step_inputs(*OTHER_STEPS[0])
    builder.build(0, common, accepted, drafts_cpu)
    assert len(calls) == 1


def test_vllms_gdn_layer_verifies_trees_through_the_routed_calls():
    """vLLM's own ``_forward_core`` (on a stand-in layer) in a forward verifying trees, with the
    plugin's routing installed: exactly what the step's own calls give
    (``tests/helpers/gdn_forward_core.py``; ``tests/test_upstream.py`` runs the same check on
    vLLM patched with the series, where the layer calls the step itself)."""
    from tests.helpers.gdn_forward_core import check_forward_core_verifies_trees
    from vllm_ddtree.compat import gdn_dispatch
    from vllm_ddtree.hybrid.gdn_layer import HybridTreeStep
    from vllm_ddtree.spec_decode.step_state import StepState

    gdn_dispatch.install(torch.device("cpu"))
    check_forward_core_verifies_trees(HybridTreeStep, StepState)
