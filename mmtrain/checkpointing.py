"""Checkpoints: full training state, written atomically, resumable exactly or re-sharded.

Layout of `<run_dir>/checkpoints/iter_0000010/`:
  model/                 megatron dist-checkpoint of the weights (mmtrain.weights_io)
  optimizer/             dist-checkpoint of the optimizer moments, sharded like the weights
                         (so TP/PP changes re-shard them exactly like the model)
  rng/rank_00003.pt      per-rank RNG streams (python, numpy, torch, CUDA, megatron tracker)
  loader/<key>.json      energon `save_state_rank()` per DP rank (or one, when replicated),
                         as JSON (mmdata.energon_loaders.state_codec) - no pickles
  trainer_state.json     step, consumed samples, layout, LR schedule
  config.yaml            the resolved recipe
`<run_dir>/checkpoints/latest` holds the newest complete iteration number (the same layout
mmtrain.weights_io and `mmtrain convert` use, so a converted-weights dir is a valid `load`).

Atomicity: everything is written into `.staging/iter_0000010/`; only when every rank is done
does rank 0 rename it into place and then rewrite `latest` (write + os.replace). A crash
mid-save leaves at most a staging directory that the next save overwrites; `latest` never
points at a partial checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmtrain.distributed import ParallelContext, barrier
from mmtrain.weights_io import LATEST, iter_dir_name

log = logging.getLogger("mmtrain.checkpointing")

ITER_RE = re.compile(r"^iter_(\d{7})$")
TRAINER_STATE = "trainer_state.json"


@dataclass
class TrainerState:
    step: int = 0
    consumed_samples: int = 0  # original samples (packed rows count each sample they hold)
    consumed_rows: int = 0  # micro-batch rows = global_batch_size per step
    layout: dict[str, int] = field(default_factory=dict)  # tp, pp, dp, world_size
    data_sharding: str = "dp"
    lr_schedule: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainerState":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


# ----------------------------------------------------------------------------- locating


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
    )


def _read_latest(root: Path) -> Path | None:
    latest = root / LATEST
    if not latest.is_file():
        return None
    text = latest.read_text().strip()
    name = iter_dir_name(int(text)) if text.isdigit() else text
    return root / name


def resolve_checkpoint(path: str | os.PathLike) -> tuple[str, Path]:
    """What a user-given `checkpoint.load` points at:
    ('mmtrain', iter dir)  a full training checkpoint (resume: model, optimizer, step, loader...)
    ('weights', iter dir)  weights only, e.g. from `mmtrain convert hf-to-mcore` (start from them)
    ('hf', dir)            an HF model dir (converted on the fly)
    Accepts an iter dir, a checkpoints dir (follows `latest`), a run dir, or an HF dir."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint.load: {p} does not exist")
    candidates = [p]
    for root in (p, p / "checkpoints"):
        target = _read_latest(root)
        if target is not None:
            candidates.append(target)
    for c in candidates:
        if (c / TRAINER_STATE).is_file():
            return "mmtrain", c
    for c in candidates:
        if ITER_RE.match(c.name) and (c / "model").is_dir():
            return "weights", c
    if is_hf_dir(p):
        return "hf", p
    raise FileNotFoundError(
        f"checkpoint.load: {p} is neither an mmtrain checkpoint (iter_NNNNNNN dir, or a dir with "
        "a `latest` file) nor an HF model dir (config.json + *.safetensors)"
    )


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    target = _read_latest(checkpoints_root(run_dir))
    return target if target is not None and (target / TRAINER_STATE).is_file() else None


def iteration_of(ckpt: Path) -> int:
    m = ITER_RE.match(ckpt.name)
    if not m:
        raise ValueError(f"{ckpt}: not an iter_NNNNNNN checkpoint dir")
    return int(m.group(1))


# ----------------------------------------------------------------------------- saving


def save_checkpoint(
    run_dir: str | os.PathLike,
    state: TrainerState,
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    train_data: Any,
    ctx: ParallelContext,
    resolved_config_yaml: str,
    keep_last: int,
    model_config: Any = None,
) -> Path:
    from megatron.core import dist_checkpointing

    from mmtrain import rng, weights_io

    root = checkpoints_root(run_dir)
    staging_root = root / ".staging"
    final = root / iter_dir_name(state.step)
    tmp = staging_root / iter_dir_name(state.step)
    if ctx.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        for sub in ("optimizer", "rng", "loader"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
    barrier()

    weights_io.save_model_weights(
        model_chunks, staging_root, state.step, model_config, update_latest=False
    )
    model_sd = _model_sharded_state_dict(model_chunks)
    optim_sd = optimizer.sharded_state_dict(model_sd)
    dist_checkpointing.save(optim_sd, str(tmp / "optimizer"))

    torch.save(rng.get_rng_state(), tmp / "rng" / f"rank_{ctx.rank:05d}.pt")
    # one writer per loader state: the TP0/PP0 rank of each DP rank (replicated: rank 0 only)
    writes_loader = ctx.tp_rank == 0 and ctx.pp_rank == 0
    if train_data.sharding == "replicated":
        writes_loader = ctx.rank == 0
    if writes_loader:
        (tmp / "loader" / train_data.state_key).write_text(train_data.save_state())
    barrier()

    if ctx.rank == 0:
        (tmp / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2))
        (tmp / "config.yaml").write_text(resolved_config_yaml)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        weights_io.write_latest(root, state.step)
        _prune(root, keep_last)
        log.info("saved checkpoint %s", final)
    barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    steps = sorted(int(m.group(1)) for d in root.iterdir() if (m := ITER_RE.match(d.name)))
    for step in steps[:-keep_last]:
        shutil.rmtree(root / iter_dir_name(step), ignore_errors=True)


