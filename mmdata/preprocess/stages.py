"""The three Ray stages of `mmdata preprocess`, as plain functions (the driver wraps them with
`ray.remote`). Each is idempotent and writes its results atomically under the work folder with a
`.done.json`/marker last, so a retried or resumed task gives the same bytes.

- scan_unit: validate one input file's records; spill valid index rows grouped by bucket.
- sort_bucket: gather one bucket's rows from every scan run and sort them by (key, rid).
- write_shard_task: write one shard from its global-rank slices, fetching media by offset, plus
  energon's .tar.idx and the shard's layout (work/shards/<shard>.layout.json).
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from itertools import accumulate
from pathlib import Path

import numpy as np

from mmdata import shard_format as sf
from mmdata.preprocess import adapters
from mmdata.preprocess.adapters.base import InputUnit
from mmdata.preprocess.energon_meta import TAR_INDEX_SUFFIX, write_tar_index
from mmdata.preprocess.manifest import Counts
from mmdata.preprocess.quarantine import quarantine_line
from mmdata.preprocess.shard_writer import SampleMembers, sha256_file, write_shard
from mmdata.preprocess.shuffle_plan import ShardPlan, bucket_of, shuffle_key
from mmdata.preprocess.validation import Valid, ValidationConfig, validate


# ----------------------------------------------------------------------------- small file helpers


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# Offsets files are raw little-endian int64 arrays: a sort task reads a slice of two of them for
# every (bucket, input file) pair, and np.fromfile on raw data costs a fraction of np.load's
# header parsing and mmap.
_I64 = np.dtype("<i8")


def _save_offsets(path: Path, offsets: list[int]) -> None:
    _write_bytes_atomic(path, np.asarray(offsets, dtype=_I64).tobytes())


def _load_offsets(path: Path, start: int, count: int) -> list[int]:
    """Entries [start, start + count) of an offsets file."""
    got = np.fromfile(path, dtype=_I64, count=count, offset=start * _I64.itemsize)
    if len(got) != count:
        raise IOError(f"{path}: {len(got)} of {count} offsets at entry {start} (work folder damaged?)")
    return got.tolist()


def _read_rows(rows_path: Path, offsets_path: Path, start: int, stop: int) -> list[bytes]:
    """Rows [start, stop) of a row file whose row boundaries are in an offsets file."""
    if stop <= start:
        return []
    offs = _load_offsets(offsets_path, start, stop - start + 1)
    lo = offs[0]
    with open(rows_path, "rb") as f:
        f.seek(lo)
        data = f.read(offs[-1] - lo)
    return [data[a - lo:b - lo] for a, b in zip(offs, offs[1:])]


def scan_file(work: str | Path, unit_index: int, suffix: str) -> Path:
    """One of a scan run's files: rows, rowoffs.i64, buckets.i64, quarantine.jsonl, done.json."""
    return Path(work) / "scan" / f"u{unit_index:07d}.{suffix}"


def _concat_rows(rows: list[bytes]) -> tuple[bytes, list[int]]:
    """Rows back to back (no separators: rows are binary) and their boundaries."""
    return b"".join(rows), [0, *accumulate(map(len, rows))]


# ----------------------------------------------------------------------------- index rows
ROW_FORMAT = 4  # bump when the encoding or the record content changes: unfinished jobs then rescan
# A row is the 8-byte big-endian shuffle key, then NUL-separated UTF-8 fields:
#     rid \0 record_json \0 (path \0 offset \0 size \0 suffix)*   (offset, size in decimal)
# The record JSON is stored as is (no second escaping, no json.loads in the writer). The key is
# fixed width and NUL sorts below every other byte, so sorting raw rows sorts by (key, rid) and
# the output order stays a function of (inputs, seed). No field can hold a NUL: json.dumps
# escapes control characters, and OS paths and tar member names cannot contain one.


def encode_row(key: int, rid: str, record_json: str, media: Iterable[tuple[str, int, int, str]]) -> bytes:
    if "\0" in rid:
        raise ValueError(f"record id contains NUL: {rid!r}")
    # Names may hold undecodable bytes (surrogate escapes, as os.fsencode); the JSON must be UTF-8.
    refs = "".join(f"\0{path}\0{offset}\0{size}\0{suffix}" for path, offset, size, suffix in media)
    return b"".join((key.to_bytes(8, "big"), rid.encode("utf-8", "surrogateescape"), b"\0",
                     record_json.encode(), refs.encode("utf-8", "surrogateescape")))


