"""The job's intermediate files under `DIR/.mmdata-work/`: compact index rows (one per record,
never the media) and fixed-size numpy records, spilled grouped (by sort bucket, dedup
partition, ...) so a later task reads just its group. Everything is written atomically
(temporary name, then rename), so a retried or resumed task never sees half a file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from itertools import accumulate
from pathlib import Path

import numpy as np

# ----------------------------------------------------------------------------- files


def work_path(work: str | Path, folder: str, name: str) -> Path:
    return Path(work) / folder / name


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# Offsets files are raw little-endian int64 arrays: a task reads a slice of two of them for every
# (group, input file) pair, and np.fromfile on raw data costs a fraction of np.load's header
# parsing and mmap.
_I64 = np.dtype("<i8")


def save_offsets(path: Path, offsets: list[int] | np.ndarray) -> None:
    write_bytes_atomic(path, np.asarray(offsets, dtype=_I64).tobytes())


def load_offsets(path: Path, start: int, count: int) -> list[int]:
    """Entries [start, start + count) of an offsets file."""
    got = np.fromfile(path, dtype=_I64, count=count, offset=start * _I64.itemsize)
    if len(got) != count:
        raise IOError(f"{path}: {len(got)} of {count} offsets at entry {start} (work folder damaged?)")
    return got.tolist()


def concat_rows(rows: list[bytes]) -> tuple[bytes, list[int]]:
    """Rows back to back (no separators: rows are binary) and their boundaries."""
    return b"".join(rows), [0, *accumulate(map(len, rows))]


def read_rows(rows_path: Path, offsets_path: Path, start: int, stop: int) -> list[bytes]:
    """Rows [start, stop) of a row file whose row boundaries are in an offsets file."""
    if stop <= start:
        return []
    offs = load_offsets(offsets_path, start, stop - start + 1)
    lo = offs[0]
    with open(rows_path, "rb") as f:
        f.seek(lo)
        data = f.read(offs[-1] - lo)
    return [data[a - lo : b - lo] for a, b in zip(offs, offs[1:])]


def read_all_rows(rows_path: Path, offsets_path: Path) -> list[bytes]:
    offs = np.fromfile(offsets_path, dtype=_I64).tolist()
    data = rows_path.read_bytes()
    return [data[a:b] for a, b in zip(offs, offs[1:])]


def save_row_groups(prefix: Path, groups: list[list[bytes]]) -> None:
    """Rows grouped (e.g. by sort bucket): `<prefix>.rows`, `.rowoffs.i64` (row boundaries)
    and `.groups.i64` (first row of each group, then the total)."""
    data, row_offsets = concat_rows([r for rows in groups for r in rows])
    group_offsets = [0, *accumulate(map(len, groups))]
    write_bytes_atomic(prefix.with_name(prefix.name + ".rows"), data)
    save_offsets(prefix.with_name(prefix.name + ".rowoffs.i64"), row_offsets)
    save_offsets(prefix.with_name(prefix.name + ".groups.i64"), group_offsets)


def load_row_group(prefix: Path, group: int) -> list[bytes]:
    lo, hi = load_offsets(prefix.with_name(prefix.name + ".groups.i64"), group, 2)
    return read_rows(prefix.with_name(prefix.name + ".rows"), prefix.with_name(prefix.name + ".rowoffs.i64"), lo, hi)


def save_grouped(path: Path, records: np.ndarray, group: np.ndarray, num_groups: int) -> None:
    """Fixed-size records ordered by `group` (stable), with `<path>.groups.i64` offsets."""
    order = np.argsort(group, kind="stable")
    write_bytes_atomic(path, records[order].tobytes())
    save_offsets(
        path.with_name(path.name + ".groups.i64"), np.r_[0, np.cumsum(np.bincount(group, minlength=num_groups))]
    )


def load_grouped(path: Path, dtype: np.dtype, group: int) -> np.ndarray:
    lo, hi = load_offsets(path.with_name(path.name + ".groups.i64"), group, 2)
    return np.fromfile(path, dtype=dtype, count=hi - lo, offset=lo * dtype.itemsize)


# ----------------------------------------------------------------------------- index rows
ROW_FORMAT = 8  # bump when the encoding or the record content changes: unfinished jobs then rescan
# A row is the 8-byte big-endian shuffle key, then NUL-separated UTF-8 fields:
#     rid \0 handle \0 source \0 subset \0 tokens \0 record_json (\0 path \0 offset \0 size \0 suffix)*
# handle is "unit:ordinal" (the record's input file and its place among the file's kept
# records: what dedup marks refer to); tokens is "text:media:tiles", the record's length-index counts
# (made by the scan, which holds the parsed record, so the writer never parses it again);
# numbers are decimal. The record JSON is stored as is (no
# second escaping, no json.loads in the writer). The key is fixed width and NUL sorts below
# every other byte, so sorting raw rows sorts by (key, rid) and the output order stays a
# function of (inputs, seed). No field can hold a NUL: JSON writers escape control characters,
# OS paths and tar member names cannot contain one, and the validator replaces it in `source`.


def encode_row(
    key: int,
    rid: str,
    handle: tuple[int, int],
    source: str,
    subset: str,
    record_json: str,
    media: Iterable[tuple[str, int, int, str]],
    tokens: tuple[int, ...] = (0, 0, 0),
) -> bytes:
    if "\0" in rid:
        raise ValueError(f"record id contains NUL: {rid!r}")
    head = f"{rid}\0{handle[0]}:{handle[1]}\0{source}\0{subset}\0{':'.join(str(int(n)) for n in tokens)}\0"
    # Names may hold undecodable bytes (surrogate escapes, as os.fsencode); the JSON must be UTF-8.
    refs = "".join(f"\0{path}\0{offset}\0{size}\0{suffix}" for path, offset, size, suffix in media)
    return b"".join(
        (
            key.to_bytes(8, "big"),
            head.encode("utf-8", "surrogateescape"),
            record_json.encode(),
            refs.encode("utf-8", "surrogateescape"),
        )
    )


def row_head(row: bytes) -> tuple[str, tuple[int, int], str, str]:
    """(rid, handle, source, subset) of an encoded row."""
    rid, handle, source, subset, _ = row[8:].split(b"\0", 4)  # (the rest: tokens, record, media)
    unit, _, ordinal = handle.partition(b":")
    return (
        rid.decode("utf-8", "surrogateescape"),
        (int(unit), int(ordinal)),
        source.decode("utf-8", "surrogateescape"),
        subset.decode("utf-8", "surrogateescape"),
    )


def decode_row(row: bytes) -> tuple[bytes, list[tuple[str, int, int, str]], tuple[int, ...]]:
    """(record JSON bytes, [(path, offset, size, suffix)], (text tokens, media tokens, vision tiles))."""
    f = row[8:].split(b"\0")
    m = [x.decode("utf-8", "surrogateescape") for x in f[6:]]
    return (
        f[5],
        [(p, int(o), int(n), s) for p, o, n, s in zip(m[0::4], m[1::4], m[2::4], m[3::4])],
        tuple(int(x) for x in f[4].split(b":")),
    )


def rekey_row(row: bytes, key: int, rid: str) -> bytes:
    """The same record under another shuffle key and identity (a repeated copy)."""
    return key.to_bytes(8, "big") + rid.encode("utf-8", "surrogateescape") + row[8:][row[8:].index(b"\0") :]
