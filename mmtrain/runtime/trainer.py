"""The shared train loop: one `Trainer` for every model family.

    starting point (checkpoint.load / own latest; architecture checked) -> build model stage
    (FamilySpec.build_model) -> freeze the family's parts -> megatron DDP -> optimizer -> LR
    schedule -> loader -> restore the checkpoint's stateful parts -> for each step:
         draw this rank's micro-batches
         megatron get_forward_backward_func(...)   (grad accumulation, PP schedule, DP reduce)
         LR for the step, clip + optimizer step
         every train.eval_interval steps: forward-only evaluation on data.val_paths
         log (loss over real tokens of the global batch, grad norm, lr, tokens/s, MFU, memory,
              sample ids + per-sample losses, val_loss) and checkpoint

The loss is megatron's per-token convention (`calculate_per_token_loss`): each micro-batch
returns (sum of token losses, number of label tokens); megatron sums the counts over
micro-batches and DP x CP ranks and divides the gradients by the total, so any TP/PP/CP/DP
layout and any micro-batch split of the same global batch gives the same update. (Under context
parallelism each CP rank's sums cover the positions it holds: runtime/loss.py.)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from mmdata.energon_loaders.batch import PackedBatch
from mmdata.energon_loaders.plan_packing import PLAN_SKIP_HINTS
from mmdata.units import format_duration, plural
from mmtrain.config.schema import Recipe
from mmtrain.models.megatron_config import ParallelOptions
from mmtrain.models.pipeline_split import (
    PipelineSplitError,
    interleaved_schedule_problem,
    split_layers,
)
from mmtrain.runtime.checkpoint.data_identity import data_identity, explain, recipe_changes, resume_decision
from mmtrain.runtime.checkpoint.manager import (
    CheckpointManager,
    LoaderState,
    ModelState,
    OptimizerState,
    RngState,
    StartingPoint,
    TrainerState,
    layout_of,
)
from mmtrain.runtime.distributed import ParallelContext, UnsupportedLayout
from mmtrain.runtime.evaluation import EvalResult, eval_due, isolated_from_training, val_data
from mmtrain.runtime.loss import lm_loss_sums, loss_mask, per_sample_loss_sums
from mmtrain.runtime.lr_schedule import LRSchedule
from mmtrain.runtime.optimizer import (
    ModelParts,
    apply_freeze,
    build_optimizer,
    optimizer_kind,
    optimizer_sharded_metadata,
)
from mmtrain.runtime.stopping import StopRequests
from mmtrain.runtime.throughput import (
    PeakMemory,
    device_peak_flops,
    memory_stats,
)
from mmtrain.runtime.metrics import MetricsWriter
from mmtrain.runtime.model_setup import (
    build_model_chunks,
    dispatch_param_gather,
    finish_param_gather,
    model_options,
    split_text,
    wrap_in_ddp,
)
from mmtrain.runtime.step_metrics import StepMetrics, StepResult, skip_summary, step_line, step_record
from mmtrain.runtime.train_data import TrainData
from mmtrain.spec import FamilySpec

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, recipe: Recipe, spec: FamilySpec, ctx: ParallelContext, resolved_yaml: str) -> None:
        self.recipe = recipe
        self.spec = spec
        self.ctx = ctx
        self.state = TrainerState(
            layout=layout_of(ctx),
            data_sharding=recipe.data.sharding,
            seed=recipe.seed,
            data=data_identity(recipe),
            data_reset=recipe.checkpoint.reset_data,
        )
        self._resolved_yaml = resolved_yaml
        t = recipe.train
        # the launcher's world may differ from the recipe's (DP adapts): check the actual one
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * ctx.dp)
        if self.num_microbatches * t.micro_batch_size * ctx.dp != t.global_batch_size:
            raise ValueError(
                f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                f"micro_batch_size*dp = {t.micro_batch_size}*{ctx.dp}"
            )
        try:  # the decoder's layers per stage and virtual stage (parallel.pp_layers / vpp)
            self.pipeline_split = split_layers(
                spec.model_shapes(recipe.model).decoder.layers, ctx.pp, ctx.vpp, recipe.parallel.pp_layers
            )
        except PipelineSplitError as err:
            raise UnsupportedLayout(str(err)) from None
        problem = interleaved_schedule_problem(self.num_microbatches, ctx.pp, ctx.vpp)  # for the launcher's dp
        if problem:
            raise UnsupportedLayout(problem)
        self.checkpoints = CheckpointManager(
            recipe.run_dir, ctx, keep_last=recipe.checkpoint.keep_last, resolved_yaml=resolved_yaml
        )
        self.metrics = None
        self._last_saved_step = -1
        self._saving: int | None = None  # the step whose checkpoint is being saved
        self.stopped_by: Optional[str] = None  # why fit() stopped before train.iters (None: it did not)
        self._stops = StopRequests(t.exit_interval, t.exit_duration_mins)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        recipe, ctx, spec = self.recipe, self.ctx, self.spec
        self.peak_memory = PeakMemory(ctx.device, Path(recipe.run_dir), ctx.rank)  # before the model exists
        # refuse a checkpoint of another architecture before building anything
        start = self.checkpoints.starting_point(
            recipe.checkpoint.load,
            recipe.checkpoint.weights_only,
            recipe.model,
            spec.architecture_keys,
            spec.name,
            recipe.parallel.transformer_impl,
        )
        # refuse a loader state made for other data before building anything (data_identity.py)
        data_decision = resume_decision(start.path, recipe) if start is not None and start.kind == "mmtrain" else None
        chunks = build_model_chunks(spec, recipe, ctx, self._model_options())
        self.parts = ModelParts(chunks, spec.parts)
        self.trainable = apply_freeze(chunks, self.parts, recipe.freeze)
        self.model, configs = wrap_in_ddp(chunks, ctx)
        self.optimizer = build_optimizer(self.model, self.parts, recipe.optimizer, ctx)
        for config in configs:
            config.grad_scale_func = self.optimizer.scale_loss  # megatron's loss scale (1.0 unless fp16)
        self.state.optimizer = optimizer_kind(ctx)
        self.state.transformer_impl = recipe.parallel.transformer_impl
        self.schedule = LRSchedule.from_recipe(recipe.optimizer, recipe.train.iters)
        self.state.lr_schedule = self.schedule.state_dict()
        self.data = TrainData(spec, recipe, ctx)
        if self.data.balancer is not None and ctx.rank == 0:
            log.info(
                "data.balance: rows placed by cost (tokens + %.0f per tile) over the DP ranks and micro-batches, "
                "%s at a time (data.balance_window: %s)",
                self.data.balancer.tile_tokens,
                plural(self.data.window, "step"),
                recipe.data.balance_window,
            )
        self.checkpoints.track(
            ModelState(self.model, recipe.model),
            OptimizerState(self.optimizer, self.model, optimizer_kind(ctx), optimizer_sharded_metadata(ctx)),
            RngState(recipe.seed),
            LoaderState(self.data, restore=data_decision != "reset"),
        )
        if start is not None:
            self._announce_resume(start, data_decision)
            self._restore(start)
        self.peak_flops = device_peak_flops(ctx.device, ctx.precision)
        self.step_metrics = StepMetrics.for_run(spec, recipe, ctx, self.pipeline_split.counts)
        if ctx.is_logging_rank:
            self.metrics = _open_metrics(recipe, self.state.step)
            log.info(
                "model stage %d/%d built%s: trainable params %s; %d micro-batches/step/rank",
                ctx.pp_rank, ctx.pp, split_text(self.pipeline_split) if ctx.pp > 1 else "", self.trainable,
                self.num_microbatches,
            )  # fmt: skip

    def _model_options(self) -> ParallelOptions:
        return model_options(self.recipe, self.spec, self.ctx, self.pipeline_split)

    def _restore(self, start: StartingPoint) -> None:
        result = self.checkpoints.restore(start, self._load_hf)
        if result is None:
            if self.ctx.rank == 0:
                how = (
                    "HF checkpoint %s (converted on the fly)" if start.kind == "hf" else "%s (fresh optimizer and data)"
                )
                log.info("initialised weights from " + how, start.path)
            return
        self.state.step = result.state.step
        self.state.consumed_samples = result.state.consumed_samples
        self.state.consumed_rows = result.state.consumed_rows
        self._last_saved_step = self.state.step if self.checkpoints.is_own(start) else -1
        if self.ctx.rank == 0:
            log.info(
                "resumed from %s at step %d (same layout: %s, loader restored: %s)",
                start.path, self.state.step, result.same_layout, result.restored[LoaderState.name],
            )  # fmt: skip

    def _announce_resume(self, start: StartingPoint, data_decision: Optional[str]) -> None:
        """Rank 0 says what the resume does with the data and each recipe change that takes
        effect now (train.iters, the LR schedule...), one line each."""
        if self.ctx.rank != 0 or data_decision is None:
            return
        line = explain(data_decision, start.path, self.recipe)
        if line is not None:
            log.info(line)
        for change in recipe_changes(start.path, self._resolved_yaml):
            log.info("resume: %s", change)

    def _load_hf(self, path: Path) -> None:
        """An HF directory as the starting point, converted on the fly by the family (straight
        into this rank's TP/PP shards)."""
        if self.spec.hf is None:
            raise ValueError(
                f"checkpoint.load={path} is an HF directory, but family {self.spec.name} has no HF conversion"
            )
        self.spec.hf.load_into_model(self.model, str(path), self.recipe.model)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> StepResult:
        t = self.recipe.train
        step = self.state.step + 1
        start = time.perf_counter()
        step_data = self.data.next_step()
        data_wait = time.perf_counter() - start

        dispatch_param_gather(self.model)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._run_schedule(step_data.micro_batches, forward_only=False)
        lr = self.schedule.apply(self.optimizer.param_groups, step, self.recipe.optimizer.weight_decay)
        updated, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")

        totals = self.step_metrics.gather(step_data, reports)  # collectives: the global batch's numbers
        elapsed = time.perf_counter() - start
        self.state.step = step
        self.state.consumed_rows += t.global_batch_size
        self.state.consumed_samples += totals.samples
        return StepResult(
            step=step,
            grad_norm=grad_norm,
            lr=lr,
            updated=bool(updated),
            step_time_s=elapsed,
            data_wait_s=data_wait,
            **vars(totals),
        )

    def _forward_step(self, data_iterator: "RecordingIterator", model: Any) -> tuple[Any, Any]:
        """The family's forward step, with per-sample losses added to its loss report.

        Family contract: on the last stage the model's output is the per-token loss `[B, S]`
        (masked by the loss function); from it and the batch's `cu_seqlens`/`sample_ids` we add
        one `[sum, count]` row per packed sample, for `mmtrain worst-samples`."""
        output, loss_fn = self.spec.forward_step(data_iterator, model)
        batch = data_iterator.last
        if loss_fn is None or batch is None:
            return output, loss_fn

        def loss_with_samples(output_tensor: torch.Tensor) -> Any:
            result = loss_fn(output_tensor)
            labels = batch.labels
            if len(result) == 3 and batch.sample_ids and tuple(output_tensor.shape) == tuple(labels.shape):
                mask = loss_mask(batch).to(device=output_tensor.device, dtype=output_tensor.dtype)
                report = dict(result[2])
                report["sample_losses"] = per_sample_loss_sums(output_tensor.detach(), mask, batch)
                return result[0], result[1], report
            return result

        return output, loss_with_samples

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> EvalResult:
        """`train.eval_iters` global batches of `data.val_paths`, forward only, with no effect
        on training (mmtrain/runtime/evaluation.py says how). Collective: every rank must call it."""
        ctx = self.ctx
        start = time.perf_counter()
        sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        with isolated_from_training(self.model), val_data(self.spec, self.recipe, ctx) as data:
            for _ in range(self.recipe.train.eval_iters):
                reports = self._run_schedule(data.next_step().micro_batches, forward_only=True)
                if ctx.is_last_stage:
                    sums += lm_loss_sums(reports, ctx.device)
        if not ctx.is_last_stage:
            return EvalResult(loss=None, tokens=None, time_s=time.perf_counter() - start)
        if ctx.dp * ctx.cp > 1:
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        sums = sums.cpu()
        return EvalResult(
            loss=float(sums[0] / sums[1].clamp(min=1)),
            tokens=int(sums[1]),
            time_s=time.perf_counter() - start,
        )

    def _run_schedule(self, micro_batches: list[PackedBatch], forward_only: bool) -> list[dict[str, Any]]:
        """One global batch (this rank's micro-batches) through megatron's schedule; the loss
        reports of the last stage (empty elsewhere)."""
        t = self.recipe.train
        # every model chunk reads the micro-batch it runs (its own iterator with virtual stages)
        iterators = [RecordingIterator(micro_batches) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model,
            num_microbatches=self.num_microbatches,
            # models run packed micro-batches as one flattened [B*S] stream (THD)
            seq_length=t.seq_length * t.micro_batch_size,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[StepResult]:
        recipe, ctx = self.recipe, self.ctx
        results = []
        interval = recipe.checkpoint.interval
        self._fit_start = (time.perf_counter(), self.state.step)  # for the ETA
        with self._stops.catching_sigterm():
            while self.state.step < recipe.train.iters:
                result = self.train_step()
                if eval_due(result.step, recipe.train.eval_interval):
                    result.evaluation = self.evaluate()
                results.append(result)
                self.peak_memory.record(result.step)  # before _log's memory_stats resets CUDA peaks
                self._log(result)
                if interval > 0 and result.step % interval == 0 and recipe.checkpoint.save:
                    self.save()
                # every rank stops after the same step: the verdict is agreed on (a collective)
                self.stopped_by = self._stops.due(result.step, ctx.device)
                if self.stopped_by is not None and result.step < recipe.train.iters:
                    break
                self.stopped_by = None
            if self._last_saved_step != self.state.step and recipe.checkpoint.save:
                self.save()
        self._say_skips(results)
        if self.stopped_by is not None and ctx.rank == 0:
            saved = (
                f"checkpoint saved in {self.checkpoints.root}. Run the same command again to resume"
                if recipe.checkpoint.save
                else "no checkpoint (checkpoint.save: false)"
            )
            log.info("stopped after step %d/%d (%s); %s", self.state.step, recipe.train.iters, self.stopped_by, saved)
        if self.metrics is not None:
            self.metrics.close()
        return results

    def _say_skips(self, results: list[StepResult]) -> None:
        """One closing line when this run's loaders skipped samples: how many of those drawn, why,
        and what to do (every step's own count is in its line and in metrics.jsonl)."""
        if not self.ctx.is_logging_rank:
            return
        skipped: dict[str, int] = {}
        for r in results:
            for reason, n in r.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        line = skip_summary(skipped, sum(r.samples for r in results), PLAN_SKIP_HINTS)
        if line is not None:
            log.warning("%s", line)

    def where(self) -> str:
        """Where the run is, for the interrupt line (mmtrain/runtime/interrupts.py)."""
        iters = self.recipe.train.iters
        if self._saving is not None:
            return (
                f"while saving the checkpoint of step {self._saving}/{iters} (its unfinished copy in "
                f"checkpoints/.staging is removed at the next start)"
            )
        return f"in step {self.state.step + 1}/{iters}"

    def save(self) -> None:
        self._saving = self.state.step
        finish_param_gather(self.model)
        self.checkpoints.save(self.state)
        self._saving = None
        self._last_saved_step = self.state.step

    def _log(self, r: StepResult) -> None:
        if not self.ctx.is_logging_rank:
            return
        record = step_record(r, self.ctx.world_size, self.peak_flops, memory_stats(self.ctx.device))
        if self.metrics is not None:
            self.metrics.write(record)
        if r.step % self.recipe.logging.interval == 0 or r.step == self.recipe.train.iters or r.evaluation is not None:
            log.info("%s", step_line(r, record, self.recipe.train.iters, self._eta(r.step)))

    def _eta(self, step: int) -> str:
        """Time left at the mean step time of this run so far (evaluations and saves included)."""
        t0, step0 = getattr(self, "_fit_start", (None, 0))
        if t0 is None or step <= step0:
            return "?"
        return format_duration((self.recipe.train.iters - step) * (time.perf_counter() - t0) / (step - step0))


class RecordingIterator:
    """Iterator over a step's micro-batches that remembers the last one drawn (the forward
    step consumes it; the loss report needs its sample ids)."""

    def __init__(self, items: list[Any]) -> None:
        self._it = iter(items)
        self.last: Any = None

    def __iter__(self) -> "RecordingIterator":
        return self

    def __next__(self) -> Any:
        self.last = next(self._it)
        return self.last


def _open_metrics(recipe: Recipe, resume_step: int) -> Any:
    """The JSONL (+TensorBoard) writer; on resume, records past the checkpoint are dropped so
    the file shows one curve."""
    return MetricsWriter(recipe.run_dir, tensorboard=recipe.logging.tensorboard, resume_step=resume_step)
