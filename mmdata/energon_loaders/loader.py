"""Loader factory shared by every family: shard dirs or a metadataset YAML + a family's task
encoder -> an energon savable loader of that family's batches (`PackedBatch` subclasses).

Energon does the streaming, sharding over data-parallel ranks and workers, shuffling,
blending (MetadatasetV2 weights), packing buffers and resumable state; the family supplies the
task encoder, and `SavableLoader` sums the per-batch skip counters into `stats`.

Resume: call `save_state_rank()` when checkpointing (one state per DP rank) and
`restore_state_rank(state)` on an identically built loader BEFORE the first iteration.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

from mmdata.energon_configs import dataset_config, has_mmdata_config
from mmdata.energon_loaders.batch import PackedBatch
from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER
from mmdata.energon_loaders.plan_packing import PlanPackedDataset, load_plan, plan_for_data
from mmdata.energon_loaders.state_codec import state_from_json, state_to_json
from mmdata.readiness import data_source_samples


@dataclass
class LoaderStats:
    """Counters seen by this rank's main process (summed over its workers)."""

    batches: int = 0
    samples: int = 0
    real_tokens: int = 0
    slots: int = 0
    loss_tokens: int = 0
    counters: Counter = field(default_factory=Counter)  # "skipped/<reason>", "truncated"

    @property
    def packing_efficiency(self) -> float:
        return self.real_tokens / self.slots if self.slots else 0.0

    @property
    def skipped(self) -> dict[str, int]:
        return {k.split("/", 1)[1]: v for k, v in sorted(self.counters.items()) if k.startswith("skipped/")}

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "samples": self.samples,
            "real_tokens": self.real_tokens,
            "slots": self.slots,
            "loss_tokens": self.loss_tokens,
            "packing_efficiency": round(self.packing_efficiency, 6),
            "skipped": self.skipped,
            "truncated": int(self.counters.get("truncated", 0)),
        }


class SavableLoader:
    """Iterable over a family's batches with energon's save/restore and our stats."""

    def __init__(self, loader: Any, task_encoder: Any):
        self.loader = loader
        self.task_encoder = task_encoder
        self.stats = LoaderStats()

    def __iter__(self) -> Iterator[PackedBatch]:
        for batch in self.loader:
            s = self.stats
            s.batches += 1
            s.samples += sum(len(r) for r in batch.sample_ids)
            s.real_tokens += batch.num_real_tokens
            s.slots += int(batch.input_ids.numel())
            s.loss_tokens += batch.num_loss_tokens
            s.counters.update(batch.stats)
            yield batch

    def save_state_rank(self) -> Any:
        """This DP rank's loader state (all its workers); store it with the model checkpoint."""
        return self.loader.save_state_rank()

    def restore_state_rank(self, state: Any) -> None:
        """Restore before iterating, on a loader built with the same arguments."""
        self.loader.restore_state_rank(state)

    def save_state_json(self) -> str:
        """`save_state_rank()` as JSON text (no pickle), for checkpoint files."""
        return state_to_json(self.save_state_rank())

    def restore_state_json(self, text: str) -> None:
        self.restore_state_rank(state_from_json(text))


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
) -> SavableLoader:
    """This DP rank's savable loader of `task_encoder`'s batches (infinite: energon repeats
    epochs).

    `data`: a shard dir, a metadataset YAML (blend weights), or several shard dirs (equal
    weights). With `packing=True`, energon buffers `packing_buffer_size` samples and asks the task
    encoder which of them share a row. With `packing="plan"`, rows follow the offline plan of
    `mmdata pack-plan` (`packing_plan`, default `<data>/pack-plan-<seq_length>.parquet`; one shard
    dir only): see `plan_packing`.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    worker_config = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers, seed_offset=seed)
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
    loader = get_savable_loader(
        dataset,
        checkpoint_every_sec=checkpoint_every_sec,
        checkpoint_every_min_n_samples=checkpoint_every_min_n_samples,
        watchdog_timeout_seconds=watchdog_timeout_seconds,
    )
    return SavableLoader(loader, task_encoder)


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