def _model_sharded_state_dict(model_chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """The weights' sharded state dict (keep_vars: the optimizer maps its params through it)."""
    merged: dict[str, Any] = {}
    for i, chunk in enumerate(model_chunks):
        module = unwrap(chunk)
        sd = module.sharded_state_dict()
        merged.update(sd if len(model_chunks) == 1 else {f"chunk{i}.{k}": v for k, v in sd.items()})
    return merged


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and not hasattr(chunk, "sharded_state_dict_unwrapped"):
        inner = getattr(chunk, "module")
        if not isinstance(inner, torch.nn.Module):
            break
        chunk = inner
    return chunk


# ----------------------------------------------------------------------------- loading


@dataclass
class LoadResult:
    state: TrainerState
    same_layout: bool
    loader_restored: bool
    rng_restored: bool


def load_checkpoint(
    ckpt: Path,
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    train_data: Any,
    ctx: ParallelContext,
) -> LoadResult:
    """Restore everything a checkpoint holds into freshly built objects.

    Model and optimizer always load (dist-checkpointing re-shards across TP/PP/DP). RNG streams
    restore only on the same layout (they are per rank); the loader state only where energon
    accepts it (same DP size, or `data.sharding: replicated`). Whatever cannot be restored is
    said in the log, and the run continues deterministically from the seed and the step.
    """
    from megatron.core import dist_checkpointing

    from mmtrain import rng, weights_io

    state = TrainerState.from_dict(json.loads((ckpt / TRAINER_STATE).read_text()))
    layout = {"tp": ctx.tp, "pp": ctx.pp, "dp": ctx.dp, "world_size": ctx.world_size}
    same_layout = state.layout == layout

    load_weights_only(ckpt, model_chunks)
    if (ckpt / "optimizer" / "metadata.json").exists():
        model_sd = _model_sharded_state_dict(model_chunks)
        optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=True)
        loaded = dist_checkpointing.load(optim_sd, str(ckpt / "optimizer"))
        if hasattr(optimizer, "load_sharded"):
            optimizer.load_sharded(loaded)
        else:  # megatron optimizer (GPU path)
            optimizer.load_state_dict(loaded)
    else:
        log.warning("%s has no optimizer state; starting the optimizer fresh", ckpt)

    rng_restored = False
    rng_file = ckpt / "rng" / f"rank_{ctx.rank:05d}.pt"
    if same_layout and rng_file.is_file():
        rng.set_rng_state(torch.load(rng_file, weights_only=True))
        rng_restored = True
    elif ctx.rank == 0:
        log.warning(
            "layout changed (%s -> %s): RNG streams re-seeded from seed and step", state.layout, layout
        )

    loader_restored = False
    loader_file = ckpt / "loader" / train_data.state_key
    if loader_file.is_file() and state.data_sharding == train_data.sharding:
        train_data.restore_state(loader_file.read_text())
        loader_restored = True
    elif ctx.rank == 0:
        log.warning(
            "loader state for %s not in %s (data.sharding %s -> %s, layout %s -> %s): energon "
            "cannot move it across DP sizes; the loader restarts from its seed (data order is "
            "not a continuation of the checkpointed run)",
            train_data.state_key, ckpt, state.data_sharding, train_data.sharding,
            state.layout, layout,
        )  # fmt: skip
    return LoadResult(state, same_layout, loader_restored, rng_restored)


def load_weights_only(ckpt: Path, model_chunks: list[torch.nn.Module]) -> None:
    """Model weights of an iter dir into (any TP/PP layout of) the model chunks."""
    from mmtrain import weights_io

    weights_io.load_model_weights(model_chunks, ckpt.parent, iteration_of(ckpt))


def reseed_for_step(seed: int, step: int, ctx: ParallelContext) -> None:
    """Deterministic RNG streams for a run continued on another layout."""
    from mmtrain.distributed import seed_model_parallel

    seed_model_parallel(seed + 7919 * step, ctx.pp_rank)
