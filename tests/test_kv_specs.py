"""The plugin wraps both runners' ``get_kv_cache_spec`` (``compat/kv_specs.py``) with
``hybrid/kv_cache_specs.ddtree_kv_cache_spec`` (in vLLM's tree the runners call it)."""

from __future__ import annotations

from tests.test_kv_cache_specs import _hybrid_specs


def test_both_runners_get_the_wrapper():
    from vllm_ddtree import compat
    from vllm_ddtree.compat import installer, seams

    installer.apply()
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu import model_runner

    seams.install(seams.V2_RUNNER)
    for runner in (gpu_model_runner.GPUModelRunner, model_runner.GPUModelRunner):
        assert compat.is_applied(runner.get_kv_cache_spec)


def test_engines_without_ddtree_keep_vllms_specs():
    from types import SimpleNamespace

    from vllm_ddtree.compat.kv_specs import wrap_get_kv_cache_spec

    specs = _hybrid_specs()
    get_kv_cache_spec = wrap_get_kv_cache_spec(lambda self: specs)
    runner = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None))
    assert get_kv_cache_spec(runner) is specs