def decode_row(row: bytes) -> tuple[bytes, list[tuple[str, int, int, str]]]:
    """(record JSON bytes, [(path, offset, size, suffix)]) of an encoded row."""
    f = row[8:].split(b"\0")
    m = [x.decode("utf-8", "surrogateescape") for x in f[2:]]
    return f[1], [(p, int(o), int(n), s) for p, o, n, s in zip(m[0::4], m[1::4], m[2::4], m[3::4])]


def scan_unit(dataset: str, unit: InputUnit, seed: int, num_buckets: int, vcfg: ValidationConfig,
              work: str) -> dict:
    """Validate every record of one input file; spill valid rows grouped by bucket."""
    # Counts are per `source` field; records whose JSON is unreadable count under their folder.
    fallback_source = Path(unit.rel).parent.name or Path(unit.rel).stem
    counts = Counts()
    by_bucket: list[list[bytes]] = [[] for _ in range(num_buckets)]
    qlines: list[str] = []
    try:
        for raw in adapters.iter_records(dataset, unit):
            res = validate(raw, vcfg)
            if isinstance(res, Valid):
                key = shuffle_key(seed, raw.rid)
                row = encode_row(key, raw.rid, res.record_json,
                                 [(m.path, m.offset, m.size, suffix) for m, suffix in res.media])
                by_bucket[bucket_of(key, num_buckets)].append(row)
                counts.add_record(res.source or fallback_source, True, nbytes=len(res.record_json) + sum(m.size for m, _ in res.media))
                counts.add_media(res.media_rule, res.unreferenced_members)
            else:
                qlines.append(quarantine_line(res.id, raw.location, res.reason, res.detail))
                counts.add_record(res.source or fallback_source, False, res.reason)
    except Exception as e:  # noqa: BLE001 - an unreadable input file is quarantined as a whole
        qlines.append(quarantine_line(unit.rel, unit.path, "input_unreadable", f"{type(e).__name__}: {e}"))
        counts.add_record(fallback_source, False, "input_unreadable")
    data, row_offsets = _concat_rows([r for rows in by_bucket for r in rows])
    bucket_offsets = [0]
    for rows in by_bucket:
        bucket_offsets.append(bucket_offsets[-1] + len(rows))
    _write_bytes_atomic(scan_file(work, unit.index, "rows"), data)
    _save_offsets(scan_file(work, unit.index, "rowoffs.i64"), row_offsets)
    _save_offsets(scan_file(work, unit.index, "buckets.i64"), bucket_offsets)
    _write_bytes_atomic(scan_file(work, unit.index, "quarantine.jsonl"), "".join(q + "\n" for q in qlines).encode())
    result = counts.to_json()
    _write_bytes_atomic(scan_file(work, unit.index, "done.json"), json.dumps(result).encode())
    return result


_PREFETCH_BYTES = 64 << 20  # media requested from the kernel ahead of the shard writer


def bucket_file(work: str | Path, bucket: int, suffix: str) -> Path:
    """One of a sorted bucket's files: rows, rowoffs.i64, done.json."""
    return Path(work) / "sorted" / f"b{bucket:05d}.{suffix}"


def sort_bucket(bucket: int, num_units: int, work: str) -> int:
    """Gather one bucket's rows from every scan run and sort them by (key, rid)."""
    w = Path(work)
    rows: list[bytes] = []
    for u in range(num_units):
        lo, hi = _load_offsets(scan_file(w, u, "buckets.i64"), bucket, 2)
        if hi > lo:
            rows.extend(_read_rows(scan_file(w, u, "rows"), scan_file(w, u, "rowoffs.i64"), lo, hi))
    rows.sort()
    data, offsets = _concat_rows(rows)
    _write_bytes_atomic(bucket_file(w, bucket, "rows"), data)
    _save_offsets(bucket_file(w, bucket, "rowoffs.i64"), offsets)
    _write_bytes_atomic(bucket_file(w, bucket, "done.json"), json.dumps({"count": len(rows)}).encode())
    return len(rows)


