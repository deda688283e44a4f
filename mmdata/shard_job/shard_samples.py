"""A shard's samples as (key, [(member suffix, data offset, size)]) runs of its tar members,
read from the tar's headers (no member data): all of them, or a range of them by energon's
`.tar.idx` (`mmdata tokenize-images` reads a chunk of a big shard at a time)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mmdata.shard_job.energon_meta import TAR_INDEX_SUFFIX
from mmdata.shard_job.tar_scan import BLOCK, TarMember, list_tar, list_tar_range

Samples = list[tuple[str, list[tuple[str, int, int]]]]  # (key, [(suffix, data offset, size)]) per sample


def _samples(members: list[TarMember]) -> Samples:
    samples: Samples = []
    for m in members:
        key, _, suffix = Path(m.name).name.partition(".")
        if not samples or samples[-1][0] != key:
            samples.append((key, []))
        samples[-1][1].append((suffix, m.offset_data, m.size))
    return samples


def shard_samples(path: Path) -> Samples:
    """(key, [(suffix, offset, size)]) of every sample of a shard, in order."""
    listing = list_tar(str(path))
    if listing.tail_error:
        raise IOError(f"{path}: {listing.tail_error}")
    return _samples(listing.members)


def count_samples(path: Path) -> int:
    return len(shard_samples(path))


def chunk_samples(path: Path, start: int, stop: int) -> Samples:
    """Samples [start, stop) of a shard, as `shard_samples(path)[start:stop]`. Only their own
    headers (and the sample before them) are read where the shard's `.tar.idx` (energon's: each
    sample's first header offset, then the end of the archive) matches the tar: it starts at 0,
    ends at the end-of-archive marker, and the headers in the chunk's range start exactly the
    samples it says. Otherwise (no index, or one of another tar) the whole shard is listed.
    Listing the whole shard for every chunk made a chunk's cost grow with its shard: 68 % of a
    64-sample chunk's CPU on a 10,000-sample shard, 10x the chunk's own work on a 256 MiB shard
    of 83,000 tiny samples (docs/preprocess.md, "The driver at cluster scale")."""
    fast = indexed_samples(path, start, stop)
    return fast if fast is not None else shard_samples(path)[start:stop]


def indexed_samples(path: Path, start: int, stop: int) -> Samples | None:
    idx = path.with_name(path.name[: -len(".tar")] + TAR_INDEX_SUFFIX)
    first = max(start - 1, 0)  # the sample before too: the chunk must start where it ends
    try:
        entries = os.path.getsize(idx) // 8
        offsets = np.fromfile(idx, dtype=np.uint64, count=stop - first + 1, offset=first * 8).tolist()
        ends = (
            np.fromfile(idx, dtype=np.uint64, count=1).tolist()
            + np.fromfile(idx, dtype=np.uint64, count=1, offset=(entries - 1) * 8).tolist()
        )
        with open(path, "rb") as f:
            f.seek(ends[-1])
            closed = f.read(BLOCK) == bytes(BLOCK)
    except (OSError, ValueError):
        return None
    if len(offsets) != stop - first + 1 or ends[0] != 0 or stop >= entries or not closed:
        return None
    members = list_tar_range(str(path), offsets[0], offsets[-1])
    if members is None:
        return None
    samples = _samples(members)
    heads = [m[0][1] - BLOCK for _, m in samples]  # (ustar headers: no extension header before them)
    return samples[start - first :] if heads == offsets[:-1] else None
