"""The run's compute device, read off the process group: a leaf, so the model building blocks
(layer specs, family model stages) and the runtime ask the same question without models
importing the runtime."""

from __future__ import annotations

import torch
import torch.distributed as dist


def compute_device() -> torch.device:
    """Where this process's model tensors live: the run's device, read off the process group
    (nccl: the current CUDA device, set by `set_cuda_device`; gloo or none: the CPU), never
    `torch.cuda.is_available()`."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
