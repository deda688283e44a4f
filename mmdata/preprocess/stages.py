"""The Ray stages of `mmdata preprocess`, as plain functions (the driver wraps them with
`ray.remote`). Each is idempotent and writes its results atomically under the work folder with a
done-marker last, so a retried or resumed task gives the same bytes.

- scan_unit: validate one input file's records and apply the filters; spill the kept records'
  index rows (with their length-index token counts) grouped by sort bucket, and (with --dedup)
  their LSH entries.
- (curation/dedup.py: dedup_partition and resolve_bucket, between scan and sort)
- sort_bucket: gather one bucket's rows from every scan run, drop duplicates, apply the mix
  (keep / repeat), sort by (key, rid). Repeated copies bound for other buckets are spilled.
- merge_bucket: (only when the mix repeats records) add the copies bound for this bucket.
- write_shard_task: write one shard from its global-rank slices, fetching media by offset, plus
  energon's .tar.idx, the shard's layout and its part of the length index.
"""

from __future__ import annotations

import json
import os
import resource
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mmdata import shard_format as sf
from mmdata.preprocess import adapters
from mmdata.preprocess.adapters.base import InputUnit, RawRecord
from mmdata.preprocess.curation.dedup import EntryBuilder, key64, load_drops
from mmdata.preprocess.curation.features import conversation_key, filter_fields, image_hashes
from mmdata.preprocess.curation.filters import FilterRule, first_failed
from mmdata.preprocess.curation.mix import copies
from mmdata.shard_job.energon_meta import INDEX_PART, TAR_INDEX_SUFFIX, write_index_part, write_tar_index
from mmdata.preprocess.lengths import LENGTHS_COLUMNS, LENGTHS_DTYPE, LengthCounter
from mmdata.shard_job.manifest import Counts
from mmdata.shard_job.quarantine import quarantine_line
from mmdata.preprocess.rows import (
    concat_rows,
    decode_row,
    encode_row,
    load_row_group,
    read_all_rows,
    read_rows,
    rekey_row,
    row_head,
    save_offsets,
    save_row_groups,
    write_bytes_atomic,
)
from mmdata.shard_job.shard_writer import FileRange, SampleMembers, sha256_file, shard_work_file, write_shard
from mmdata.preprocess.shuffle_plan import ShardPlan, bucket_of, shuffle_key
from mmdata.preprocess.validation import Valid, ValidationConfig, quiet_pillow_bomb_warning, validate_many


@dataclass(frozen=True)
class JobSpec:
    """What every task needs to know about the job (sent with each task)."""

    dataset: str
    seed: int
    num_buckets: int
    validation: ValidationConfig
    work: str
    filters: tuple[FilterRule, ...] = ()
    dedup_distance: int | None = None  # None: no --dedup
    dedup_scope: str = "record"
    mix_by: str | None = None  # None: no --mix
    tokenizer: str | None = None
    lengths: bool = True  # count tokens for the length index (--no-length-index: zeros)

    @property
    def dedup(self) -> bool:
        return self.dedup_distance is not None

    def group_of(self, source: str, subset: str) -> str:
        """The record's --mix group."""
        return source if self.mix_by == "source" else subset


# ----------------------------------------------------------------------------- work files


def scan_file(work: str | Path, unit_index: int, suffix: str) -> Path:
    """One of a scan run's files: rows, rowoffs.i64, groups.i64 (by bucket), quarantine.jsonl,
    ids / idoffs.i64 (dedup), done.json."""
    return Path(work) / "scan" / f"u{unit_index:07d}.{suffix}"


def bucket_file(work: str | Path, bucket: int, suffix: str) -> Path:
    """One of a sorted bucket's files: rows, rowoffs.i64, duplicates.jsonl, copies.* (repeated
    copies for other buckets), merged.rows / merged.rowoffs.i64, done.json, merged.json."""
    return Path(work) / "sorted" / f"b{bucket:05d}.{suffix}"


def bucket_rows(work: str | Path, bucket: int, merged: bool) -> tuple[Path, Path]:
    """(rows, row offsets) of a finished bucket: the merged ones when the mix repeats records."""
    pre = "merged." if merged else ""
    return bucket_file(work, bucket, f"{pre}rows"), bucket_file(work, bucket, f"{pre}rowoffs.i64")


def subset_of(unit: InputUnit) -> str:
    """The input file's folder under its input root (e.g. stage2/2a), "" at the top."""
    parent = Path(unit.rel).parent.as_posix()
    return "" if parent == "." else parent


# ----------------------------------------------------------------------------- scan


SCAN_BATCH_RECORDS = 256  # records validated phase by phase together (validation.validate_many)
SCAN_BATCH_BYTES = 16 << 20  # ... or fewer, when their JSON reaches this size (parsed records stay bounded)


