"""Write a new file front to back, hashing it on the way, with O_DIRECT where that helps.

Why: a job writes every input byte once more as shards that it never reads back. Through the
page cache each of those bytes is copied into a freshly allocated cache page; measured on the
2-core VMs this project is tested on, that copy was about 40 % of the shard writer's CPU (about
240 MB/s: every new page is a hypervisor fault), and it evicts the input pages the shard
writers are about to read. With O_DIRECT the device reads the bytes from one reused, aligned
buffer: no copy, no new pages. The unaligned tail of a file is written through the page cache.

O_DIRECT is used on local block-device file systems and the parallel ones built for it
(DIRECT_FILESYSTEMS); on NFS (where each direct write is a synchronous round trip), tmpfs,
overlay and anything unknown the file is written through the page cache, and once it is fsynced
`posix_fadvise(DONTNEED)` drops its (clean) pages, so the shards do not evict the inputs either.
Measured with benchmarks/bench_private_internals.py (docs/preprocess.md, "Private library
internals"): on ext4, at the volume of the preprocessing benchmark's largest size (2.7 GiB of
shards), O_DIRECT wrote 1.25-1.4x faster than buffered writes + DONTNEED, with 1.26x less of the
writer's CPU, so it stays the default where the file system suits it.

One switch, `MMDATA_DIRECT_IO`: unset or `auto` as above, `1` O_DIRECT wherever it is accepted,
`0` buffered writes + DONTNEED everywhere; any other value is refused by name. A file system that
refuses O_DIRECT (EINVAL) gets buffered writes either way. The bytes written are the same
whichever way they go.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import re
import threading
from functools import lru_cache
from pathlib import Path

DIRECT_IO_ENV = "MMDATA_DIRECT_IO"
DIRECT_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "lustre", "gpfs"})
ALIGN = 4096  # O_DIRECT needs buffer, offset and length aligned to the device's logical block size (<= 4 KiB)
BUFFER_BYTES = 8 << 20  # the staging buffer; whole aligned chunks of it go out at each flush
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_FADVISE = hasattr(os, "posix_fadvise")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
_buffers = threading.local()  # one staging buffer per thread, reused across files: its pages fault in once


def mount_fstype(path: str | Path, mountinfo: str | None = None) -> str | None:
    """The file system type of the mount holding `path` (Linux's /proc/self/mountinfo; None
    elsewhere). `mountinfo` is that file's text (for tests)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text(errors="surrogateescape")
        except OSError:
            return None
    target = os.path.realpath(path)
    best, fstype = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        mount_point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[4])  # a space is \040, ...
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best and sep + 1 < len(fields):
            best, fstype = len(mount_point), fields[sep + 1]
    return fstype


@lru_cache(maxsize=64)
def direct_io_wanted(folder: str) -> bool:
    """Whether files written into `folder` should try O_DIRECT (see the module docstring)."""
    if not _O_DIRECT:
        return False
    override = direct_io_override()
    if override is not None:
        return override
    return mount_fstype(folder) in DIRECT_FILESYSTEMS


def direct_io_override() -> bool | None:
    """`MMDATA_DIRECT_IO` as a choice: True (1/on/true/yes), False (0/off/false/no), None (unset,
    empty or auto: by file system). ValueError naming the variable for anything else."""
    raw = os.environ.get(DIRECT_IO_ENV, "")
    value = raw.strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("", "auto"):
        return None
    raise ValueError(f"{DIRECT_IO_ENV}={raw!r}: expected 0, 1 or auto")


def _take_buffer() -> mmap.mmap:
    """This thread's staging buffer (anonymous, so page-aligned), or a new one while it is taken."""
    buf = getattr(_buffers, "free", None)
    if buf is None:
        return mmap.mmap(-1, BUFFER_BYTES)
    _buffers.free = None
    return buf


def _give_back(buf: mmap.mmap) -> None:
    _buffers.free = buf


class SequentialFile:
    """A new file written front to back through a staging buffer, its sha256 taken as it goes.
    `offset` is where the next byte lands. Use as a context manager; `finish()` writes what is
    left and fsyncs (a file left without `finish()` is incomplete: the caller removes it), then,
    with `drop_cache`, tells the kernel the file's (now clean) cached pages are not needed."""

    def __init__(self, path: str | Path, direct: bool, drop_cache: bool = True):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = bool(direct and _O_DIRECT)
        self.drop_cache = drop_cache
        self.fd = -1
        if self.direct:
            try:
                self.fd = os.open(path, flags | _O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)
        self.sha = hashlib.sha256()
        self._buf = _take_buffer()
        self._view = memoryview(self._buf)
        self._fill = 0  # bytes staged
        self._written = 0  # bytes in the file

    @property
    def offset(self) -> int:
        return self._written + self._fill

    @property
    def staged(self) -> int:
        return self._fill

    def put(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if self._fill + n <= BUFFER_BYTES:
            self._buf[self._fill : self._fill + n] = data
            self._fill += n
            return
        view, i = memoryview(data), 0
        while i < n:
            k = min(n - i, BUFFER_BYTES - self._fill)
            self._buf[self._fill : self._fill + k] = view[i : i + k]
            self._fill += k
            i += k
            if self._fill == BUFFER_BYTES:
                self.flush()

    def put_range(self, fd: int, offset: int, size: int) -> int:
        """Append bytes [offset, offset + size) of the open file `fd`, read straight into the
        staging buffer: no bytes object per range and no second copy (the write stage copies
        every media byte of a shard; the intermediate object cost about a third of that).
        Returns how many bytes there were (fewer than `size` only where the file ends early)."""
        done = 0
        while done < size:
            if self._fill == BUFFER_BYTES:
                self.flush()
            k = min(size - done, BUFFER_BYTES - self._fill)
            got = os.preadv(fd, [self._view[self._fill : self._fill + k]], offset + done)
            if got <= 0:
                break
            self._fill += got
            done += got
        return done

    def flush(self) -> None:
        """Write out the staged bytes: all of them, or with O_DIRECT the whole aligned chunks
        (the rest, under 4 KiB, moves to the front of the buffer)."""
        n = self._fill - self._fill % ALIGN if self.direct else self._fill
        if n:
            self._write(self._view[:n])
            rest = self._fill - n
            if rest:
                self._buf[:rest] = self._buf[n : self._fill]
            self._fill = rest

    def finish(self) -> None:
        self.flush()
        if self._fill:  # an O_DIRECT file's unaligned tail: through the page cache
            self._buffered()
            self._write(self._view[: self._fill])
            self._fill = 0
        os.fsync(self.fd)
        if self.drop_cache and _FADVISE:  # the pages are clean now: let the kernel drop them at once
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _write(self, chunk: memoryview) -> None:
        self.sha.update(chunk)
        done = 0
        while done < len(chunk):
            try:
                done += os.write(self.fd, chunk[done:])
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._buffered()  # the device wanted another alignment: finish without O_DIRECT
        self._written += len(chunk)

    def _buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_O_DIRECT)
            self.direct = False

    def close(self) -> None:
        if self.fd >= 0:
            self._view.release()
            _give_back(self._buf)
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SequentialFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
