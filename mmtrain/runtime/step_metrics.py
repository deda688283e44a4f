"""A training step's numbers for the logs, gathered over the ranks (the step-metric side of the
loop, as torchtitan's `MetricsProcessor`): token, sample and FLOP counts summed over DP, the loss
over real tokens of the global batch (on the last pipeline stage), per-sample losses gathered for
`mmtrain worst-samples`, packing and vision-balance figures. `Trainer.train_step` runs the step
and hands the micro-batches and the schedule's loss reports here.

Two FLOP counts per step (models/flops.py): the model FLOPs of the real samples (the MFU's
numerator: a row's padding run and CP padding are not model work) and the FLOPs the devices
execute (the HFU's: every segment, padding included, plus recompute's extra forward). Both come
from host metadata, summed over DP with the other counts: no extra collective, no device read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mmdata.packing.balance import vision_balance
from mmdata.energon_loaders.batch import PackedBatch
from mmtrain.models.context_parallel import padding_multiple
from mmtrain.models.flops import recompute_flops, recomputed_layer_count
from mmtrain.models.shapes import ModelShapes
from mmtrain.runtime.distributed import ParallelContext
from mmtrain.runtime.evaluation import EvalResult
from mmtrain.runtime.loss import lm_loss_sums
from mmtrain.runtime.throughput import batch_flops, batch_packing, mfu, model_tflops_per_s
from mmtrain.runtime.train_data import StepData
from mmtrain.spec import FamilySpec


@dataclass
class StepResult:
    step: int
    loss: Optional[float]  # None on ranks without the loss (not the last PP stage)
    grad_norm: float
    lr: float
    updated: bool
    step_time_s: float
    data_wait_s: float  # part of step_time_s spent waiting for this rank's micro-batches
    tokens: int  # positions processed by the whole global batch
    samples: int
    loss_tokens: int
    sample_ids: list[str]
    sample_losses: list[Optional[float]]
    evaluation: Optional[EvalResult] = None  # set at train.eval_interval steps
    #: model FLOPs of the global batch: every DP replica's real samples (`models.flops.step_flops`)
    flops: float = 0.0
    #: FLOPs the devices executed for it: padding runs and CP padding in, plus recompute's forward
    hardware_flops: float = 0.0
    #: packing of the global batch: real tokens / row capacity, and real / tokens computed (CP padding in)
    bin_fill: Optional[float] = None
    executed_token_efficiency: Optional[float] = None
    #: max / mean over the DP ranks of the tiles their vision towers encoded this step (None: no tiles)
    vision_balance: Optional[float] = None
    #: samples the loaders skipped making the global batch, per reason (summed over DP)
    skipped: dict[str, int] = field(default_factory=dict)
    #: `data.sharding: global`: bytes each DP rank read for the step, in DP-rank order (empty otherwise)
    bytes_per_rank: list[int] = field(default_factory=list)
    #: `data.sharding: global`: the step's units (the blend's samples or tokens) per source
    source_units: dict[str, float] = field(default_factory=dict)


@dataclass
class StepTotals:
    """What `StepMetrics.gather` found for the global batch (every field of `StepResult` that is
    not the optimizer's or the clock's)."""

    tokens: int
    samples: int
    loss_tokens: int
    flops: float
    hardware_flops: float
    bin_fill: Optional[float]
    executed_token_efficiency: Optional[float]
    vision_balance: Optional[float]
    loss: Optional[float] = None
    sample_ids: list[str] = field(default_factory=list)
    sample_losses: list[Optional[float]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    bytes_per_rank: list[int] = field(default_factory=list)
    source_units: dict[str, float] = field(default_factory=dict)


class StepMetrics:
    """Counts a step's micro-batches on this rank and gathers the global batch's numbers.

    `freeze`: the recipe's frozen parts (the FLOPs' backward follows them); `recompute` and
    `recomputed_layers` (decoder layers full recompute checkpoints, over the whole model's chunks)
    give the HFU its extra forward."""

    def __init__(
        self,
        spec: FamilySpec,
        shapes: ModelShapes,
        freeze: Sequence[str],
        ctx: ParallelContext,
        recompute: str = "none",
        recomputed_layers: int = 0,
    ) -> None:
        self.spec, self.shapes, self.ctx = spec, shapes, ctx
        self.trainable = [part for part in spec.parts if part not in freeze]
        self.recompute, self.recomputed_layers = recompute, recomputed_layers

    @classmethod
    def for_run(
        cls, spec: FamilySpec, recipe: Any, ctx: ParallelContext, chunk_layers: Sequence[Sequence[int]]
    ) -> "StepMetrics":
        """For the run's recipe, layout and pipeline split (`PipelineSplit.counts`)."""
        p = recipe.parallel
        layers = recomputed_layer_count([n for stage in chunk_layers for n in stage], p.recompute_num_layers)
        return cls(
            spec,
            spec.model_shapes(recipe.model),
            recipe.freeze,
            ctx,
            ctx.recompute,
            layers if ctx.recompute == "full" else 0,
        )

    def model_flops(self, micro_batches: list[PackedBatch]) -> float:
        """Model FLOPs of this rank's micro-batches: one replica's whole sequences (the same on its
        TP/PP/CP ranks), from their host `cu_seqlens`, real samples and tiles and the freeze set."""
        return batch_flops(self.shapes, micro_batches, self.trainable, self.spec.encoder_inputs).total

    def hardware_flops(self, micro_batches: list[PackedBatch]) -> float:
        """What the devices execute for them: every segment padded to the CP multiple, plus
        recompute's extra forward (`models.flops.recompute_flops`)."""
        executed = batch_flops(
            self.shapes,
            micro_batches,
            self.trainable,
            self.spec.encoder_inputs,
            pad_to=padding_multiple(self.ctx.cp, self.ctx.tp),
            executed=True,
        )
        extra = recompute_flops(self.shapes, executed, self.trainable, self.recompute, self.recomputed_layers)
        return executed.total + extra

    def gather(self, step_data: StepData, reports: list[dict[str, Any]]) -> StepTotals:
        """The global batch's numbers: counts summed over DP, the loss and per-sample losses on the
        last stage (the collectives run on the backend's device: NCCL needs CUDA tensors)."""
        ctx, batches = self.ctx, step_data.micro_batches
        packing = batch_packing(batches, ctx.cp, ctx.tp)
        tiles = [0.0] * ctx.dp  # this rank's tiles in its own slot: the sum gathers every DP rank's
        tiles[ctx.dp_rank] = float(
            sum(self.spec.encoder_inputs(b) for b in batches) if self.spec.encoder_inputs is not None else 0
        )
        read = [0.0] * ctx.dp  # bytes read, the same way
        read[ctx.dp_rank] = float(step_data.bytes_read)
        counts = torch.tensor(
            [
                step_data.num_tokens,
                step_data.num_samples,
                step_data.num_loss_tokens,
                self.model_flops(batches),
                packing.capacity,
                packing.computed_tokens,
                self.hardware_flops(batches),
                float(sum(step_data.skipped.values())),
                *tiles,
                *read,
            ],
            dtype=torch.float64,
            device=ctx.device,
        )
        if ctx.dp > 1:  # CP ranks share a DP rank's batch
            dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        counts = counts.cpu()
        totals = StepTotals(
            tokens=int(counts[0]),
            samples=int(counts[1]),
            loss_tokens=int(counts[2]),
            flops=float(counts[3]),
            hardware_flops=float(counts[6]),
            bin_fill=float(counts[0] / counts[4]) if counts[4] > 0 else None,
            executed_token_efficiency=float(counts[0] / counts[5]) if counts[5] > 0 else None,
            vision_balance=vision_balance(counts[8 : 8 + ctx.dp].tolist()),
            skipped=self._gather_skips(step_data.skipped, int(counts[7])),
            source_units=dict(step_data.source_units),
        )
        if step_data.source_units:  # the global order's step (its units are every rank's)
            totals.bytes_per_rank = [int(b) for b in counts[8 + ctx.dp :].tolist()]
        if ctx.is_last_stage:
            self._gather_losses(step_data, reports, totals)
        return totals

    def _gather_skips(self, mine: dict[str, int], total: int) -> dict[str, int]:
        """The global batch's skips per reason: gathered only in a step whose DP sum (`total`, the
        same on every rank) says there are any."""
        if total == 0 or self.ctx.dp == 1:
            return dict(mine)
        gathered: list[Any] = [None] * self.ctx.dp
        dist.all_gather_object(gathered, mine, group=parallel_state.get_data_parallel_group())
        summed: dict[str, int] = {}
        for rank_skips in gathered:
            for reason, n in rank_skips.items():
                summed[reason] = summed.get(reason, 0) + n
        return dict(sorted(summed.items()))

    def _gather_losses(self, step_data: StepData, reports: list[dict[str, Any]], totals: StepTotals) -> None:
        """The loss over the global batch's label tokens and every sample's loss, in DP-rank order."""
        ctx = self.ctx
        loss_sum = lm_loss_sums(reports, ctx.device)
        per_sample = [report["sample_losses"].detach().double() for report in reports if "sample_losses" in report]
        if ctx.dp * ctx.cp > 1:  # each CP rank summed its own positions
            dist.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        loss_sum = loss_sum.cpu()
        totals.loss = float(loss_sum[0] / loss_sum[1].clamp(min=1))
        mine = torch.cat(per_sample) if per_sample else torch.zeros(0, 2, dtype=torch.float64)
        if ctx.cp > 1:
            mine = mine.to(ctx.device)
            dist.all_reduce(mine, group=parallel_state.get_context_parallel_group())
        mine = mine.cpu()
        local = (step_data.sample_ids, [float(s / c) if c > 0 else None for s, c in mine.tolist()])
        gathered = [local]
        if ctx.dp > 1:
            # (type checker: all_gather_object fills the placeholders)
            gathered = [None] * ctx.dp  # type: ignore[list-item]
            dist.all_gather_object(gathered, local, group=parallel_state.get_data_parallel_group())
        for ids, losses in gathered:
            totals.sample_ids.extend(ids)
            totals.sample_losses.extend(losses if len(losses) == len(ids) else [None] * len(ids))


def step_record(
    r: StepResult, world_size: int, peak_flops: Optional[float], memory: dict[str, float]
) -> dict[str, Any]:
    """The step's metrics.jsonl record: `mfu` from the model FLOPs, `hfu` from the executed ones
    (padding and recompute in), both None without a known peak; `memory` from `memory_stats`."""
    record = {
        "step": r.step,
        "loss": r.loss,
        "lr": r.lr,
        "grad_norm": r.grad_norm if math.isfinite(r.grad_norm) else None,
        "tokens_per_s": r.tokens / r.step_time_s if r.step_time_s > 0 else 0.0,
        "samples_per_s": r.samples / r.step_time_s if r.step_time_s > 0 else 0.0,
        "mfu": mfu(r.flops, r.step_time_s, world_size, peak_flops),
        "hfu": mfu(r.hardware_flops, r.step_time_s, world_size, peak_flops),
        "model_tflops_per_s": model_tflops_per_s(r.flops, r.step_time_s, world_size),
        "step_time_s": r.step_time_s,
        "data_wait_s": r.data_wait_s,
        "tokens": r.tokens,
        "num_samples": r.samples,
        "num_loss_tokens": r.loss_tokens,
        "skipped_update": not r.updated,
        "skipped": r.skipped,  # samples the loaders skipped making this step's batch, per reason
        "num_skipped": sum(r.skipped.values()),
        "bin_fill": r.bin_fill,
        "executed_token_efficiency": r.executed_token_efficiency,
        "vision_balance": r.vision_balance,
        **memory,
        "sample_ids": r.sample_ids,
        "sample_losses": r.sample_losses,
    }
    if r.source_units:  # data.sharding: global
        record.update(global_order_record(r.bytes_per_rank, r.source_units))
    ev = r.evaluation
    if ev is not None:
        record.update(val_loss=ev.loss, val_tokens=ev.tokens, val_time_s=ev.time_s)
    return record


def global_order_record(bytes_per_rank: list[int], units: dict[str, float]) -> dict[str, Any]:
    """A global-order step's read volume and mixture: `bytes_read` (DP rank 0's, the logging
    rank's), `bytes_read_per_rank` and `shares`, the planned share of each source in the step's
    units (samples or tokens, as the blend counts; skipped or carried samples not taken off)."""
    total = sum(units.values())
    return {
        "bytes_read": bytes_per_rank[0] if bytes_per_rank else 0,
        "bytes_read_per_rank": bytes_per_rank,
        "source_units": units,
        "shares": {name: (u / total if total > 0 else 0.0) for name, u in units.items()},
    }


def step_line(r: StepResult, record: dict[str, Any], iters: int, eta: str) -> str:
    """The step's log line (`step 3/10 | loss ... | mfu 41.2% (hfu 47.0%) | mem ... | eta ...`)."""
    mem = record.get("mem_max_allocated_gib", record.get("mem_rss_gib", 0.0))
    loss = r.loss if r.loss is not None else float("nan")
    mfu_text = f"{record['mfu']:.1%}" if record["mfu"] is not None else "n/a (cpu)"
    hfu_text = f" (hfu {record['hfu']:.1%})" if record["hfu"] is not None else ""
    return (
        f"step {r.step}/{iters} | loss {loss:.4f} | lr {r.lr:.3e} | grad_norm {r.grad_norm:.3f}"
        f" | {record['tokens_per_s']:.0f} tok/s | {record['samples_per_s']:.2f} samples/s"
        f" | fill {_percent(r.bin_fill)} | exec {_percent(r.executed_token_efficiency)}{_skip_part(r.skipped)}"
        f" | mfu {mfu_text}{hfu_text} | mem {mem:.2f} GiB | eta {eta}{_eval_log_part(r.evaluation)}"
    )


def _skip_part(skipped: dict[str, int]) -> str:
    """` | skipped 12 (plan_overflow 12)` for a step whose loaders skipped samples, else ``."""
    if not skipped:
        return ""
    return f" | skipped {sum(skipped.values())} ({', '.join(f'{k} {v}' for k, v in skipped.items())})"


def skip_summary(skipped: dict[str, int], trained: int, hints: dict[str, str]) -> str | None:
    """The run's closing line when its loaders skipped samples (`344 of 857 samples skipped:
    plan_overflow 344; preprocess with --tokenizer ...`): skipped of drawn (trained + skipped),
    per reason, and what to do about the reasons `hints` knows; None when nothing was skipped."""
    n = sum(skipped.values())
    if n == 0:
        return None
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))
    todo = [hints[k] for k in skipped if k in hints]
    return f"{n} of {trained + n} samples skipped: {reasons}" + (f"; {'; '.join(todo)}" if todo else "")


def _percent(x: Optional[float]) -> str:
    """`99.2%` for the step line, `-` when unknown."""
    return "-" if x is None else f"{x:.1%}"


def _eval_log_part(ev: Optional[EvalResult]) -> str:
    """` | val_loss X (N tokens, T s)` for the step line of an evaluation step, else ``."""
    if ev is None or ev.loss is None:
        return ""
    return f" | val_loss {ev.loss:.4f} ({ev.tokens} tokens, {ev.time_s:.1f} s)"
