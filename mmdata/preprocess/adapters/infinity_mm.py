"""Infinity-MM layout: `stageN/<subset>/*.tar`, each sample a `{stem}.json` plus its
image member(s) (`{stem}.jpg|png|webp`, extra images `{stem}.1.png` ...). The record's `image`
field is provenance, not a member name: media_resolution.py maps it onto the members. Only tar
headers are read here; media bytes are addressed by offset and read by the validator / shard
writer."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

from mmdata.preprocess.adapters.base import InputUnit, MediaRef, MediaResolver, RawRecord, walk_files
from mmdata.preprocess.adapters.media_resolution import basename, member_order
from mmdata.shard_job.tar_scan import TarMember, list_tar

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_EXTS = (".mp4", ".mkv", ".webm", ".mov", ".avi")


def list_units(inputs: list[Path]) -> list[InputUnit]:
    units: list[InputUnit] = []
    seen: set[str] = set()
    for root in inputs:
        root = root.resolve()
        for p in walk_files(root, (".tar",)):
            if str(p) in seen:
                continue
            seen.add(str(p))
            rel = p.name if root.is_file() else str(p.relative_to(root))
            st = p.stat()
            units.append(InputUnit(len(units), str(p), rel, st.st_size, st.st_mtime_ns))
    return units


class _TarMembers(MediaResolver):
    """Members of one tar by name; their bytes are read through one open file (opening the tar
    per image cost as much as listing it)."""

    def __init__(self, path: str, members: dict[str, TarMember]):
        self.path, self.members = path, members
        self._file: io.FileIO | None = None
        self._by_basename: dict[str, TarMember | None] | None = None  # built on first use

    def read(self, media: MediaRef) -> bytes:
        if media.path != self.path:
            return media.read()
        return self.pread(media.offset, media.size)

    def pread(self, offset: int, size: int) -> bytes:
        if self._file is None or self._file.closed:
            self._file = open(self.path, "rb", buffering=0)
        return os.pread(self._file.fileno(), size, offset)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _ref(self, info: TarMember | None) -> MediaRef | None:
        return None if info is None else MediaRef(self.path, info.offset_data, info.size, info.name)

    def by_name(self, ref: str) -> MediaRef | None:
        return self._ref(self.members.get(ref))

    def by_basename(self, ref: str) -> MediaRef | None:
        """The member with `ref`'s basename, when exactly one member of this tar has it."""
        if self._by_basename is None:
            self._by_basename = {}
            for name, info in self.members.items():
                base = basename(name)
                self._by_basename[base] = None if base in self._by_basename else info
        return self._ref(self._by_basename.get(basename(ref)))


def _key_of(name: str) -> tuple[str, str]:
    """webdataset convention: key = path up to the first dot of the basename."""
    folder, _, base = name.rpartition("/")
    stem, _, suffix = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), suffix.lower()


def iter_records(unit: InputUnit) -> Iterator[RawRecord]:
    """Yield one RawRecord per `.json` member (and one per orphan image group without JSON).

    A tar cut short still yields every sample before the damage; the unreadable rest becomes
    one `input_truncated` record.
    """
    infos, tail_error = list_tar(unit.path)
    members = {m.name: m for m in infos}  # a repeated name resolves to its last copy, as in tarfile
    resolver = _TarMembers(unit.path, members)
    groups: dict[str, list[tuple[TarMember, str]]] = {}
    for m in infos:
        key, suffix = _key_of(m.name)
        groups.setdefault(key, []).append((m, suffix))
    json_of = {key: next((m.name for m, suffix in group if suffix == "json"), None) for key, group in groups.items()}
    json_bytes_of = _read_members(resolver, [members[name] for name in json_of.values() if name is not None])
    try:
        for index, (key, group) in enumerate(groups.items()):
            images, videos = [], []
            for m, suffix in group:  # (suffix: lower case, after the basename's first dot)
                dotted = f".{suffix}"
                if dotted.endswith(IMAGE_EXTS):
                    images.append(m.name)
                elif dotted.endswith(VIDEO_EXTS):
                    videos.append(m.name)
            images, videos = member_order(images), member_order(videos)
            prov = {"dataset": "infinity-mm", "file": unit.rel, "member": key, "index": index}
            if rejected := _hostile_group(unit, key, group, prov, resolver):
                yield from rejected
                continue
            name = json_of[key]
            if name is None:
                yield RawRecord(
                    f"{unit.rel}:{key}",
                    f"{unit.path}:{key}",
                    None,
                    prov,
                    resolver,
                    error="json_missing",
                    error_detail=f"members {[m.name for m, _ in group]} have no .json",
                    own_images=images,
                    own_videos=videos,
                )
                continue
            prov["member"] = name
            data = json_bytes_of[name]
            yield RawRecord(
                f"{unit.rel}:{name}",
                f"{unit.path}:{name}",
                data,
                prov,
                resolver,
                error=None if data is not None else "input_truncated",
                error_detail="" if data is not None else f"{name}: data cut short",
                own_images=images,
                own_videos=videos,
            )
        if tail_error:
            prov = {"dataset": "infinity-mm", "file": unit.rel, "member": "<rest of file>", "index": len(groups)}
            yield RawRecord(
                f"{unit.rel}:<rest>",
                f"{unit.path}:<after member {len(infos)}>",
                None,
                prov,
                resolver,
                error="input_truncated",
                error_detail=tail_error,
            )
    finally:
        resolver.close()


def _unsafe(name: str) -> bool:
    """An absolute name or one with a `..` part: it would escape a folder it were extracted to."""
    if "/" not in name and "\\" not in name:  # (the usual `{stem}.json`: one part)
        return name == ".."
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts


def _hostile_group(
    unit: InputUnit, key: str, group: list[tuple[TarMember, str]], prov: dict, resolver: "_TarMembers"
) -> list[RawRecord]:
    """Records for a sample that cannot be taken at face value (none when it can): members whose
    names escape the archive's folder, or a key with several JSON members (which JSON goes with
    which image is unknowable). One record per JSON member, so the counts still match the input."""
    names = [m.name for m, _ in group]
    jsons = [m.name for m, suffix in group if suffix == "json"] or [key]
    if any(_unsafe(n) for n in names):
        error, detail = "unsafe_member_name", f"member names {names} leave the archive's folder (absolute or `..`)"
    elif len(jsons) > 1:
        error, detail = "duplicate_key", f"sample key {key!r} has {len(jsons)} JSON members ({jsons}); ambiguous"
    else:
        return []
    return [
        RawRecord(
            f"{unit.rel}:{key}#{k}",
            f"{unit.path}:{n}",
            None,
            {**prov, "member": n},
            resolver,
            error=error,
            error_detail=detail,
        )
        for k, n in enumerate(jsons)
    ]


def _read_members(tar: _TarMembers, members: list[TarMember]) -> dict[str, bytes | None]:
    """Data of small members by name (JSON), None for data the file cuts short."""
    out: dict[str, bytes | None] = {}
    for m in members:
        try:
            data = tar.pread(m.offset_data, m.size)
            out[m.name] = data if len(data) == m.size else None
        except OSError:
            out[m.name] = None
    return out
