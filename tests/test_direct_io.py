"""`direct_io.SequentialFile`: the same bytes and sha256 with and without O_DIRECT, whatever the
sizes and alignments; O_DIRECT really used where the file system takes it, buffered writes where
it refuses; the file-system choice read from mountinfo."""

from __future__ import annotations

import errno
import hashlib
import os
import random
from pathlib import Path

import pytest

from mmdata.shard_job import direct_io
from mmdata.shard_job.direct_io import ALIGN, BUFFER_BYTES, SequentialFile, direct_io_wanted, mount_fstype

pytestmark = pytest.mark.unit

LINUX_DIRECT = hasattr(os, "O_DIRECT")


def _opened_with_o_direct(fd: int) -> bool:
    """From the kernel's own record of the descriptor's flags (octal)."""
    flags = next(line for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines() if line.startswith("flags:"))
    return bool(int(flags.split()[1], 8) & os.O_DIRECT)


def _write(path: Path, pieces: list[bytes], direct: bool, flush_every: int = 3) -> tuple[str, bool]:
    with SequentialFile(path, direct) as f:
        opened_direct = f.direct and _opened_with_o_direct(f.fd) if LINUX_DIRECT else False
        for i, piece in enumerate(pieces):
            assert f.offset == sum(map(len, pieces[:i]))
            f.put(piece)
            if i % flush_every == 0:
                f.flush()
        f.finish()
        assert f.offset == sum(map(len, pieces))
        return f.sha.hexdigest(), opened_direct


SIZES = [
    0,
    1,
    511,
    ALIGN - 1,
    ALIGN,
    ALIGN + 1,
    3 * ALIGN + 7,
    BUFFER_BYTES - 1,
    BUFFER_BYTES,
    BUFFER_BYTES + 1,
    2 * BUFFER_BYTES + 123,
]


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", SIZES)
def test_same_bytes_and_sha_either_way(tmp_path: Path, direct: bool, size: int) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    cuts = sorted(rng.randrange(size + 1) for _ in range(5))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, size])]
    path = tmp_path / "f.bin"
    sha, _ = _write(path, pieces, direct)
    assert path.read_bytes() == data
    assert sha == hashlib.sha256(data).hexdigest()


@pytest.mark.skipif(not LINUX_DIRECT, reason="O_DIRECT is Linux's")
def test_o_direct_is_really_used_where_the_file_system_takes_it(tmp_path: Path) -> None:
    if mount_fstype(tmp_path) not in direct_io.DIRECT_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is on {mount_fstype(tmp_path)}, not a file system O_DIRECT is used on")
    data = random.Random(1).randbytes(5 * ALIGN + 99)  # an unaligned tail, written through the page cache
    _, opened_direct = _write(tmp_path / "f.bin", [data], direct=True)
    assert opened_direct
    _, opened_direct = _write(tmp_path / "g.bin", [data], direct=False)
    assert not opened_direct


@pytest.mark.skipif(not LINUX_DIRECT, reason="O_DIRECT is Linux's")
@pytest.mark.parametrize("refuses", ["open", "write"])
def test_a_file_system_refusing_o_direct_gets_buffered_writes(tmp_path: Path, monkeypatch, refuses: str) -> None:
    """Some file systems answer O_DIRECT with EINVAL at open, some devices at the first write
    (another alignment): the file is then written through the page cache, same bytes."""
    real_open, real_write = os.open, os.write

    def open_(path, flags, *args):
        if refuses == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def write(fd, data):
        if refuses == "write" and _opened_with_o_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "write", write)
    data = random.Random(2).randbytes(3 * BUFFER_BYTES + 5)
    path = tmp_path / "f.bin"
    sha, _ = _write(path, [data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)], direct=True)
    assert path.read_bytes() == data and sha == hashlib.sha256(data).hexdigest()


