"""Read a shards directory written by `mmdata preprocess` without loading it: the manifest,
the quarantine, and individual samples by position or id.

Reading is lazy on purpose: a sample is its JSON record plus *references* (file, offset,
size) to its media members, so computing image sizes reads a few header bytes instead of the
whole image, and a seeded random sample of 1,000 out of 44M records touches only the bytes of
those 1,000 records. Random access uses energon's per-shard `{shard}.tar.idx` (sample byte
offsets, written by `energon prepare`) when present, and walks the tar headers otherwise.
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image

from mmdata import shard_format as sf
from mmdata.energon_loaders.sample import sample_loader
from mmdata.readiness import DatasetNotReady, unfinished_job

ITAR_SUFFIX = ".tar.idx"  # energon's per-shard sample-offset index (uint64 little-endian)
INFO_JSON = ".nv-meta/.info.json"  # energon's shard sample counts


# ----------------------------------------------------------------------------- members


class _RangeFile(io.RawIOBase):
    """A read-only view of bytes [offset, offset+size) of a file, so PIL reads only a header."""

    def __init__(self, path: Path, offset: int, size: int):
        self._f = open(path, "rb")
        self._start, self._size, self._pos = offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._f.close()
        super().close()


@dataclass(frozen=True)
class MemberRef:
    """Where one tar member's data lives."""

    path: Path
    offset: int
    size: int

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)

    def open(self) -> BinaryIO:
        """A lazily-read file object over the member (close it when done)."""
        return io.BufferedReader(_RangeFile(self.path, self.offset, self.size), buffer_size=16384)


@dataclass
class ShardSample:
    """One sample of a shard: its record (the `{key}.json` member) and its media members."""

    key: str
    shard: str
    index: int  # position inside the shard
    record: dict[str, Any]
    members: dict[str, MemberRef]  # suffix ("img00.jpg", "video.mp4", "json") -> data

    @property
    def id(self) -> str:
        return str(self.record.get("id", ""))

    @property
    def source(self) -> str:
        return str(self.record.get("source") or "")

    @property
    def conversations(self) -> list[dict[str, str]]:
        return list(self.record.get("conversations") or [])

    @property
    def image_names(self) -> list[str]:
        return list(self.record.get("images") or [])

    @property
    def video_name(self) -> str | None:
        return self.record.get("video") or None

    def media_bytes(self, name: str) -> bytes:
        return self.members[name].read()

    def open_image(self, i: int):
        """The i-th image, fully decoded (PIL), for display."""
        img = Image.open(io.BytesIO(self.media_bytes(self.image_names[i])))
        img.load()
        return img

    def to_energon_fields(self) -> dict[str, Any]:
        """The fields of `ConversationSample`, built by the loaders' own `sample_loader`."""
        raw: dict[str, Any] = {sf.JSON_MEMBER: self.record}
        for name, ref in self.members.items():
            if name != sf.JSON_MEMBER:
                raw[name] = ref.read()
        return sample_loader(raw)


def split_member_name(name: str) -> tuple[str, str]:
    """`dir/0000000001.img00.jpg` -> ("0000000001", "img00.jpg"): webdataset's key/suffix rule."""
    base = name.rsplit("/", 1)[-1]
    key, _, suffix = base.partition(".")
    return key, suffix


def _group_members(tar: tarfile.TarFile, stop_after_first: bool = False) -> Iterator[tuple[str, list[tarfile.TarInfo]]]:
    """Consecutive members sharing a key, in tar order; only headers are read."""
    key: str | None = None
    group: list[tarfile.TarInfo] = []
    while True:
        info = tar.next()
        if info is None:
            break
        if not info.isfile():
            continue
        k, _ = split_member_name(info.name)
        if key is not None and k != key:
            yield key, group
            if stop_after_first:
                return
            group = []
        key = k
        group.append(info)
    if key is not None and group:
        yield key, group


def _make_sample(path: Path, shard: str, index: int, key: str, infos: list[tarfile.TarInfo]) -> ShardSample:
    members = {split_member_name(i.name)[1]: MemberRef(path, i.offset_data, i.size) for i in infos}
    if sf.JSON_MEMBER not in members:
        raise ValueError(f"{shard}: sample {key!r} has no {sf.JSON_MEMBER} member")
    record = json.loads(members[sf.JSON_MEMBER].read())
    return ShardSample(key=key, shard=shard, index=index, record=record, members=members)


