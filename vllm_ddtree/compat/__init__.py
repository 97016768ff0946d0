"""The one seam between vllm-ddtree and vLLM's internals.

* ``seams.py``: the table of every vLLM symbol the plugin wraps, replaces or builds on, the
  parameters it binds there, and its wrapper; ``seams.install(group)`` applies a group,
  ``seams.check()`` checks them all against the installed vLLM.
* ``wrapping.py``: how a seam is applied: one applied-marker (``APPLIED``; wrapping again is a
  no-op), one error type (``VLLMIncompatibleError``, naming the installed vLLM's version and the
  symbol), the original kept as ``__wrapped__``, arguments bound by name
  (``bind_arguments``). The ``DDTreeConfig`` an engine's config carries is read with
  ``config.get_ddtree_config`` (re-exported here).

No other module of the plugin assigns to a vLLM attribute. Nothing here imports vLLM at module
level.
"""

from vllm_ddtree.compat.wrapping import (
    APPLIED,
    WRITTEN_FOR_VLLM,
    VLLMIncompatibleError,
    alias_enum_member,
    bind_arguments,
    check_signature,
    incompatible,
    is_applied,
    replace_attribute,
    vllm_version,
    wrap_classmethod,
    wrap_function,
    wrap_property,
)
from vllm_ddtree.config import (
    DDTREE_ATTR,
    DDTREE_CHAIN_ATTR,
    get_ddtree_config,
    serves_chain_for_ddtree,
)

__all__ = [
    "APPLIED",
    "DDTREE_ATTR",
    "DDTREE_CHAIN_ATTR",
    "WRITTEN_FOR_VLLM",
    "VLLMIncompatibleError",
    "alias_enum_member",
    "bind_arguments",
    "check_signature",
    "get_ddtree_config",
    "incompatible",
    "is_applied",
    "replace_attribute",
    "serves_chain_for_ddtree",
    "vllm_version",
    "wrap_classmethod",
    "wrap_function",
    "wrap_property",
]
