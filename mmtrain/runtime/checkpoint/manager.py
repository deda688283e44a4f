"""Training checkpoints: the full training state as a set of stateful parts, written atomically, resumable
exactly or re-sharded onto another layout.
Design notes: docs/training.md, "The checkpoint manager"."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch
from megatron.core import dist_checkpointing

from mmtrain.runtime import rng
from mmtrain.runtime.checkpoint.integrity import CheckpointDamagedError, check_checkpoint, write_file_list
from mmtrain.runtime.checkpoint.layout import (
    CHECKPOINT_FORMAT,
    TRAINER_STATE,
    checkpoints_root,
    iter_dir,
    iteration_of,
    latest_checkpoint,
    prune,
    resolve_checkpoint,
    write_latest,
)
from mmtrain.runtime.checkpoint.weights import (
    CheckpointMismatchError,
    check_architecture,
    load_model_weights,
    model_sharded_state_dict,
    save_model_weights,
)
from mmtrain.runtime.child_processes import install_writer_results_queue
from mmtrain.runtime.distributed import ParallelContext, barrier, seed_model_parallel
from mmtrain.runtime.optimizer import torch_adam_load

#: called as (rank, step, phase) at each phase of a save: after the part named `phase` is staged
#: on this rank (e.g. "model": a partial staging folder), and on rank 0 at "publish" (staged
#: completely, not yet renamed into place). The crash-consistency tests kill a save here.
SAVE_PHASE_OBSERVERS: list[Callable[[int, int, str], None]] = []

if TYPE_CHECKING:
    from mmtrain.runtime.train_data import TrainData

log = logging.getLogger(__name__)

#: where a save is written before it is renamed into place (under `<run_dir>/checkpoints`)
STAGING = ".staging"


@dataclass
class TrainerState:
    #: layout.CHECKPOINT_FORMAT (integrity.check_checkpoint refuses another)
    format: int = CHECKPOINT_FORMAT
    step: int = 0
    consumed_samples: int = 0  # original samples (packed rows count each sample they hold)
    consumed_rows: int = 0  # micro-batch rows = global_batch_size per step
    layout: dict[str, int] = field(default_factory=dict)  # tp, pp, cp, dp, world_size
    data_sharding: str = "dp"
    lr_schedule: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # the optimizer's checkpoint layout (runtime.optimizer.optimizer_kind)
    optimizer: dict[str, Any] = field(default_factory=dict)
    # the decoder's layer spec (parallel.transformer_impl): its parameter names differ between
    # "local" and "transformer_engine", so a checkpoint loads only into the spec that wrote it
    transformer_impl: str = "local"
    # what the loader state was made for (data_identity.data_identity)
    data: dict[str, Any] = field(default_factory=dict)
    # written by a run with checkpoint.reset_data on: a rerun of it continues its data position
    data_reset: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainerState":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def layout_of(ctx: ParallelContext) -> dict[str, int]:
    return {"tp": ctx.tp, "pp": ctx.pp, "cp": ctx.cp, "dp": ctx.dp, "world_size": ctx.world_size}


# ----------------------------------------------------------------------------- stateful parts


class Stateful(Protocol):
    """One part of the training state, saved into and restored from an iteration directory."""

    #: its subdirectory of the iteration directory
    name: str

    def save(self, ckpt: Path, ctx: ParallelContext) -> None: ...

    def load(self, ckpt: Path, ctx: ParallelContext, saved: TrainerState) -> bool:
        """Restore from `ckpt`; False when it could not be (the reason is logged)."""
        ...


class ModelState:
    name = "model"

    def __init__(self, model_chunks: list[torch.nn.Module], model_config: Any) -> None:
        self.model_chunks, self.model_config = model_chunks, model_config

    def save(self, ckpt: Path, ctx: ParallelContext) -> None:
        save_model_weights(self.model_chunks, ckpt.parent, iteration_of(ckpt), self.model_config, update_latest=False)

    def load(self, ckpt: Path, ctx: ParallelContext, saved: TrainerState) -> bool:
        load_model_weights(self.model_chunks, ckpt.parent, iteration_of(ckpt))  # re-shards TP/PP
        return True


class OptimizerState:
    """megatron's optimizer state through dist-checkpointing. Its layout depends on the optimizer
    kind (FP32/Float16Optimizer: per-parameter moments sharded like the weights; the distributed
    optimizer: its own sharding type), recorded in trainer_state.json: a checkpoint of another kind
    (a CPU-made run resumed with the distributed optimizer on GPU, or the reverse) starts the
    optimizer fresh, with a warning, instead of failing as a damaged checkpoint."""

    name = "optimizer"

    def __init__(
        self,
        optimizer: Any,
        model_chunks: list[torch.nn.Module],
        kind: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.optimizer, self.model_chunks = optimizer, model_chunks
        self.kind = kind or {}
        self.metadata = metadata  # megatron's sharded_state_dict(metadata=...): the DistOpt format

    def _sharded(self, is_loading: bool) -> dict[str, Any]:
        model_sd = model_sharded_state_dict(self.model_chunks)
        if self.metadata is None:
            return self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        return self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=self.metadata)

    def save(self, ckpt: Path, ctx: ParallelContext) -> None:
        sharded = self._sharded(is_loading=False)
        install_writer_results_queue()
        dist_checkpointing.save(sharded, str(ckpt / self.name))

    def load(self, ckpt: Path, ctx: ParallelContext, saved: TrainerState) -> bool:
        if not (ckpt / self.name / "metadata.json").exists():
            log.warning("%s has no optimizer state; starting the optimizer fresh", ckpt)
            return False
        if saved.optimizer and self.kind and saved.optimizer != self.kind:
            if ctx.rank == 0:
                log.warning(
                    "%s holds the state of another optimizer (%s; this run uses %s): starting the optimizer "
                    "fresh (moments and step from zero; model, schedule and data resume)", ckpt,
                    _describe(saved.optimizer), _describe(self.kind),
                )  # fmt: skip
            return False
        with torch_adam_load(self.optimizer):  # megatron's DistOpt without TE/apex (CPU, some GPU nodes)
            loaded = dist_checkpointing.load(self._sharded(is_loading=True), str(ckpt / self.name))
            self.optimizer.load_state_dict(loaded)
        return True


def check_layer_spec(ckpt: Path, transformer_impl: str) -> None:
    """Refuse a checkpoint written with the other decoder layer spec: TE's spec keeps the pre-norm
    weights inside the fused linears (`linear_qkv.layer_norm_weight`), the local one in
    `input_layernorm.weight`, so dist-checkpointing would find neither. The HF format is the bridge."""
    state_file = ckpt / TRAINER_STATE
    if not state_file.exists():
        return
    saved = TrainerState.from_dict(json.loads(state_file.read_text())).transformer_impl
    if saved != transformer_impl:
        raise CheckpointMismatchError(
            f"{ckpt}: written with parallel.transformer_impl={saved}, this run uses {transformer_impl}; their "
            f"parameter names differ. Set parallel.transformer_impl={saved}, or export it "
            "(`mmtrain convert mcore-to-hf`) and start from the HF directory"
        )


def _describe(kind: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(kind.items()))


def reload_model_params(optimizer: Any) -> None:
    """megatron's mixed-precision and distributed optimizers keep fp32 copies of the weights made at
    construction (before any weights were loaded): refresh them from the model whenever the
    optimizer state was not restored, else the first step writes the stale copies back."""
    if optimizer is not None and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()


class RngState:
    """Per-rank streams: restored on the same layout; on another one re-seeded from the seed and
    the step (deterministic, but not the uninterrupted run's streams)."""

    name = "rng"

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def save(self, ckpt: Path, ctx: ParallelContext) -> None:
        torch.save(rng.get_rng_state(), ckpt / self.name / f"rank_{ctx.rank:05d}.pt")

    def load(self, ckpt: Path, ctx: ParallelContext, saved: TrainerState) -> bool:
        rng_file = ckpt / self.name / f"rank_{ctx.rank:05d}.pt"
        if saved.layout == layout_of(ctx) and rng_file.is_file():
            rng.set_rng_state(torch.load(rng_file, weights_only=True))
            return True
        if ctx.rank == 0:
            log.warning(
                "layout changed (%s -> %s): RNG streams re-seeded from seed and step", saved.layout, layout_of(ctx)
            )
        seed_model_parallel(self.seed + 7919 * saved.step, ctx.pp_rank)
        return False


class LoaderState:
    """The loader's position: one file per DP rank (written by its TP0/PP0/CP0 rank), or one for
    all with `data.sharding: replicated` or `global` (rank 0 writes it, every rank reads it). The
    CP ranks of a DP rank share its loader, so the state does not depend on CP: a checkpoint
    resumes at another cp with the same DP size; a global-order one at any layout."""

    name = "loader"

    def __init__(self, train_data: TrainData, restore: bool = True) -> None:
        self.train_data = train_data
        self.restore = restore  # False: checkpoint.reset_data (the loader starts fresh; saved as usual)

    def save(self, ckpt: Path, ctx: ParallelContext) -> None:
        d = self.train_data
        writes = (
            ctx.rank == 0
            if d.sharding in ("replicated", "global")
            else (ctx.tp_rank == 0 and ctx.pp_rank == 0 and ctx.cp_rank == 0)
        )
        if writes:
            (ckpt / self.name / d.state_key).write_text(d.save_state())

    def load(self, ckpt: Path, ctx: ParallelContext, saved: TrainerState) -> bool:
        d = self.train_data
        if not self.restore:
            return False  # the trainer says why (checkpoint.reset_data)
        state_file = ckpt / self.name / d.state_key
        if state_file.is_file() and saved.data_sharding == d.sharding:
            text = state_file.read_text()
            d.restore_state(text)
            if d.sharding == "global" and ctx.rank == 0:
                log.info("%s", global_order_resume_line(text, saved, d.layout_figures()))
            return True
        if ctx.rank == 0:
            log.warning(
                "loader state for %s not in %s (data.sharding %s -> %s, layout %s -> %s): energon "
                "cannot move it across DP sizes; the loader restarts from its seed (data order is "
                "not a continuation of the checkpointed run)",
                d.state_key, ckpt, saved.data_sharding, d.sharding, saved.layout, layout_of(ctx),
            )  # fmt: skip
        return False


def global_order_resume_line(text: str, saved: TrainerState, now: dict[str, int]) -> str:
    """The one line a global-order resume logs: the step the data order continues at and the
    layout it continues on (`now`: dp, micro_batch_size, num_workers), which may be another."""
    step = json.loads(text).get("step", saved.step)
    was = {
        "dp": saved.layout.get("dp"),
        "micro_batch_size": saved.data.get("train.micro_batch_size"),
        "num_workers": saved.data.get("data.num_workers"),
    }
    names = {"dp": "DP", "micro_batch_size": "micro-batch", "num_workers": "data.num_workers"}
    parts = [f"{names[k]} {was[k]} -> {now[k]}" if was[k] != now[k] else f"{names[k]} {now[k]}" for k in names]
    changed = any(was[k] != now[k] for k in names)
    return (
        f"data order continues at step {step} (global order), "
        f"{'layout changed' if changed else 'same layout'}: {', '.join(parts)}"
    )


# ----------------------------------------------------------------------------- the manager


@dataclass(frozen=True)
class StartingPoint:
    """What a run starts from: 'mmtrain' (a training checkpoint: everything resumes), 'weights'
    (model weights only: fresh optimizer, schedule, step and data) or 'hf' (an HF directory)."""

    kind: str
    path: Path


@dataclass
class RestoreResult:
    state: TrainerState  # as saved
    same_layout: bool
    restored: dict[str, bool]  # part name -> restored


class CheckpointManager:
    """Owns `<run_dir>/checkpoints`: what a run starts from, saving and restoring the tracked
    stateful parts, `latest`, pruning."""

    def __init__(self, run_dir: str | os.PathLike, ctx: ParallelContext, *, keep_last: int, resolved_yaml: str) -> None:
        self.root = checkpoints_root(run_dir)
        self.ctx = ctx
        self.keep_last = keep_last
        self.resolved_yaml = resolved_yaml
        self.parts: list[Stateful] = []
        if ctx.rank == 0:  # (before any save: each starts with a barrier the other ranks wait at)
            clear_stale_staging(self.root)

    def track(self, *parts: Stateful) -> None:
        self.parts = list(parts)

    def is_own(self, point: StartingPoint) -> bool:
        """Whether `point` is one of this run's own checkpoints."""
        return point.path.parent == self.root

    # ------------------------------------------------------------------ starting point
    def starting_point(
        self,
        load: str | None,
        weights_only: bool,
        model_config: Any,
        architecture_keys: Sequence[str],
        family: str | None = None,
        transformer_impl: str = "local",
    ) -> StartingPoint | None:
        """The run's own latest checkpoint, else `checkpoint.load` resolved; an mmtrain
        checkpoint that is damaged, another family's (integrity.py), made for another
        architecture or with another decoder layer spec is refused (CheckpointMismatchError)."""
        own = latest_checkpoint(self.root.parent)
        if own is not None:
            point = StartingPoint("mmtrain", own)
        elif load:
            kind, path = resolve_checkpoint(load)
            point = StartingPoint("weights" if kind == "mmtrain" and weights_only else kind, path)
        else:
            return None
        if point.kind in ("mmtrain", "weights"):
            if family is not None:
                check_checkpoint(point.path, family)
            check_architecture(point.path.parent, model_config, architecture_keys, iteration_of(point.path))
            check_layer_spec(point.path, transformer_impl)
        return point

    # ------------------------------------------------------------------ restore
    def restore(self, point: StartingPoint, load_hf: Callable[[Path], None]) -> RestoreResult | None:
        """Load `point` into the tracked parts. 'hf' and 'weights' fill the model only (None);
        'mmtrain' restores every part it can and says which (RestoreResult)."""
        model = next(p for p in self.parts if isinstance(p, ModelState))
        if point.kind in ("hf", "weights"):
            if point.kind == "hf":
                load_hf(point.path)
            else:
                model.load(point.path, self.ctx, TrainerState())
            reload_model_params(self._optimizer())
            return None
        saved = TrainerState.from_dict(json.loads((point.path / TRAINER_STATE).read_text()))
        restored = {}
        for part in self.parts:
            try:
                restored[part.name] = part.load(point.path, self.ctx, saved)
            except Exception as e:  # noqa: BLE001 - any loader failure means a damaged checkpoint
                raise CheckpointDamagedError(
                    f"{point.path}: its {part.name} state cannot be loaded ({type(e).__name__}: {e}); the "
                    "checkpoint is damaged: resume from an earlier one with checkpoint.load"
                ) from e
        if not restored.get(OptimizerState.name, True):
            reload_model_params(self._optimizer())
        return RestoreResult(saved, saved.layout == layout_of(self.ctx), restored)

    def _optimizer(self) -> Any:
        return next((p.optimizer for p in self.parts if isinstance(p, OptimizerState)), None)

    # ------------------------------------------------------------------ save
    def save(self, state: TrainerState) -> Path:
        """Collective: every rank saves its share of every part, then rank 0 publishes."""
        ctx = self.ctx
        staging_root = self.root / STAGING
        final, tmp = iter_dir(self.root, state.step), iter_dir(staging_root, state.step)
        if ctx.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            for part in self.parts:
                (tmp / part.name).mkdir(parents=True, exist_ok=True)
        barrier()
        for part in self.parts:
            part.save(tmp, ctx)
            _save_phase(ctx.rank, state.step, part.name)
        barrier()
        if ctx.rank == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2))
            (tmp / "config.yaml").write_text(self.resolved_yaml)
            write_file_list(tmp)
            _save_phase(ctx.rank, state.step, "publish")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            with contextlib.suppress(
                OSError
            ):  # (not empty: a killed earlier save's leftovers; the next save clears them)
                staging_root.rmdir()
            write_latest(self.root, state.step)
            prune(self.root, self.keep_last)
            log.info("saved checkpoint %s", final)
        barrier()
        return final


def clear_stale_staging(root: Path) -> None:
    """Remove what an interrupted save left in `root/.staging` (a Ctrl-C or kill mid-save):
    nothing reads it, and a run that starts holds the run dir, so no save of another job is under way."""
    staging = root / STAGING
    if not staging.is_dir():
        return
    left = sorted(p.name for p in staging.iterdir())
    shutil.rmtree(staging, ignore_errors=True)
    log.info("removed %s: an interrupted checkpoint save's unfinished %s", staging, ", ".join(left) or "folder")


def _save_phase(rank: int, step: int, phase: str) -> None:
    for observer in SAVE_PHASE_OBSERVERS:
        observer(rank, step, phase)