# ----------------------------------------------------------------------------- dataset


@dataclass
class ShardInfo:
    name: str
    path: Path
    samples: int | None  # None when neither the manifest nor energon's info knows
    bytes: int
    sha256: str | None = None


@dataclass
class Dataset:
    """A shards directory: the manifest (if any) and its shards in order."""

    root: Path
    manifest: dict[str, Any] | None
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def total_samples(self) -> int:
        return sum(self.shard_counts())

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def shard_counts(self) -> list[int]:
        """Samples per shard; shards of unknown size are counted by walking their headers once."""
        for s in self.shards:
            if s.samples is None:
                s.samples = _count_samples(s.path)
        return [int(s.samples or 0) for s in self.shards]

    def locate(self, global_index: int) -> tuple[ShardInfo, int]:
        """(shard, position in shard) of the global_index-th sample."""
        cum = self.shard_starts()
        if not 0 <= global_index < cum[-1]:
            raise IndexError(f"sample index {global_index} out of range [0, {cum[-1]})")
        s, pos = _split_index(cum, global_index)
        return self.shards[s], pos

    def shard_starts(self) -> np.ndarray:
        """Global index of each shard's first sample, plus the total at the end."""
        return np.cumsum([0, *self.shard_counts()])


def _split_index(starts: np.ndarray, global_index: int) -> tuple[int, int]:
    """(shard number, position in shard) of a global sample index, given `shard_starts()`."""
    s = int(np.searchsorted(starts, global_index, side="right")) - 1
    return s, int(global_index - starts[s])


def _count_samples(path: Path) -> int:
    with tarfile.open(path, "r:") as tar:
        return sum(1 for _ in _group_members(tar))


