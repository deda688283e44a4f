"""Loader factory shared by every family: shard dirs or a metadataset YAML + a family's task
encoder -> an energon savable loader of that family's batches (`PackedBatch` subclasses).

Energon does the streaming, sharding over data-parallel ranks and workers, shuffling,
blending (MetadatasetV2 weights), packing buffers and resumable state; the family supplies the
task encoder, and `SavableLoader` sums the per-batch skip counters into `stats`.

Resume: call `save_state_rank()` when checkpointing (one state per DP rank) and
`restore_state_rank(state)` on an identically built loader BEFORE the first iteration.
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

from mmdata.energon_configs import dataset_config, has_mmdata_config
from mmdata.energon_loaders.global_order import build_global_loader
from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER
from mmdata.energon_loaders.plan_packing import PlanPackedDataset, load_plan, plan_for_data
from mmdata.energon_loaders.savable_loader import LoaderStats as LoaderStats  # re-exported
from mmdata.energon_loaders.savable_loader import SavableLoader
from mmdata.packing.emu3_geometry import Emu3PlanGeometry
from mmdata.packing.geometry import PlanGeometry
from mmdata.readiness import data_source_samples

#: `sharding`: energon's own per-rank streams (`dp`; the trainer builds `replicated` as one rank
#: of one), or the one global order of every rank (mmdata/global_order/, global_order.py)
SHARDINGS = ("dp", "replicated", "global")


def write_blend_yaml(path: str | Path, datasets: Sequence[tuple[str | Path, float]]) -> Path:
    """Write an energon MetadatasetV2 YAML blending shard dirs with the given weights. A dir with
    our `mmdata.yaml` is read through it (`dataset_config`), so the family's task encoder gets
    our sample type, not the portable InterleavedSample of `dataset.yaml`."""
    path = Path(path)
    blend = [
        {
            "weight": float(w),
            "path": str(Path(p).resolve()),
            **({"dataset_config": dataset_config(p)} if has_mmdata_config(p) else {}),
        }
        for p, w in datasets
    ]
    doc = {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {"train": {"blend": blend}}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _resolve_data(data: str | Path | Sequence[str | Path]) -> Path:
    """One shard dir or metadataset YAML as is; several dirs -> an equal-weight blend YAML."""
    if isinstance(data, (str, Path)):
        paths = [Path(data)]
    else:
        paths = [Path(p) for p in data]
    if not paths:
        raise ValueError("no data paths given")
    for p in paths:  # finished datasets only (an interrupted preprocess job's folder is refused)
        data_source_samples(p)
    if len(paths) == 1:
        return paths[0]
    # Same dirs -> same file, so a resumed run rebuilds an identical metadataset.
    digest = hashlib.sha256("\n".join(str(p.resolve()) for p in paths).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"mmdata-blend-{digest}" / "blend.yaml"
    return write_blend_yaml(out, [(p, 1.0) for p in paths])


def build_loader(
    data: str | Path | Sequence[str | Path],
    task_encoder: Any,
    *,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_workers: int = 2,
    seed: int = 0,
    packing: bool | str = True,
    packing_plan: str | Path | None = None,
    packing_buffer_size: int | None = None,
    shuffle_buffer_size: int = 100,
    max_samples_per_sequence: int = 100,
    checkpoint_every_sec: float = 60,
    checkpoint_every_min_n_samples: int | None = None,
    watchdog_timeout_seconds: float | None = None,
    sharding: str = "dp",
    global_batch_size: int | None = None,
    blend: dict | None = None,
    window_steps: int | Literal["auto"] = "auto",
    balance: bool = True,
    tile_tokens: float | None = None,
    geometry: PlanGeometry | Emu3PlanGeometry | None = None,
) -> SavableLoader:
    """This DP rank's savable loader of `task_encoder`'s batches (infinite: energon repeats
    epochs).

    `data`: a shard dir, a metadataset YAML (blend weights), or several shard dirs (equal
    weights). With `packing=True`, energon buffers `packing_buffer_size` samples and asks the task
    encoder which of them share a row. With `packing="plan"`, rows follow the offline plan of
    `mmdata pack-plan` (`packing_plan`, default `<data>/pack-plan-<seq_length>.parquet`; one shard
    dir only): see `plan_packing`.

    `sharding="global"`: every rank follows one global order (`global_order.py`): step t's
    `global_batch_size` rows are planned from the shard folders' length indexes (`data`: one or
    several folders, mixed by `blend`, `Blend.parse`; `window_steps` steps planned at once; lengths
    counted with the family's `geometry`), placed on ranks by cost when `balance` (`tile_tokens`
    per vision tile, default balance.DEFAULT_TILE_TOKENS); each rank reads only its rows, and the
    loader's state is layout-free (`GlobalOrderLoader`). With `packing="plan"` the rows are the
    plan's sequences instead, step t the `global_batch_size` at stream positions [tG, (t+1)G),
    placed likewise (`plan_steps.PlanSteps`).
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    worker_config = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers, seed_offset=seed)
    make_loader = functools.partial(
        get_savable_loader,
        checkpoint_every_sec=checkpoint_every_sec,
        checkpoint_every_min_n_samples=checkpoint_every_min_n_samples,
        watchdog_timeout_seconds=watchdog_timeout_seconds,
    )
    if sharding == "global":
        return build_global_loader(
            data,
            task_encoder,
            make_loader,
            micro_batch_size=micro_batch_size,
            worker_config=worker_config,
            seed=seed,
            packing=packing,
            global_batch_size=global_batch_size,
            blend=blend,
            window_steps=window_steps,
            balance=balance,
            tile_tokens=tile_tokens,
            geometry=geometry,
            packing_plan=packing_plan,
        )
    if packing == "plan":
        dataset = _plan_dataset(data, packing_plan, task_encoder, micro_batch_size, seed, worker_config)
    elif packing not in (True, False):
        raise ValueError(f"packing must be true, false or 'plan', got {packing!r}")
    else:
        source = _resolve_data(data)
        # a shard dir is read through our own config (mmdata.yaml); a metadataset YAML names it
        # per dataset (`dataset_config:`, checked by readiness)
        config = {} if source.is_file() else {"dataset_config": dataset_config(source)}
        dataset = get_train_dataset(
            str(source),
            **config,
            worker_config=worker_config,
            batch_size=micro_batch_size,
            shuffle_buffer_size=shuffle_buffer_size,
            max_samples_per_sequence=max_samples_per_sequence,
            packing_buffer_size=(packing_buffer_size or DEFAULT_PACKING_BUFFER) if packing else None,
            task_encoder=task_encoder,
        )
    return SavableLoader(make_loader(dataset), task_encoder)


def _plan_dataset(
    data: str | Path | Sequence[str | Path],
    plan: str | Path | None,
    task_encoder: Any,
    micro_batch_size: int,
    seed: int,
    worker_config: WorkerConfig,
) -> Any:
    """The dataset of `packing="plan"` (mmdata.energon_loaders.plan_packing)."""
    shards, path, info = plan_for_data(data, plan, task_encoder.seq_length)
    return PlanPackedDataset(
        shards,
        load_plan(path, info),
        task_encoder,
        micro_batch_size=micro_batch_size,
        seed=seed,
        worker_config=worker_config,
    )
