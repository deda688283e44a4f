"""What every dataset adapter produces: input units (one file each, the unit of parallel
scanning) and raw records that point at their media by (file, offset, size) instead of
carrying the bytes, so the index stays compact and shard writers can fetch bytes later."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class InputUnit:
    """One input file; `rel` is its stable name (relative to the input root it came from)."""

    index: int
    path: str
    rel: str
    size: int
    mtime_ns: int
    image_root: str | None = None  # llava-json only


@dataclass(frozen=True)
class MediaRef:
    """Bytes [offset, offset+size) of `path` (a tar member's data or a whole image file)."""

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
    # Media resolution: name as written in the record -> MediaRef, or None when missing.
    resolve_media: "MediaResolver"
    error: str | None = None  # an adapter-level problem (e.g. "json_missing")
    error_detail: str = ""
    default_media: list[str] = field(default_factory=list)  # media found by naming convention


class MediaResolver:
    """Maps an image reference from a record to a MediaRef (or None if absent)."""

    def __call__(self, ref: str) -> MediaRef | None:  # pragma: no cover - interface
        raise NotImplementedError

    def read(self, media: MediaRef) -> bytes:
        """The media's bytes (adapters may keep their input file open across records)."""
        return media.read()


def walk_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under `root` (or `root` itself) with one of `suffixes`, sorted for determinism."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"input not found: {root}")
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.lower().endswith(suffixes))