def open_dataset(root: str | Path) -> Dataset:
    """The manifest and shard list of `root`; falls back to energon's info and the tar files."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetNotReady(f"{root} is not a shards directory ({'a file' if root.exists() else 'does not exist'})")
    if (why := unfinished_job(root)) is not None:
        raise DatasetNotReady(why)
    if not ((root / sf.MANIFEST_NAME).is_file() or (root / sf.ENERGON_META).is_dir() or any(root.glob("*.tar"))):
        raise DatasetNotReady(
            f"{root} is not a shards directory: no {sf.MANIFEST_NAME}, {sf.ENERGON_META}/ or *.tar "
            "(expected the output of `mmdata preprocess`)"
        )
    manifest = None
    if (root / sf.MANIFEST_NAME).is_file():
        manifest = json.loads((root / sf.MANIFEST_NAME).read_text())
    energon_counts: dict[str, int] = {}
    if (root / INFO_JSON).is_file():
        energon_counts = dict(json.loads((root / INFO_JSON).read_text()).get("shard_counts") or {})
    entries = manifest.get("shards") if manifest else None  # [asdict(ShardResult)], see preprocess/job.py
    shards: list[ShardInfo] = []
    if entries:
        for e in entries:
            name = str(e["name"])
            path = root / name
            if path.resolve().parent != root.resolve() and root.resolve() not in path.resolve().parents:
                raise ValueError(f"manifest shard {name!r} escapes {root}")
            shards.append(ShardInfo(name, path, e["samples"], e["bytes"], e.get("sha256")))
    else:
        for path in sorted(root.glob("*.tar")):
            shards.append(ShardInfo(path.name, path, energon_counts.get(path.name), path.stat().st_size))
    return Dataset(root=root, manifest=manifest, shards=shards)


# ----------------------------------------------------------------------------- reading


def _itar_offsets(shard_path: Path) -> np.ndarray | None:
    idx = shard_path.with_suffix(ITAR_SUFFIX)
    if not idx.is_file():
        return None
    raw = idx.read_bytes()
    return np.array(struct.unpack(f"<{len(raw) // 8}Q", raw), dtype=np.int64)


def read_shard(shard: ShardInfo, positions: Iterable[int] | None = None) -> Iterator[ShardSample]:
    """Samples of one shard, in order: all of them, or only those at `positions`.

    With energon's `.tar.idx` each wanted sample is a seek plus its own headers; without it the
    tar headers are walked (member data is skipped, never read, except the wanted JSON).
    """
    wanted = None if positions is None else sorted(set(int(p) for p in positions))
    offsets = _itar_offsets(shard.path) if wanted is not None else None
    if wanted is not None and offsets is not None and (not wanted or wanted[-1] < len(offsets)):
        with open(shard.path, "rb") as f:
            for pos in wanted:
                f.seek(int(offsets[pos]))
                with tarfile.open(fileobj=f, mode="r:") as tar:
                    for key, infos in _group_members(tar, stop_after_first=True):
                        yield _make_sample(shard.path, shard.name, pos, key, infos)
        return
    want = None if wanted is None else set(wanted)
    last = None if wanted is None else (wanted[-1] if wanted else -1)
    with tarfile.open(shard.path, "r:") as tar:
        for pos, (key, infos) in enumerate(_group_members(tar)):
            if last is not None and pos > last:
                return
            if want is None or pos in want:
                yield _make_sample(shard.path, shard.name, pos, key, infos)


def iter_samples(root: str | Path | Dataset, *, limit: int | None = None) -> Iterator[ShardSample]:
    """Every sample in shard order (reads all JSON members; media stay unread)."""
    ds = root if isinstance(root, Dataset) else open_dataset(root)
    n = 0
    for shard in ds.shards:
        for sample in read_shard(shard):
            if limit is not None and n >= limit:
                return
            yield sample
            n += 1


def sample_positions(ds: Dataset, n: int, seed: int) -> list[int]:
    """`n` distinct global sample indices drawn uniformly with a seeded generator, sorted."""
    total = ds.total_samples
    if n >= total:
        return list(range(total))
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(total, size=n, replace=False))


def read_samples_at(ds: Dataset, global_indices: Iterable[int]) -> list[ShardSample]:
    """The samples at these global indices (shard order), one pass per touched shard."""
    by_shard: dict[int, list[int]] = {}
    starts = ds.shard_starts()
    for g in global_indices:
        s, pos = _split_index(starts, g)
        by_shard.setdefault(s, []).append(pos)
    out: list[ShardSample] = []
    for s in sorted(by_shard):
        out.extend(read_shard(ds.shards[s], by_shard[s]))
    return out


def random_samples(root: str | Path | Dataset, n: int, seed: int = 0) -> list[ShardSample]:
    """A seeded uniform random sample of `n` samples (all of them when n >= total)."""
    ds = root if isinstance(root, Dataset) else open_dataset(root)
    return read_samples_at(ds, sample_positions(ds, n, seed))


def find_sample(root: str | Path | Dataset, sample_id: str) -> ShardSample | None:
    """Look a sample up by its shard key (e.g. "0000000042"), its sample key as metrics print it
    ("DIR#0000000042": ValueError when DIR is another dataset) or its original record id.

    A key is the sample's global index (shard_format), so it costs one seek. An original id is
    not indexed: that costs a scan of every shard's headers and JSON members (media skipped),
    i.e. time linear in the number of samples — fine for thousands, minutes for tens of millions.
    """
    ds = root if isinstance(root, Dataset) else open_dataset(root)
    dataset, sep, shard_key = sample_id.rpartition(sf.SAMPLE_KEY_SEP)
    if sep and Path(dataset).is_dir():  # (a record id may hold the separator too)
        if Path(dataset).resolve() != Path(ds.root).resolve():
            raise ValueError(f"{sample_id!r} names a sample of {dataset}, not of {ds.root}")
        sample_id = shard_key
    if sample_id.isdigit():
        g = int(sample_id)
        if 0 <= g < ds.total_samples:
            shard, pos = ds.locate(g)
            for sample in read_shard(shard, [pos]):
                if sample.key == sample_id:
                    return sample
    for sample in iter_samples(ds):
        if sample.id == sample_id or sample.key == sample_id:
            return sample
    return None


# ----------------------------------------------------------------------------- quarantine


@dataclass
class QuarantineRecord:
    """One line of `quarantine.jsonl`: a record that was not written, and why."""

    id: str
    reason: str
    location: str
    detail: str
    raw: dict[str, Any]


def load_quarantine(root: str | Path) -> list[QuarantineRecord]:
    """All quarantined records of a shards dir (empty when there is no quarantine file)."""
    path = Path(root) / sf.QUARANTINE_NAME
    if not path.is_file():
        return []
    out: list[QuarantineRecord] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)  # as written by mmdata.shard_job.quarantine.quarantine_line
            out.append(
                QuarantineRecord(
                    id=str(row["id"]),
                    reason=str(row["reason"]),
                    location=str(row["source_location"]),
                    detail=str(row["detail"]),
                    raw=row,
                )
            )
    return out