def _batches(records: Iterator[RawRecord]) -> Iterator[tuple[list[RawRecord], Exception | None]]:
    """The records in batches for `validate_many`. An exception from the iterator (an input file
    unreadable half way) ends the batches, handed back with the records read before it."""
    batch: list[RawRecord] = []
    size = 0
    while True:
        try:
            raw = next(records, None)
        except Exception as e:  # noqa: BLE001 - the scan quarantines the rest of the file
            yield batch, e
            return
        if raw is None:
            break
        batch.append(raw)
        size += len(raw.json_bytes or b"")
        if len(batch) == SCAN_BATCH_RECORDS or size >= SCAN_BATCH_BYTES:
            yield batch, None
            batch, size = [], 0
    if batch:
        yield batch, None


def scan_unit(unit: InputUnit, spec: JobSpec) -> dict:
    """Validate every record of one input file; spill the kept rows grouped by bucket."""
    quiet_pillow_bomb_warning()
    # Counts are per `source` field; records whose JSON is unreadable count under their folder.
    fallback_source = Path(unit.rel).parent.name or Path(unit.rel).stem
    subset = subset_of(unit)
    counts = Counts()
    by_bucket: list[list[bytes]] = [[] for _ in range(spec.num_buckets)]
    qlines: list[str] = []
    groups: Counter[str] = Counter()  # kept records per mix group
    entries = EntryBuilder(spec.dedup_distance, spec.dedup_scope) if spec.dedup else None
    lengths = LengthCounter(spec.tokenizer) if spec.lengths else None
    ids: list[str] = []  # (dedup) "id NUL location" per kept record, for duplicates.jsonl
    phash: Counter[str] = Counter()  # image hashes taken from the field / computed
    kept = 0  # the next kept record's ordinal (its handle: what dedup marks refer to)
    try:
        for batch, error in _batches(adapters.iter_records(spec.dataset, unit)):
            results = validate_many(batch, spec.validation, keep_image_bytes=spec.dedup)
            for locator in {id(raw.locator): raw.locator for raw in batch}.values():
                locator.close()  # (the file's iterator may have ended, and closed it, before the batch was read)
            for raw, res in zip(batch, results):
                if not isinstance(res, Valid):
                    qlines.append(quarantine_line(res.id, raw.location, res.reason, res.detail))
                    counts.add_record(res.source or fallback_source, False, res.reason)
                    continue
                source = res.source or fallback_source
                counts.add_media(res.media_rule, res.unreferenced_members)
                rule = first_failed(list(spec.filters), filter_fields(res.record, subset)) if spec.filters else None
                if rule is not None:
                    counts.add_filtered(source, rule.expr)
                    continue
                key = shuffle_key(spec.seed, raw.rid)
                bucket = bucket_of(key, spec.num_buckets)
                handle = (unit.index, kept)
                kept += 1
                media = [(m.path, m.offset, m.size, suffix) for m, suffix in res.media]
                tokens = lengths(res.record) if lengths else (0, 0, 0)
                by_bucket[bucket].append(
                    encode_row(key, raw.rid, handle, source, subset, res.record_json, media, tokens)
                )
                counts.add_record(source, True, nbytes=len(res.record_json) + sum(m.size for m, _ in res.media))
                group = spec.group_of(source, subset) if spec.mix_by else ""
                if spec.mix_by:
                    groups[group] += 1
                if entries is not None:
                    ids.append(f"{res.record['id']}\0{raw.location}")
                    if res.image_bytes and res.record["video"] is None:
                        hashes, computed = image_hashes(res.record["meta"].get("phash"), res.image_bytes)
                        phash["computed" if computed else "from_field"] += len(hashes)
                        pixels = sum(w * h for w, h, _ in res.record["meta"]["image_sizes"])
                        entries.add(
                            hashes,
                            conversation_key(res.record["conversations"]),
                            pixels,
                            key64(f"{res.record['id']}\0{source}"),
                            key64(raw.rid),
                            unit.index,
                            handle[1],
                            key,
                            key64(group) if spec.mix_by else 0,
                        )
            if error is not None:
                raise error
    except Exception as e:  # noqa: BLE001 - an unreadable input file is quarantined as a whole
        qlines.append(quarantine_line(unit.rel, unit.path, "input_unreadable", f"{type(e).__name__}: {e}"))
        counts.add_record(fallback_source, False, "input_unreadable")
    save_row_groups(scan_file(spec.work, unit.index, "run"), by_bucket)
    write_bytes_atomic(scan_file(spec.work, unit.index, "quarantine.jsonl"), "".join(q + "\n" for q in qlines).encode())
    result = counts.to_json()
    if spec.mix_by:
        result["groups"] = dict(sorted(groups.items()))
    if entries is not None:
        data, offsets = concat_rows([i.encode("utf-8", "surrogateescape") for i in ids])
        write_bytes_atomic(scan_file(spec.work, unit.index, "ids"), data)
        save_offsets(scan_file(spec.work, unit.index, "idoffs.i64"), offsets)
        entries.save(spec.work, unit.index, spec.num_buckets)
        result["phash"] = {"from_field": phash["from_field"], "computed": phash["computed"]}
    write_bytes_atomic(scan_file(spec.work, unit.index, "done.json"), json.dumps(result).encode())
    return result


