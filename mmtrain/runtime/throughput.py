"""Step timing, MFU/HFU and memory numbers for the step logs.

MFU = achieved model FLOP/s / (peak FLOP/s of the devices in use). The model side is counted per
step from the step's own micro-batches (`batch_flops`: `models.flops.step_flops` on their
packed layout, tiles and the freeze set), so packing (sum of len^2), frozen parts and the vision
tower are all in it, and only the real samples' segments count: a row's padding run is not model
work. HFU (hardware FLOPs utilisation) counts what the devices execute instead: every segment,
padding runs and CP padding included, plus recompute's extra forward (`batch_flops(...,
executed=True)` + `models.flops.recompute_flops`). The peak comes from the exact device name
(`models.hardware.PEAK_TFLOPS`: dense bf16 tensor-core numbers; fp32 runs use the TF32 figure);
a device not listed, like a CPU, has no meaningful single peak, so MFU and HFU are reported as
null there rather than as a made-up number. The packing report (`batch_packing`: bin fill and
executed-token efficiency, CP padding included) is counted the same way.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any, Callable, Iterable, Optional

import psutil
import torch

from mmdata.energon_loaders.batch import PackedBatch
from mmdata.packing.report import PackingReport, empty_report, report_from_cu_seqlens
from mmtrain.models.flops import StepFlops, step_flops
from mmtrain.models.hardware import peak_tflops
from mmtrain.models.shapes import ModelShapes


def device_peak_flops(device: torch.device, precision: str) -> Optional[float]:
    """Peak FLOP/s of one device, or None when unknown (CPU, GPUs not listed by their exact name);
    `MMTRAIN_PEAK_TFLOPS` sets it for any device."""
    override = os.environ.get("MMTRAIN_PEAK_TFLOPS")
    if override:
        return float(override) * 1e12
    if device.type != "cuda":
        return None
    peak = peak_tflops(torch.cuda.get_device_name(device), precision)
    return peak * 1e12 if peak is not None else None


def batch_flops(
    shapes: ModelShapes,
    micro_batches: Iterable[PackedBatch],
    trainable_parts: Iterable[str],
    encoder_inputs: Optional[Callable[[Any], int]] = None,
    pad_to: int = 1,
    executed: bool = False,
) -> StepFlops:
    """FLOPs of this rank's micro-batches of a step (one model replica's whole sequences,
    whatever its TP/PP/CP split): each batch's host `cu_seqlens` (no device read), the tiles
    `encoder_inputs` counts (the family's `FamilySpec.encoder_inputs`; None: no encoder).
    Model FLOPs (the MFU's): the real samples' segments of each row (`sample_ids`; a batch
    without one list per row counts every segment). `executed`: every segment, padding runs included, each
    padded to `pad_to` = the CP padding multiple (`models.context_parallel.padding_multiple`)."""
    batches = list(micro_batches)
    tiles = sum(encoder_inputs(b) for b in batches) if encoder_inputs is not None else 0
    cu = [b.host_cu_seqlens() for b in batches]
    if executed:
        return step_flops(shapes, cu, tiles, trainable_parts, pad_to=pad_to)
    samples = [
        [len(ids) for ids in b.sample_ids] if len(b.sample_ids) == b.input_ids.shape[0] else None for b in batches
    ]
    return step_flops(shapes, cu, tiles, trainable_parts, samples=samples)


def batch_packing(micro_batches: Iterable[PackedBatch], cp: int, tp: int) -> PackingReport:
    """Bin fill and executed-token efficiency of this rank's micro-batches of a step: their rows,
    real positions and host `cu_seqlens` (no device read), every segment padded to the CP
    multiple as `models.context_parallel.cp_layout` pads it (mmdata/packing/report.py)."""
    report = empty_report(cp, tp)
    for b in micro_batches:
        rows, seq_length = (int(n) for n in b.input_ids.shape)
        report = report + report_from_cu_seqlens(b.host_cu_seqlens(), b.num_real_tokens, rows, seq_length, cp, tp)
    return report


def model_tflops_per_s(flops: float, seconds: float, world_size: int) -> Optional[float]:
    """Model TFLOP/s per device: `flops` of a step (all ranks) done in `seconds` by `world_size` devices."""
    if seconds <= 0 or flops <= 0:
        return None
    return flops / seconds / world_size / 1e12


def mfu(flops: float, seconds: float, world_size: int, peak_flops: Optional[float]) -> Optional[float]:
    """FLOPs utilisation: `flops` of a step (all ranks; `batch_flops` summed over DP) done in
    `seconds` by `world_size` devices of `peak_flops` each; None without a known peak. Model
    FLOPs give the MFU, executed FLOPs (padding and recompute in) the HFU."""
    if not peak_flops or flops <= 0 or seconds <= 0:
        return None
    return flops / seconds / (peak_flops * world_size)


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
        return psutil.Process().memory_info().rss / float(1 << 30)

    def _peak_now(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / float(1 << 30)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / float(1 << 30)  # KiB on Linux

    def record(self, step: int) -> None:
        self.peak = max(self.peak, self._peak_now())
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "rank": self.rank,
                    "step": step,
                    "device": self.device.type,
                    "base_gib": self.base,
                    "peak_gib": self.peak,
                    "grown_gib": self.peak - self.base,
                },
                f,
            )
        os.replace(tmp, self.path)
