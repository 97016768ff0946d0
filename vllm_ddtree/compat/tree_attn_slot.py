"""TREE_ATTN in vLLM's ``CUSTOM`` attention backend slot, taken only by engines that use it.

vLLM 0.26.0 has one slot for an out-of-tree attention backend, ``AttentionBackendEnum.CUSTOM``
(filled by ``registry.register_backend``). When the plugin loads it only adds ``TREE_ATTN`` as
another name of that member, so ``--attention-backend TREE_ATTN`` parses and the member pickles
as the static ``CUSTOM``. The slot itself is filled in a process only for an engine that uses
TREE_ATTN: a DDTree engine, or one that names ``TREE_ATTN`` as its attention backend. The
process that makes the engine's config marks it (``mark_uses_tree_attention``); every process of
that engine takes the slot when vLLM resolves the ``CUSTOM`` backend under that config
(``wrap_cached_get_attn_backend``). Any other engine asking for ``CUSTOM`` gets what vLLM
gives it (another plugin's backend, or vLLM's refusal), and a slot another plugin holds is never
overwritten: ``take_slot`` raises ``CustomSlotTaken`` naming both.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.compat.wrapping import alias_enum_member
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.spec_request import TREE_ATTN_NAME

TREE_ATTN_PATH = "tree_attn_backend.backend.TreeAttentionBackend"
# A key of an engine's ``VllmConfig.additional_config`` (vLLM's place for plugins' settings:
# it pickles with the config into the engine's processes and survives vLLM's config copies):
# the engine's target attends with TREE_ATTN.
USES_TREE_ATTN_KEY = "ddtree_tree_attention"


class CustomSlotTaken(RuntimeError):
    """vLLM's ``CUSTOM`` attention backend slot holds another plugin's backend."""

    def __init__(self, holder: str):
        self.holder = holder
        super().__init__(
            f"TREE_ATTN ({TREE_ATTN_PATH}) is served from vLLM's single CUSTOM attention "
            f"backend slot, which already holds {holder} (registered by another plugin). Run "
            "this engine without that plugin (VLLM_PLUGINS names the plugins to load); "
            "engines that use neither DDTree nor TREE_ATTN are not affected."
        )


def add_tree_attn_name() -> None:
    """``AttentionBackendEnum["TREE_ATTN"]`` names the ``CUSTOM`` member (nothing registered)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    alias_enum_member(AttentionBackendEnum, TREE_ATTN_NAME, AttentionBackendEnum.CUSTOM)


def slot_holder() -> str | None:
    """The class path vLLM's ``CUSTOM`` slot holds in this process, or None."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    return _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)


def take_slot() -> None:
    """Fill vLLM's ``CUSTOM`` slot with TREE_ATTN in this process (idempotent); raises
    ``CustomSlotTaken`` if another backend holds it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    holder = slot_holder()
    if holder == TREE_ATTN_PATH:
        return
    if holder is not None:
        raise CustomSlotTaken(holder)
    register_backend(AttentionBackendEnum.CUSTOM, TREE_ATTN_PATH)


def is_tree_attention(backend: Any) -> bool:
    """True if ``backend`` (an ``AttentionBackendEnum`` or None) selects TREE_ATTN here."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return backend is AttentionBackendEnum.CUSTOM and slot_holder() == TREE_ATTN_PATH


def names_tree_attention(value: Any) -> bool:
    """True if an ``attention_backend`` setting is the name ``TREE_ATTN`` (any case)."""
    return isinstance(value, str) and value.strip().upper() == TREE_ATTN_NAME


def mark_uses_tree_attention(vllm_config: Any) -> None:
    """Mark an engine's config: its target attends with TREE_ATTN."""
    if isinstance(vllm_config.additional_config, dict):
        vllm_config.additional_config[USES_TREE_ATTN_KEY] = True


def uses_tree_attention(vllm_config: Any) -> bool:
    """True for the config of an engine that uses TREE_ATTN (marked, or a DDTree engine)."""
    additional = getattr(vllm_config, "additional_config", None)
    marked = isinstance(additional, dict) and bool(additional.get(USES_TREE_ATTN_KEY))
    return marked or get_ddtree_config(getattr(vllm_config, "speculative_config", None)) is not None


def wrap_cached_get_attn_backend(original):
    """``selector._cached_get_attn_backend``: before vLLM resolves ``CUSTOM`` for an engine
    that uses TREE_ATTN, this process's slot gets TREE_ATTN (``take_slot``)."""

    def _cached_get_attn_backend(backend, *args, **kwargs):
        from vllm.config import get_current_vllm_config
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        if backend is AttentionBackendEnum.CUSTOM and uses_tree_attention(
            get_current_vllm_config()
        ):
            take_slot()
        return original(backend, *args, **kwargs)

    _cached_get_attn_backend.cache_clear = original.cache_clear  # vLLM's tests clear it
    return _cached_get_attn_backend