# ----------------------------------------------------------------------------- sort


def _record_ref(work: str, handle: tuple[int, int]) -> tuple[str, str]:
    """(id, location) of a kept record by its handle (dedup's per-file id table)."""
    unit, ordinal = handle
    (raw,) = read_rows(scan_file(work, unit, "ids"), scan_file(work, unit, "idoffs.i64"), ordinal, ordinal + 1)
    record_id, _, location = raw.decode("utf-8", "surrogateescape").partition("\0")
    return record_id, location


def _drop_duplicates(rows: list[bytes], bucket: int, spec: JobSpec, tally) -> list[bytes]:
    """The rows that survive dedup; duplicates.jsonl lines for the others (in (key, rid) order)."""
    drops = load_drops(spec.work, bucket)
    kept, lines = [], []
    for row in sorted(rows) if drops else rows:
        _, handle, source, _ = row_head(row)
        drop = drops.get(handle)
        if drop is None:
            kept.append(row)
            continue
        tally(source, "duplicates")
        (record_id, location), (nid, nlocation) = _record_ref(spec.work, handle), _record_ref(spec.work, drop[:2])
        lines.append(
            json.dumps(
                {
                    "id": record_id,
                    "source_location": location,
                    "duplicate_of": nid,
                    "duplicate_of_location": nlocation,
                    "distance": drop[2],
                    "scope": spec.dedup_scope,
                },
                ensure_ascii=False,
                sort_keys=True,
            )
        )
    write_bytes_atomic(bucket_file(spec.work, bucket, "duplicates.jsonl"), "".join(x + "\n" for x in lines).encode())
    return kept


def _apply_mix(
    rows: list[bytes], bucket: int, factors: dict[str, float], spec: JobSpec, tally, copies_out: list[list[bytes]]
) -> list[bytes]:
    """Each record written `mix.copies` times (0: mixed out); a repeated copy gets its own
    shuffle key, so it goes to whichever bucket that key falls in."""
    out: list[bytes] = []
    for row in rows:
        rid, _, source, subset = row_head(row)
        group = spec.group_of(source, subset)
        n = copies(factors.get(group, 0.0), spec.seed, rid)
        tally(source, "mixed_out" if n == 0 else "kept", group)
        if n:
            out.append(row)
        for j in range(1, n):
            copy_rid = f"{rid}#repeat{j}"
            key = shuffle_key(spec.seed, copy_rid)
            b = bucket_of(key, spec.num_buckets)
            (out if b == bucket else copies_out[b]).append(rekey_row(row, key, copy_rid))
            tally(source, "repeated", group)
    return out


def sort_bucket(
    bucket: int, num_units: int, spec: JobSpec, factors: dict[str, float] | None = None, spill: bool = False
) -> dict:
    """Gather one bucket's rows from every scan run, drop its duplicates (--dedup), apply the mix
    factors (--mix; repeated copies for other buckets spilled when `spill`), and sort them by
    (key, rid). Returns the count and the curation tallies per source and per mix group."""
    w = Path(spec.work)
    rows: list[bytes] = []
    for u in range(num_units):
        rows.extend(load_row_group(scan_file(w, u, "run"), bucket))
    curation: dict[str, Counter] = defaultdict(Counter)
    mix: dict[str, Counter] = defaultdict(Counter)

    def tally(source: str, what: str, group: str | None = None) -> None:
        if what != "kept":
            curation[source][what] += 1
        if group is not None:
            mix[group][what] += 1

    if spec.dedup:
        rows = _drop_duplicates(rows, bucket, spec, tally)
    copies_out: list[list[bytes]] = [[] for _ in range(spec.num_buckets)]
    if factors is not None:
        rows = _apply_mix(rows, bucket, factors, spec, tally, copies_out)
    rows.sort()
    data, offsets = concat_rows(rows)
    rows_path, offs_path = bucket_rows(w, bucket, merged=False)
    write_bytes_atomic(rows_path, data)
    save_offsets(offs_path, offsets)
    if spill:
        save_row_groups(bucket_file(w, bucket, "copies"), copies_out)
    result = {
        "count": len(rows),
        "curation": {s: dict(c) for s, c in sorted(curation.items())},
        "mix": {g: dict(c) for g, c in sorted(mix.items())},
    }
    write_bytes_atomic(bucket_file(w, bucket, "done.json"), json.dumps(result).encode())
    return result