def _fd_budget() -> int:
    """How many input files a shard writer keeps open: a shard draws from every input file (that
    is the shuffle), so a small cache reopens a file for almost every image. A quarter of the
    soft RLIMIT_NOFILE leaves the rest of the process its descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(4096, (soft if soft != resource.RLIM_INFINITY else 4096) // 4))


class _InputFiles:
    """Open fds of input files (at most `limit`, least recently used closed first), so each
    media read is a single os.pread: no reopening, seeking or Python file object per image."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or _fd_budget()
        self.fds: dict[str, int] = {}
        self.opened = 0  # files opened so far (a cache that thrashes shows here)

    def _fd(self, path: str) -> int:
        fd = self.fds.pop(path, None)
        if fd is None:
            if len(self.fds) >= self.limit:
                os.close(self.fds.pop(next(iter(self.fds))))
            fd = os.open(path, os.O_RDONLY)
            self.opened += 1
        self.fds[path] = fd  # (re)inserted last: dict order is recency order
        return fd

    def prefetch(self, path: str, offset: int, size: int) -> None:
        """Ask the kernel to start reading a range now: a shard's media are scattered over the
        inputs (that is the shuffle), and once the scan's pages are evicted, reading them one
        pread at a time waits on each seek in turn; queued together the device overlaps them."""
        os.posix_fadvise(self._fd(path), offset, size, os.POSIX_FADV_WILLNEED)

    def read(self, path: str, offset: int, size: int) -> bytes:
        fd = self._fd(path)
        data = os.pread(fd, size, offset)
        while 0 < len(data) < size:  # only huge reads (over ~2 GiB on Linux) come back short
            more = os.pread(fd, size - len(data), offset + len(data))
            if not more:
                break
            data += more
        if len(data) != size:
            raise IOError(f"{path}: expected {size} bytes at offset {offset}, got {len(data)} (input changed?)")
        return data

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def shard_work_file(work: str | Path, shard_name: str, suffix: str) -> Path:
    """One of a written shard's work files: json (its done-marker), layout.json."""
    return Path(work) / "shards" / f"{shard_name}.{suffix}"


def write_shard_task(plan: ShardPlan, work: str, out: str) -> dict:
    """Write one shard (or keep it if an earlier run already wrote it and its sha256 matches)."""
    w, o = Path(work), Path(out)
    name = sf.SHARD_NAME_TEMPLATE.format(plan.index)
    path, marker = o / name, shard_work_file(w, name, "json")
    layout_path, index_path = shard_work_file(w, name, "layout.json"), o / f"{name[:-len('.tar')]}{TAR_INDEX_SUFFIX}"
    if all(p.exists() for p in (marker, path, layout_path, index_path)):
        done = json.loads(marker.read_text())
        if done.get("samples") == plan.num_samples and sha256_file(path) == done["sha256"]:
            return {**done, "resumed": True}
    rows = [decode_row(row) for sl in plan.slices
            for row in _read_rows(bucket_file(w, sl.bucket, "rows"), bucket_file(w, sl.bucket, "rowoffs.i64"),
                                  sl.start, sl.stop)]
    files = _InputFiles()

    def samples() -> Iterator[SampleMembers]:
        ahead, ahead_bytes, done_bytes = 0, 0, 0
        for i, (record_json, media) in enumerate(rows):
            while ahead < len(rows) and (ahead <= i or ahead_bytes - done_bytes < _PREFETCH_BYTES):
                for p, off, size, _ in rows[ahead][1]:
                    files.prefetch(p, off, size)
                    ahead_bytes += size
                ahead += 1
            members = [(sf.JSON_MEMBER, record_json)]
            members += [(suffix, files.read(p, off, size)) for p, off, size, suffix in media]
            done_bytes += sum(size for _, _, size, _ in media)
            yield SampleMembers(f"{plan.first_rank + i:010d}", members)

    try:
        result, layout = write_shard(path, samples())
    finally:
        files.close()
    if result.samples != plan.num_samples:
        raise RuntimeError(f"{name}: wrote {result.samples} samples, planned {plan.num_samples}")
    # energon's .tar.idx and the layout (for the driver's energon index) before the marker.
    write_tar_index(path, layout)
    _write_bytes_atomic(layout_path, layout.to_json().encode())
    _write_bytes_atomic(marker, json.dumps(asdict(result)).encode())
    return {**asdict(result), "resumed": False}


