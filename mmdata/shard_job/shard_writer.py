"""Write one WebDataset shard deterministically: members of a sample contiguous and sorted
by name, fixed tar metadata, original media bytes, written to a temp file and renamed into
place (a crash never leaves a half shard under the final name), sha256 computed while writing.

The ustar headers are built by hand (fixed fields precomputed, only name/size/checksum vary):
`tarfile` costs tens of microseconds of Python per member. The bytes are exactly those that
`tarfile.open(mode="w", format=tarfile.USTAR_FORMAT)` writes for the same members (tested).
They go out through `direct_io.SequentialFile` (O_DIRECT where the file system suits it: the
shards are not read back by the job, so copying them into the page cache is wasted work).
The writer also records the shard's layout (sample and member offsets), from which energon's
index is written without reading the shard back."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from mmdata import shard_format as sf
from mmdata.shard_job.direct_io import SequentialFile, direct_io_wanted
from mmdata.shard_job.energon_meta import ShardLayout

BLOCK = 512
RECORD = 20 * BLOCK  # tarfile pads the archive to a multiple of this (like `tar -b20`)
NAME_LEN = 100
_MAX_SIZE = 8**11  # ustar's 11 octal digits
_FLUSH = 4 << 20  # write and hash in chunks of about this size

# Header layout (POSIX ustar): name[100] mode[8] uid[8] gid[8] size[12] mtime[12] chksum[8]
# typeflag[1] linkname[100] magic "ustar\0" version "00" uname[32] gname[32] devmajor[8]
# devminor[8] prefix[155] pad[12]. tarfile leaves devmajor/devminor all-NUL for regular files.
_MID = b"%07o\0%07o\0%07o\0" % (sf.TAR_MODE & 0o7777, sf.TAR_UID, sf.TAR_GID)  # mode uid gid
_MTIME = b"%011o\0" % sf.TAR_MTIME
_TAIL = (
    b"0"
    + bytes(100)
    + b"ustar\x0000"
    + sf.TAR_UNAME.encode().ljust(32, b"\0")
    + sf.TAR_GNAME.encode().ljust(32, b"\0")
    + bytes(8 + 8 + 155 + 12)
)
assert len(_MID) + len(_MTIME) + len(_TAIL) == BLOCK - NAME_LEN - 12 - 8
_CONST_SUM = sum(_MID) + sum(_MTIME) + sum(_TAIL) + 8 * ord(" ")  # checksum counts chksum as spaces
_ZEROS = bytes(BLOCK)


@dataclass
class ShardResult:
    name: str
    samples: int
    bytes: int
    sha256: str


class FileRange(NamedTuple):
    """A member's data as bytes [offset, offset + size) of an input file: the writer copies
    them straight from the file into its staging buffer (`SequentialFile.put_range`)."""

    path: str
    offset: int
    size: int


class OpenFiles(Protocol):
    def fd(self, path: str) -> int:
        """An open, readable descriptor of `path`, valid until the next call."""


@dataclass
class SampleMembers:
    key: str
    members: list[tuple[str, bytes | FileRange]]  # (suffix, data), e.g. ("img00.jpg", b"...")


def tar_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header tarfile writes for a regular file with the fixed metadata."""
    nb = name.encode("utf-8", "surrogateescape")
    if len(nb) > NAME_LEN:
        raise ValueError(f"tar member name longer than {NAME_LEN} bytes: {name!r}")
    if not 0 <= size < _MAX_SIZE:
        raise ValueError(f"tar member {name!r}: size {size} does not fit a ustar header")
    size_f = b"%011o\0" % size
    chksum = _CONST_SUM + sum(nb) + sum(size_f)
    return b"".join((nb, bytes(NAME_LEN - len(nb)), _MID, size_f, _MTIME, b"%06o\0 " % chksum, _TAIL))


def write_shard(
    path: Path, samples: Iterable[SampleMembers], direct: bool | None = None, files: OpenFiles | None = None
) -> tuple[ShardResult, ShardLayout]:
    """Write the shard atomically. `direct`: O_DIRECT or not (None: as `direct_io_wanted` says
    for the shard's folder); the bytes are the same either way. `files` opens the input files
    of FileRange members (needed when there are any); a range the file no longer holds whole
    is an IOError naming the file (the input changed since the scan)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if direct is None:
        direct = direct_io_wanted(str(path.parent))
    try:
        *result, layout = _write(tmp, samples, direct, files)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return ShardResult(path.name, *result), layout


def _write(
    tmp: Path, samples: Iterable[SampleMembers], direct: bool, files: OpenFiles | None
) -> tuple[int, int, str, ShardLayout]:
    n = 0
    layout = ShardLayout([], [], 0)
    with SequentialFile(tmp, direct) as f:
        for sample in samples:
            if "." in sample.key or "/" in sample.key:
                raise ValueError(f"invalid sample key {sample.key!r}")
            if sample.members:  # (a sample without members leaves no trace in the tar)
                layout.samples.append((sample.key, f.offset))
            for suffix, data in sorted(sample.members):
                is_range = isinstance(data, FileRange)
                size = data.size if is_range else len(data)
                f.put(tar_header(f"{sample.key}.{suffix}", size))
                layout.parts.append((len(layout.samples) - 1, suffix, f.offset, size))
                if is_range:
                    if files is None:
                        raise ValueError(f"member {sample.key}.{suffix} is a file range, and no files were given")
                    got = f.put_range(files.fd(data.path), data.offset, size)
                    if got != size:
                        raise IOError(
                            f"{data.path}: expected {size} bytes at offset {data.offset}, got {got} (input changed?)"
                        )
                else:
                    f.put(data)
                f.put(_ZEROS[: -size % BLOCK])
            n += 1
            if f.staged >= _FLUSH:
                f.flush()
        # End of archive: two zero blocks, then zero-fill to a whole record, as tarfile does.
        layout.end = f.offset
        f.put(bytes(2 * BLOCK + -(layout.end + 2 * BLOCK) % RECORD))
        f.finish()
        return n, f.offset, f.sha.hexdigest(), layout


def shard_work_file(work: str | Path, shard_name: str, suffix: str) -> Path:
    """One of a written shard's work files: json (its done-marker), index.sqlite (its rows of
    energon's index), lengths."""
    return Path(work) / "shards" / f"{shard_name}.{suffix}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
