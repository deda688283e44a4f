"""The three Ray stages of `mmdata preprocess`, as plain functions (the driver wraps them with
`ray.remote`). Each is idempotent and writes its results atomically under the work folder with a
`.done.json`/marker last, so a retried or resumed task gives the same bytes.

- scan_unit: validate one input file's records; spill valid index rows grouped by bucket.
- sort_bucket: gather one bucket's rows from every scan run and sort them by (key, rid).
- write_shard_task: write one shard from its global-rank slices, fetching media by offset.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mmdata import shard_format as sf
from mmdata.preprocess import adapters
from mmdata.preprocess.adapters.base import InputUnit
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


def _save_offsets(path: Path, offsets: list[int]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npy")
    np.save(tmp, np.asarray(offsets, dtype=np.int64))
    os.replace(tmp, path)


def _read_rows(rows_path: Path, offsets_path: Path, start: int, stop: int) -> list[bytes]:
    """Rows [start, stop) of a row file whose row boundaries are in an offsets .npy."""
    offs = np.load(offsets_path, mmap_mode="r")
    lo, hi = int(offs[start]), int(offs[stop])
    if hi <= lo:
        return []
    with open(rows_path, "rb") as f:
        f.seek(lo)
        data = f.read(hi - lo)
    return data.splitlines()


def _concat_rows(rows: Iterable[bytes]) -> tuple[bytes, list[int]]:
    parts, offsets, pos = [], [0], 0
    for r in rows:
        parts.append(r)
        parts.append(b"\n")
        pos += len(r) + 1
        offsets.append(pos)
    return b"".join(parts), offsets


def scan_unit(dataset: str, unit: InputUnit, seed: int, num_buckets: int, vcfg: ValidationConfig,
              work: str) -> dict:
    """Validate every record of one input file; spill valid rows grouped by bucket."""
    scan_dir = Path(work) / "scan"
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
                # Key first, fixed width: sorting the raw lines sorts by (key, rid).
                row = json.dumps({"k": f"{key:016x}", "r": raw.rid, "j": res.record_json,
                                  "m": [[m.path, m.offset, m.size, suffix] for m, suffix in res.media]},
                                 ensure_ascii=False)
                by_bucket[bucket_of(key, num_buckets)].append(row.encode())
                counts.add_record(res.source or fallback_source, True, nbytes=len(res.record_json) + sum(m.size for m, _ in res.media))
            else:
                qlines.append(quarantine_line(res.id, raw.location, res.reason, res.detail))
                counts.add_record(res.source or fallback_source, False, res.reason)
    except Exception as e:  # noqa: BLE001 - an unreadable input file is quarantined as a whole
        qlines.append(quarantine_line(unit.rel, unit.path, "input_unreadable", f"{type(e).__name__}: {e}"))
        counts.add_record(fallback_source, False, "input_unreadable")
    data, row_offsets = _concat_rows(r for rows in by_bucket for r in rows)
    bucket_offsets = [0]
    for rows in by_bucket:
        bucket_offsets.append(bucket_offsets[-1] + len(rows))
    base = f"u{unit.index:07d}"
    _write_bytes_atomic(scan_dir / f"{base}.rows", data)
    _save_offsets(scan_dir / f"{base}.rowoffs.npy", row_offsets)
    _save_offsets(scan_dir / f"{base}.buckets.npy", bucket_offsets)
    _write_bytes_atomic(scan_dir / f"{base}.quarantine.jsonl", "".join(q + "\n" for q in qlines).encode())
    result = counts.to_json()
    _write_bytes_atomic(scan_dir / f"{base}.done.json", json.dumps(result).encode())
    return result


def sort_bucket(bucket: int, num_units: int, work: str) -> int:
    """Gather one bucket's rows from every scan run and sort them by (key, rid)."""
    w = Path(work)
    rows: list[bytes] = []
    for u in range(num_units):
        base = w / "scan" / f"u{u:07d}"
        b = np.load(f"{base}.buckets.npy", mmap_mode="r")
        lo, hi = int(b[bucket]), int(b[bucket + 1])
        if hi > lo:
            rows.extend(_read_rows(Path(f"{base}.rows"), Path(f"{base}.rowoffs.npy"), lo, hi))
    rows.sort()
    data, offsets = _concat_rows(rows)
    base = w / "sorted" / f"b{bucket:05d}"
    _write_bytes_atomic(Path(f"{base}.rows"), data)
    _save_offsets(Path(f"{base}.rowoffs.npy"), offsets)
    _write_bytes_atomic(Path(f"{base}.done.json"), json.dumps({"count": len(rows)}).encode())
    return len(rows)


class _FileCache:
    """A few open input files, so shard writers don't reopen a tar for every image."""

    def __init__(self, size: int = 32):
        self.size, self.files = size, OrderedDict()

    def read(self, path: str, offset: int, size: int) -> bytes:
        f = self.files.pop(path, None) or open(path, "rb")
        self.files[path] = f
        while len(self.files) > self.size:
            self.files.popitem(last=False)[1].close()
        f.seek(offset)
        data = f.read(size)
        if len(data) != size:
            raise IOError(f"{path}: expected {size} bytes at offset {offset}, got {len(data)} (input changed?)")
        return data

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def write_shard_task(plan: ShardPlan, work: str, out: str) -> dict:
    """Write one shard (or keep it if an earlier run already wrote it and its sha256 matches)."""
    w, o = Path(work), Path(out)
    name = sf.SHARD_NAME_TEMPLATE.format(plan.index)
    path, marker = o / name, w / "shards" / f"{name}.json"
    if marker.exists() and path.exists():
        done = json.loads(marker.read_text())
        if done.get("samples") == plan.num_samples and sha256_file(path) == done["sha256"]:
            return {**done, "resumed": True}
    cache = _FileCache()

    def samples() -> Iterator[SampleMembers]:
        rank = plan.first_rank
        for sl in plan.slices:
            base = w / "sorted" / f"b{sl.bucket:05d}"
            for line in _read_rows(Path(f"{base}.rows"), Path(f"{base}.rowoffs.npy"), sl.start, sl.stop):
                row = json.loads(line)
                members = [(sf.JSON_MEMBER, row["j"].encode())]
                members += [(suffix, cache.read(p, off, size)) for p, off, size, suffix in row["m"]]
                yield SampleMembers(f"{rank:010d}", members)
                rank += 1

    try:
        result = write_shard(path, samples())
    finally:
        cache.close()
    if result.samples != plan.num_samples:
        raise RuntimeError(f"{name}: wrote {result.samples} samples, planned {plan.num_samples}")
    _write_bytes_atomic(marker, json.dumps(asdict(result)).encode())
    return {**asdict(result), "resumed": False}


