"""DDTree's device ops: each a Triton kernel with its launcher and a PyTorch reference.

On CUDA the runner hooks and the proposer use the Triton launchers; on other devices, or with
``VLLM_DDTREE_TORCH_OPS=1`` (to rule a kernel out when debugging), the PyTorch references.
"""

import os

import torch

TORCH_OPS_ENV = "VLLM_DDTREE_TORCH_OPS"


def use_triton(device: torch.device) -> bool:
    """True where the Triton launchers run: CUDA devices, unless ``VLLM_DDTREE_TORCH_OPS=1``."""
    return device.type == "cuda" and os.environ.get(TORCH_OPS_ENV, "0") in ("", "0")
