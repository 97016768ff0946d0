"""The installer: what vllm-ddtree changes in vLLM at run time, and when.

Written against vLLM 0.26.0. Every vLLM symbol the plugin wraps, replaces or builds on is a row
of ``compat/seams.py`` (its target, the parameters it binds by name, its wrapper); ``apply``
installs the engine's rows in every process vLLM starts and arms the model runners' rows for
when vLLM imports a runner. This module holds the engine-level wrappers:

* ``EngineArgs.create_speculative_config`` (in the API / ``LLM`` process, before any engine
  process starts): a ``"method": "ddtree"`` request is validated and rewritten to vLLM's DFlash
  request, the runner chosen and the graphs sized (``spec_request``: what the in-tree form
  calls too), TREE_ATTN chosen for the target, and the ``DDTreeConfig`` attached to the resulting
  ``SpeculativeConfig`` as ``ddtree_config`` (a plain attribute: it pickles with the config
  into engine-core and worker processes). ``create_engine_config``: the checks that need the
  resolved config (GatedDeltaNet tree states must fit the memory vLLM may use).
* ``SpeculativeConfig.max_num_new_slots_for_drafting``: a DDTree drafter runs ``depth`` mask
  queries, not ``num_speculative_tokens`` (= the tree budget) of them.
* ``Scheduler.__init__``: the KV lookahead a request gets each step covers every slot the
  DDTree drafter writes (``DDTreeConfig.kv_lookahead``).
* ``VllmConfig.use_v2_model_runner``: the runner ``config.choose_runner`` chose.
* ``SamplingParams._validate_spec_decode``: with DDTree configured, a request asking for what
  the tree sampler cannot apply yet is refused with an error naming the fields.
* ``CpuPlatform.get_attn_backend_cls``: TREE_ATTN when selected (its PyTorch path).

Every wrapper leaves an engine that does not use DDTree as vLLM makes it. TREE_ATTN takes vLLM's
``CUSTOM`` attention backend slot only in the processes of an engine that uses it
(``compat/tree_attn_slot.py``).
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_ddtree import envs
from vllm_ddtree.compat import (
    DDTREE_ATTR,
    DDTREE_CHAIN_ATTR,
    WRITTEN_FOR_VLLM,
    get_ddtree_config,
    incompatible,
    is_applied,
    seams,
    serves_chain_for_ddtree,
    vllm_version,
)
from vllm_ddtree.compat.tree_attn_slot import (
    TREE_ATTN_NAME,
    TREE_ATTN_PATH,
    CustomSlotTaken,
    add_tree_attn_name,
    is_tree_attention,
    mark_uses_tree_attention,
    names_tree_attention,
    take_slot,
)
from vllm_ddtree.config import (
    DDTreeConfig,
    DDTreeConfigError,
)
from vllm_ddtree.handles import held, hold
from vllm_ddtree.requests.options import check_ddtree_request
from vllm_ddtree.requests.scheduler_hooks import install_stats_book
from vllm_ddtree.spec_request import (
    TreeGraphSizing,
    attention_backend,
    check_ddtree_drafter,
    finish_tree_engine_config,
    fold_spec_method,
    log_tree_engine,
    serve_ddtree_request,
)

logger = logging.getLogger("vllm.ddtree")


@dataclasses.dataclass
class ArgsState:
    """What the config rewrite keeps on vLLM's ``EngineArgs`` between its calls (its handle,
    ``handles.hold``)."""

    config: DDTreeConfig | None = None  # the parsed DDTree settings
    served_chain: bool = False  # "auto" chose vLLM's DFlash chain
    # How the graphs were sized; create_engine_config finishes them (spec_request).
    sizing: TreeGraphSizing | None = None


def _check_vllm_shape() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if "speculative_config" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        raise incompatible("EngineArgs has no speculative_config field")


def _take_custom_slot() -> None:
    """TREE_ATTN in vLLM's CUSTOM slot for this engine, or a config error naming the holder."""
    try:
        take_slot()
    except CustomSlotTaken as error:
        message = f"method 'ddtree' verifies draft trees with TREE_ATTN: {error}"
        raise DDTreeConfigError(message) from error


def _tree_attention_here(backend) -> bool:
    """Whether ``backend`` is TREE_ATTN in this process: the ``CUSTOM`` member it aliases,
    whose slot this engine takes (``tree_attn_slot``)."""
    if backend is attention_backend(TREE_ATTN_NAME):
        _take_custom_slot()
    return is_tree_attention(backend)


