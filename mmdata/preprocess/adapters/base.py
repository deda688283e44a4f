"""What every dataset adapter produces: input units (one file each, the unit of parallel
scanning) and raw records that point at their media by (file, offset, size) instead of
carrying the bytes, so the index stays compact and shard writers can fetch bytes later."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple


@dataclass(frozen=True)
class InputUnit:
    """One input file; `rel` is its stable name (relative to the input root it came from)."""

    index: int
    path: str
    rel: str
    size: int
    mtime_ns: int
    image_root: str | None = None  # llava-json only


class MediaRef(NamedTuple):
    """Bytes [offset, offset+size) of `path` (a tar member's data or a whole image file).
    (A NamedTuple: one or more is made per record on the scan's hot path, where a frozen
    dataclass cost a microsecond each.)"""

    path: str
    offset: int
    size: int
    name: str  # member/file name, for messages and extension guessing

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)


@dataclass
class RawRecord:
    """One input record before validation."""

    rid: str  # stable identity, e.g. "stage1/x/000000.tar:00000001.json" (hashed for the shuffle)
    location: str  # human-readable source location for quarantine messages
    json_bytes: bytes | None  # None when the record has no JSON at all
    provenance: dict
    # Finds media by name for the record's `image` / `video` entries (media_resolution.py).
    locator: "MediaResolver"
    error: str | None = None  # an adapter-level problem (e.g. "json_missing")
    error_detail: str = ""
    # The sample's own media members (webdataset: same key), in member order.
    own_images: list[str] = field(default_factory=list)
    own_videos: list[str] = field(default_factory=list)


class MediaResolver:
    """Finds an input's media by name: the first two rules of media_resolution.resolve."""

    def by_name(self, ref: str) -> MediaRef | None:  # pragma: no cover - interface
        """The media named exactly `ref` (a tar member, a file under the image root)."""
        raise NotImplementedError

    def by_basename(self, ref: str) -> MediaRef | None:
        """Media anywhere in the input with `ref`'s basename (None where that means nothing)."""
        return None

    def outside(self, ref: str) -> str | None:
        """Where `ref` would lead when that is outside the input (never read); else None."""
        return None

    def read(self, media: MediaRef) -> bytes:
        """The media's bytes (adapters may keep their input file open across records)."""
        return media.read()

    def close(self) -> None:
        """Close what `read` keeps open (a later `read` opens it again)."""


def walk_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under `root` (or `root` itself) with one of `suffixes`, sorted for determinism."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"input not found: {root}")
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.lower().endswith(suffixes))
