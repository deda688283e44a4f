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


#: per-rank peak memory files under run_dir (auto-tune trials read them; one small JSON per rank)
RANK_MEMORY_DIR = "memory"


class PeakMemory:
    """This rank's peak memory over the run, against what the process held before the model
    was built, written to `<run_dir>/memory/rank<N>.json` after every step.

    CUDA: `max_memory_allocated` (read every step before `memory_stats` resets it) against the
    allocation at set-up (about 0). CPU: the process's peak RSS (`ru_maxrss`) against its RSS at
    set-up (interpreter, torch, megatron, process groups). `grown_gib` = peak - base is what the
    cost model's per-rank estimate describes (weights, gradients, optimizer states, activations)."""

    def __init__(self, device: torch.device, run_dir: "os.PathLike", rank: int) -> None:
        self.device = device
        self.path = os.path.join(run_dir, RANK_MEMORY_DIR, f"rank{rank:05d}.json")
        self.rank = rank
        self.base = self._current()
        self.peak = self.base

    def _current(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / float(1 << 30)
        import psutil

        return psutil.Process().memory_info().rss / float(1 << 30)

    def _peak_now(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / float(1 << 30)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / float(1 << 30)  # KiB on Linux

    def record(self, step: int) -> None:
        import json

        self.peak = max(self.peak, self._peak_now())
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": self.rank, "step": step, "device": self.device.type, "base_gib": self.base,
                       "peak_gib": self.peak, "grown_gib": self.peak - self.base}, f)
        os.replace(tmp, self.path)