def test_two_files_open_at_once_in_one_thread(tmp_path: Path) -> None:
    """The staging buffer is per thread: a second file opened meanwhile gets its own."""
    a, b = random.Random(3).randbytes(3 * ALIGN + 1), random.Random(4).randbytes(2 * ALIGN + 3)
    with SequentialFile(tmp_path / "a", True) as fa, SequentialFile(tmp_path / "b", True) as fb:
        for i in range(0, max(len(a), len(b)), 1000):
            fa.put(a[i : i + 1000])
            fb.put(b[i : i + 1000])
            fa.flush()
        fa.finish()
        fb.finish()
    assert (tmp_path / "a").read_bytes() == a and (tmp_path / "b").read_bytes() == b


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:25 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw
31 22 0:40 / /data rw,relatime shared:3 - nfs4 server:/export rw,vers=4.2
32 31 8:17 / /data/local\\040disk rw,relatime shared:4 - xfs /dev/sdb1 rw
33 22 0:41 / /mnt/lus rw shared:5 - lustre 10.0.0.1@tcp:/fs rw
"""


@pytest.mark.parametrize(
    "path, fstype",
    [
        ("/", "ext4"),
        ("/home/user/out", "ext4"),
        ("/dev/shm/x", "tmpfs"),
        ("/data/shards", "nfs4"),
        ("/data/local disk/shards", "xfs"),
        ("/data/local diskette", "nfs4"),
        ("/mnt/lus/a/b", "lustre"),
    ],
)
def test_mount_fstype_takes_the_deepest_mount(path: str, fstype: str) -> None:
    assert mount_fstype(path, MOUNTINFO) == fstype


@pytest.mark.skipif(not LINUX_DIRECT, reason="O_DIRECT is Linux's")
def test_direct_io_wanted_follows_the_file_system_and_the_override(tmp_path: Path, monkeypatch) -> None:
    def wanted(env: str | None) -> bool:
        direct_io_wanted.cache_clear()
        if env is None:
            monkeypatch.delenv(direct_io.DIRECT_IO_ENV, raising=False)
        else:
            monkeypatch.setenv(direct_io.DIRECT_IO_ENV, env)
        try:
            return direct_io_wanted(str(tmp_path))
        finally:
            direct_io_wanted.cache_clear()

    assert wanted(None) == (mount_fstype(tmp_path) in direct_io.DIRECT_FILESYSTEMS)
    assert wanted("0") is False and wanted("off") is False
    assert wanted("1") is True and wanted("on") is True
    assert wanted("auto") == wanted(None) and wanted("") == wanted(None)
    with pytest.raises(ValueError, match=r"MMDATA_DIRECT_IO='sometimes': expected 0, 1 or auto"):
        wanted("sometimes")


@pytest.mark.parametrize("direct, drop_cache", [(False, True), (False, False), (True, True)])
def test_shards_drop_their_cached_pages_after_fsync(
    tmp_path: Path, monkeypatch, direct: bool, drop_cache: bool
) -> None:
    """With `drop_cache` (the shard writer's default) a finished file is fsynced, then DONTNEED
    drops its now clean pages, the whole file: all of a buffered file, an O_DIRECT file's tail."""
    if direct and not (LINUX_DIRECT and mount_fstype(tmp_path) in direct_io.DIRECT_FILESYSTEMS):
        pytest.skip("needs a file system that takes O_DIRECT")
    calls: list[tuple[int, int, int]] = []
    real_fsync, real_fadvise = os.fsync, getattr(os, "posix_fadvise", None)
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    if real_fadvise is None:
        pytest.skip("no posix_fadvise here")

    def fadvise(fd, offset, length, advice):
        assert synced == [fd], "advice before the fsync: dirty pages are not dropped"
        calls.append((offset, length, advice))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    data = random.Random(5).randbytes(3 * ALIGN + 17)
    with SequentialFile(tmp_path / "f.bin", direct, drop_cache=drop_cache) as f:
        f.put(data)
        f.finish()
    assert (tmp_path / "f.bin").read_bytes() == data
    assert calls == ([(0, 0, os.POSIX_FADV_DONTNEED)] if drop_cache else [])


def test_a_bad_switch_stops_the_job_before_it_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    from mmdata.cli import main

    monkeypatch.setenv(direct_io.DIRECT_IO_ENV, "fast")
    (tmp_path / "in").mkdir()
    rc = main(
        [
            "preprocess",
            "--dataset",
            "infinity-mm",
            "--input",
            str(tmp_path / "in"),
            "--output",
            str(tmp_path / "out"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "MMDATA_DIRECT_IO='fast': expected 0, 1 or auto" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