def _wrap_create_speculative_config(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        kept = held(self, ArgsState)  # an earlier call's, for DDTree engines only
        ddtree: DDTreeConfig | None = kept.config if kept is not None else None
        fold_spec_method(self)
        served = serve_ddtree_request(
            self, target_model_config, target_parallel_config, _tree_attention_here
        )
        request, sizing = served if served is not None else (None, None)
        if request is not None and request.ddtree is not None:
            ddtree = request.ddtree
            state = hold(self, ArgsState)
            state.config = ddtree
            state.sizing = sizing
        spec = original(self, target_model_config, target_parallel_config)
        if ddtree is None and spec is not None:
            # "auto" chose the chain (now or in an earlier call with these arguments, after
            # which they hold vLLM's DFlash request).
            if request is not None or (kept is not None and kept.served_chain):
                hold(self, ArgsState).served_chain = True
                setattr(spec, DDTREE_CHAIN_ATTR, True)
        if ddtree is not None and spec is not None:
            check_ddtree_drafter(spec)
            setattr(spec, DDTREE_ATTR, ddtree)
            log_tree_engine(ddtree)
        return spec

    return create_speculative_config


def _wrap_create_engine_config(original):
    """``EngineArgs.create_engine_config``: a DDTree engine's config finished
    (``spec_request.finish_tree_engine_config``); an engine that attends with TREE_ATTN (a
    DDTree engine, or one naming it) is marked so."""

    def create_engine_config(self, *args, **kwargs):
        named_tree_attention = names_tree_attention(getattr(self, "attention_backend", None))
        config = original(self, *args, **kwargs)
        held_args = held(self, ArgsState)
        finish_tree_engine_config(config, held_args.sizing if held_args is not None else None)
        if get_ddtree_config(config.speculative_config) is not None or named_tree_attention:
            # Its processes take vLLM's CUSTOM slot for TREE_ATTN (compat/tree_attn_slot.py).
            take_slot()
            mark_uses_tree_attention(config)
        return config

    return create_engine_config


def _wrap_drafting_slots(original):
    """A DDTree drafter runs ``depth`` mask queries, not ``num_speculative_tokens`` (the tree
    budget) of them."""

    def max_num_new_slots_for_drafting(self) -> int:
        ddtree = getattr(self, DDTREE_ATTR, None)
        if ddtree is None:
            return original(self)
        # One new slot per mask query but the first, as for DFlash, at the drafter's depth.
        return ddtree.depth - 1 + (1 if self.uses_draft_model() else 0)

    return max_num_new_slots_for_drafting


def _wrap_scheduler_init(original):
    """The scheduler reserves KV slots for everything the DDTree drafter writes
    (``DDTreeConfig.kv_lookahead``) and keeps each request's tree statistics
    (``requests.options.RequestStatsBook``)."""

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        ddtree = get_ddtree_config(vllm_config.speculative_config)
        if ddtree is not None:
            self.num_lookahead_tokens = max(self.num_lookahead_tokens, ddtree.kv_lookahead)
            install_stats_book(self)
        elif serves_chain_for_ddtree(vllm_config.speculative_config):
            install_stats_book(self, serves_chain=True)

    return __init__


def _wrap_use_v2_model_runner(original):
    """The runner ``choose_runner`` chose, carried by the config (V2 where vLLM can run it)."""

    def use_v2_model_runner(self) -> bool:
        ddtree = get_ddtree_config(self.speculative_config)
        if ddtree is not None:
            return ddtree.runner == "v2" and original(self)
        return original(self)

    return use_v2_model_runner


def _wrap_validate_spec_decode(original):
    """Requests asking for what the tree sampler cannot apply, or for DDTree options outside
    their allowed values (``requests.options``), are refused naming the fields."""

    def _validate_spec_decode(self, speculative_config, *args, **kwargs):
        original(self, speculative_config, *args, **kwargs)
        check_ddtree_request(self, speculative_config)

    return _validate_spec_decode


def _wrap_get_attn_backend_cls(original):
    """vLLM-CPU always answers CPU_ATTN; it answers TREE_ATTN when that is selected."""

    def get_attn_backend_cls(cls, selected_backend, *args, **kwargs):
        if is_tree_attention(selected_backend):
            return TREE_ATTN_PATH
        return original(cls, selected_backend, *args, **kwargs)

    return get_attn_backend_cls


def apply() -> None:
    """Install the plugin in this process (idempotent): TREE_ATTN's registration, the engine
    seams now, the model runners' seams when vLLM imports a runner (``compat.seams``)."""
    from vllm.engine.arg_utils import EngineArgs

    add_tree_attn_name()
    if is_applied(EngineArgs.create_speculative_config):
        return
    version = vllm_version()
    if not version.startswith(WRITTEN_FOR_VLLM):
        logger.warning(
            "vllm-ddtree was written for vLLM %s; running on %s", WRITTEN_FOR_VLLM, version
        )
    _check_vllm_shape()
    seams.install(seams.ENGINE)
    seams.install_when_imported(seams.V1_RUNNER, seams.V1_RUNNER_MODULE)
    seams.install_when_imported(seams.CPU_RUNNER, seams.CPU_RUNNER_MODULE)
    # The V2 hooks are inert unless the engine's speculator is DDTree's (the runner choice
    # travels with the engine's config, ``DDTreeConfig.runner``).
    seams.install_when_imported(seams.V2_RUNNER, seams.V2_RUNNER_MODULE)
    if envs.test_float32_gdn():  # a test switch, see testing/float32_gdn_prefill.py
        seams.install_when_imported(seams.FLOAT32_GDN, seams.GDN_MODULE)
