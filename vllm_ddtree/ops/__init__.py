"""DDTree's device ops: each a Triton kernel with its launcher and a PyTorch reference.

On CUDA the runner hooks and the proposer use the Triton launchers; on other devices, or with
``VLLM_DDTREE_TORCH_OPS=1`` (to rule a kernel out when debugging), the PyTorch references.
"""

import torch

from vllm_ddtree import envs


def use_triton(device: torch.device) -> bool:
    """True where the Triton launchers run: CUDA devices, unless ``VLLM_DDTREE_TORCH_OPS=1``."""
    return device.type == "cuda" and not envs.torch_ops()


def triton_dtype(dtype: torch.dtype):
    """Triton's type for a float ``dtype`` a pointer-table kernel casts its addresses to
    (``kv_commit``, ``gdn_commit``)."""
    import triton.language as tl

    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[
        dtype
    ]
