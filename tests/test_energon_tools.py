"""energon's own tools accept our shards with their defaults: `energon lint DIR` and `energon
preview DIR` visit the split parts `train,val,test`, so split.yaml must name all three (issue 30:
before, both ended in `AssertionError: Invalid split part: 'val'`). The train split our loaders
read stays every shard, in order, and shard sets written before (train only) still load."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from mmdata.dev.shards import DevSample, write_dev_shards
from mmdata.energon_loaders.sample import ConversationSample
from mmdata.shard_job.energon_meta import NV_META

N_SAMPLES = 7


def _jpeg(rng: np.random.Generator) -> bytes:
    """A noisy image: energon preview's ASCII render divides by the pixel range (NaN if flat)."""
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def dev_shards(tmp_path_factory) -> Path:
    """A fresh shard set (3 shards) written by the same energon index writer as `mmdata preprocess`."""
    rng = np.random.default_rng(0)
    samples = [
        DevSample(
            id=f"s{i}",
            conversations=[{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": f"noise {i}"}],
            images=[("jpg", _jpeg(rng))],
        )
        for i in range(N_SAMPLES)
    ]
    return write_dev_shards(tmp_path_factory.mktemp("energon_tools") / "shards", samples, samples_per_shard=3)


def _energon(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """The real energon CLI (as the `energon` script runs it), in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "megatron.energon.cli.main", *args], input=stdin, capture_output=True, text=True
    )


def _check(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert "Invalid split part" not in out, out
    assert proc.returncode == 0, out
    return out


def test_energon_lint_defaults_pass(dev_shards):
    out = _check(_energon("lint", str(dev_shards)))
    assert "Skipping empty split part val" in out and "Skipping empty split part test" in out, out


def test_energon_preview_defaults_pass(dev_shards):
    # preview asks "Continue?" after each sample; end of input answers no.
    out = _check(_energon("preview", str(dev_shards)))
    assert "Sample 0" in out and "noise" in out, out
    assert "Dataset val is empty" in out and "Dataset test is empty" in out, out


def _train_ids(path: Path) -> list[str]:
    """Sample ids of the train split through energon's loader, in order (no shuffling)."""
    from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset

    class Identity(DefaultTaskEncoder):
        decoder = None

        def encode_sample(self, sample: ConversationSample) -> ConversationSample:
            return sample

        def batch(self, samples: list[ConversationSample]) -> list[ConversationSample]:
            return samples

    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset(
        str(path),
        split_part="train",
        worker_config=worker_config,
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        task_encoder=Identity(),
        dataset_config="mmdata.yaml",
    )
    return [s.id for batch in get_loader(ds) for s in batch]


@pytest.mark.unit
def test_train_split_unchanged_and_old_split_yaml_still_loads(dev_shards, tmp_path):
    split = yaml.safe_load((dev_shards / NV_META / "split.yaml").read_text())
    assert split == {"split_parts": {"train": ["shard-{000000..000002}.tar"], "val": [], "test": []}, "exclude": []}
    new_ids = _train_ids(dev_shards)
    assert sorted(new_ids) == sorted(f"s{i}" for i in range(N_SAMPLES))
    # A shard set written before this change: the same shards, split.yaml with `train` only.
    old = tmp_path / "old"
    (old / NV_META).mkdir(parents=True)
    for f in dev_shards.iterdir():
        if f.is_file():
            (old / f.name).symlink_to(f)
    for f in (dev_shards / NV_META).iterdir():
        (old / NV_META / f.name).write_bytes(f.read_bytes())
    old_split = {"split_parts": {"train": split["split_parts"]["train"]}, "exclude": []}
    (old / NV_META / "split.yaml").write_text(yaml.safe_dump(old_split, sort_keys=False))
    assert _train_ids(old) == new_ids
