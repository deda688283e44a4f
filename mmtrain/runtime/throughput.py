"""Step timing, MFU and memory numbers for the step logs.

MFU = achieved model FLOP/s / (peak FLOP/s of the devices in use). The model side comes from the
cost model's training FLOPs per token of the family's shapes; the peak from the cost model's
device table (dense bf16 tensor-core numbers; fp32 runs use the fp32 / tf32 figure). CPUs have
no meaningful single peak, so MFU is reported as null there rather than as a made-up number.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from mmtrain.planning.cost_model import PEAK_TFLOPS


def device_peak_flops(device: torch.device, precision: str) -> Optional[float]:
    """Peak FLOP/s of one device, or None when unknown (CPU, unlisted GPUs)."""
    override = os.environ.get("MMTRAIN_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name:
            return table.get(precision, table["bf16"]) * 1e12
    return None


def mfu(
    flops_per_token: float, tokens_per_s: float, world_size: int, peak_flops: Optional[float]
) -> Optional[float]:
    if not peak_flops or flops_per_token <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak_flops * world_size)


def memory_stats(device: torch.device) -> dict[str, float]:
    """CUDA: max allocated / reserved since the last reset (GiB); CPU: process RSS (GiB)."""
    gib = float(1 << 30)
    if device.type == "cuda":
        out = {
            "mem_max_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / gib,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return out
    import psutil

    return {"mem_rss_gib": psutil.Process().memory_info().rss / gib}