def merge_bucket(bucket: int, spec: JobSpec) -> dict:
    """A sorted bucket plus the repeated copies other buckets spilled to it, sorted again."""
    w = Path(spec.work)
    rows = read_all_rows(*bucket_rows(w, bucket, merged=False))
    for b in range(spec.num_buckets):
        rows.extend(load_row_group(bucket_file(w, b, "copies"), bucket))
    rows.sort()
    data, offsets = concat_rows(rows)
    rows_path, offs_path = bucket_rows(w, bucket, merged=True)
    write_bytes_atomic(rows_path, data)
    save_offsets(offs_path, offsets)
    result = {"count": len(rows)}
    write_bytes_atomic(bucket_file(w, bucket, "merged.json"), json.dumps(result).encode())
    return result


# ----------------------------------------------------------------------------- write


_PREFETCH_BYTES = 64 << 20  # media requested from the kernel ahead of the shard writer


def _fd_budget() -> int:
    """How many input files a shard writer keeps open: a shard draws from every input file (that
    is the shuffle), so a small cache reopens a file for almost every image. A quarter of the
    soft RLIMIT_NOFILE leaves the rest of the process its descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(4096, (soft if soft != resource.RLIM_INFINITY else 4096) // 4))


class _InputFiles:
    """Open fds of input files (at most `limit`, least recently used closed first), so each
    media range is copied by a single os.preadv: no reopening, seeking or Python file object
    per image."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or _fd_budget()
        self.fds: dict[str, int] = {}
        self.opened = 0  # files opened so far (a cache that thrashes shows here)

    def fd(self, path: str) -> int:
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
        os.posix_fadvise(self.fd(path), offset, size, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def write_shard_task(plan: ShardPlan, spec: JobSpec, out: str, merged: bool = False) -> dict:
    """Write one shard (or keep it if an earlier run already wrote it and its sha256 matches),
    and its part of the length index (the counts the scan put in the rows)."""
    work = spec.work
    w, o = Path(work), Path(out)
    name = sf.SHARD_NAME_TEMPLATE.format(plan.index)
    path, marker = o / name, shard_work_file(w, name, "json")
    part_path, index_path = shard_work_file(w, name, INDEX_PART), o / f"{name[: -len('.tar')]}{TAR_INDEX_SUFFIX}"
    lengths_path = shard_work_file(w, name, "lengths")
    if all(p.exists() for p in (marker, path, part_path, index_path, lengths_path)):
        done = json.loads(marker.read_text())
        if done.get("samples") == plan.num_samples and sha256_file(path) == done["sha256"]:
            return {**done, "resumed": True}
    rows = [
        decode_row(row)
        for sl in plan.slices
        for row in read_rows(*bucket_rows(w, sl.bucket, merged), sl.start, sl.stop)
    ]
    files = _InputFiles()

    def samples() -> Iterator[SampleMembers]:
        ahead, ahead_bytes, done_bytes = 0, 0, 0
        for i, (record_json, media, _) in enumerate(rows):
            while ahead < len(rows) and (ahead <= i or ahead_bytes - done_bytes < _PREFETCH_BYTES):
                for p, off, size, _ in rows[ahead][1]:
                    files.prefetch(p, off, size)
                    ahead_bytes += size
                ahead += 1
            members: list[tuple[str, bytes | FileRange]] = [(sf.JSON_MEMBER, record_json)]
            members += [(suffix, FileRange(p, off, size)) for p, off, size, suffix in media]
            done_bytes += sum(size for _, _, size, _ in media)
            yield SampleMembers(f"{plan.first_rank + i:010d}", members)

    try:
        result, layout = write_shard(path, samples(), files=files)
    finally:
        files.close()
    if result.samples != plan.num_samples:
        raise RuntimeError(f"{name}: wrote {result.samples} samples, planned {plan.num_samples}")
    # energon's .tar.idx, the shard's rows of energon's index and of the length index before the marker.
    write_tar_index(path, layout)
    write_index_part(part_path, layout)
    write_bytes_atomic(
        lengths_path, np.array([r[2] for r in rows], dtype=LENGTHS_DTYPE).reshape(-1, LENGTHS_COLUMNS).tobytes()
    )
    write_bytes_atomic(marker, json.dumps(asdict(result)).encode())
    return {**asdict(result), "resumed": False}
