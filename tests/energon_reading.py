"""The samples of a dataset exactly as energon's own `get_train_dataset` hands them to a task
encoder (no decoding, no batching), for tests that check what energon reads from our folders;
and that dataset for a task encoder of the test's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def energon_samples(path: Path, dataset_config: str | None = None, take: int | None = None) -> list[Any]:
    """The train split's samples in one epoch, or the first `take` of the endless stream (a
    weighted blend needs that). `dataset_config` is for a shard folder only (a metadataset names
    its own per entry)."""
    from megatron.energon import DefaultTaskEncoder, get_loader

    class Identity(DefaultTaskEncoder):
        decoder = None

        def encode_sample(self, sample):
            return sample

        def batch(self, samples):
            return samples

    kwargs = {"dataset_config": dataset_config} if dataset_config else {}
    ds = plain_train_dataset(path, Identity(), repeat=take is not None, **kwargs)
    samples = (s for batch in get_loader(ds) for s in batch)
    return list(samples) if take is None else [s for _, s in zip(range(take), samples)]


def plain_train_dataset(path: Path, task_encoder: Any, repeat: bool = False, **kwargs: Any) -> Any:
    """energon's `get_train_dataset` of `path` read in stored order: one sample per batch, no
    shuffle buffer, no cap on samples per sequence, one rank without workers."""
    from megatron.energon import WorkerConfig, get_train_dataset

    return get_train_dataset(
        str(path),
        split_part="train",
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=repeat,
        task_encoder=task_encoder,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        **kwargs,
    )
