"""Load (docs/reliability.md): the loader over thousands of small shards and over a few large
ones, with several workers, gives every sample of an epoch exactly once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from mmdata.dev.shards import DevSample, write_dev_shards
from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

WORKERS = 4
N = 2000


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.slow
@pytest.mark.parametrize("samples_per_shard", [1, N // 2], ids=["2000-tiny-shards", "2-large-shards"])
def test_every_sample_exactly_once_per_epoch(tmp_path, tok_dir, samples_per_shard):
    """N text samples as N one-sample shards, or as 2 shards of N/2 (fewer shards than
    workers: energon splits them by sample range), read by 4 workers: the first N samples the
    loader yields are the N samples, each once (no shuffle buffer: it mixes the next epoch in)."""
    samples = [
        DevSample(f"s{i}", [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]) for i in range(N)
    ]
    data = write_dev_shards(tmp_path / "shards", samples, samples_per_shard=samples_per_shard)
    assert len(list(data.glob("shard-*.tar"))) == N // samples_per_shard
    loader = build_llava_ov_loader(
        data,
        tok_dir,
        seq_length=64,
        micro_batch_size=10,
        num_workers=WORKERS,
        packing=False,
        shuffle_buffer_size=None,
        image_size=28,
        patch_size=14,
        max_video_frames=4,
    )
    seen: Counter[str] = Counter()
    for batch in loader:
        seen.update(x for row in batch.sample_ids for x in row)
        if sum(seen.values()) >= N:
            break
    assert sum(seen.values()) == N and set(seen) == {s.id for s in samples}, seen.most_common(3)
