"""Write one WebDataset shard deterministically: members of a sample contiguous and sorted
by name, fixed tar metadata, original media bytes, written to a temp file and renamed into
place (a crash never leaves a half shard under the final name), sha256 computed while writing."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mmdata import shard_format as sf


class _HashingFile(io.RawIOBase):
    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.n

    def write(self, b) -> int:
        self.sha.update(b)
        self.n += len(b)
        return self.f.write(b)


@dataclass
class ShardResult:
    name: str
    samples: int
    bytes: int
    sha256: str


@dataclass
class SampleMembers:
    key: str
    members: list[tuple[str, bytes]]  # (suffix, data), e.g. ("img00.jpg", b"...")


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, sf.TAR_MTIME, sf.TAR_MODE
    info.uid, info.gid, info.uname, info.gname = sf.TAR_UID, sf.TAR_GID, sf.TAR_UNAME, sf.TAR_GNAME
    return info


def write_shard(path: Path, samples: Iterable[SampleMembers]) -> ShardResult:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        result = _write(tmp, samples)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return ShardResult(path.name, *result)


def _write(tmp: Path, samples: Iterable[SampleMembers]) -> tuple[int, int, str]:
    n = 0
    with open(tmp, "wb") as raw:
        hf = _HashingFile(raw)
        with tarfile.open(fileobj=hf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for sample in samples:
                if "." in sample.key or "/" in sample.key:
                    raise ValueError(f"invalid sample key {sample.key!r}")
                for suffix, data in sorted(sample.members):
                    tar.addfile(_tarinfo(f"{sample.key}.{suffix}", len(data)), io.BytesIO(data))
                n += 1
        raw.flush()
        os.fsync(raw.fileno())
        return n, hf.n, hf.sha.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
