"""vllm-ddtree: DDTree (Diffusion Draft Tree) speculative decoding for vLLM, as a plugin.

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in every process it
starts (API server, engine core, workers). It must stay cheap, idempotent and import-safe.
"""

from __future__ import annotations

import logging
import threading

__version__ = "0.1.0"

logger = logging.getLogger("vllm.ddtree")
_lock = threading.Lock()
_registered = False


def register() -> None:
    """Teach the running vLLM the ``"ddtree"`` speculative method (idempotent, every process)."""
    global _registered
    with _lock:
        if _registered:
            return
        from vllm_ddtree.compat import installer

        installer.apply()
        _registered = True


__all__ = ["__version__", "register"]
