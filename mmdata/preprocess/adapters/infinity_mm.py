"""Infinity-MM layout: `stageN/<subset>/*.tar`, each sample a `{stem}.json` plus its
image member(s) (`{stem}.jpg|png|webp`, extra images `{stem}.1.png` ...). Only tar headers are
read here; image bytes are addressed by offset and read by the validator / shard writer."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

from mmdata.preprocess.adapters.base import InputUnit, MediaRef, MediaResolver, RawRecord, walk_files

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")


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
    def __init__(self, path: str, members: dict[str, tarfile.TarInfo]):
        self.path, self.members = path, members

    def __call__(self, ref: str) -> MediaRef | None:
        name = ref.replace("\\", "/").rsplit("/", 1)[-1]
        info = self.members.get(ref) or self.members.get(name)
        if info is None:
            return None
        return MediaRef(self.path, info.offset_data, info.size, info.name)


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
    infos: list[tarfile.TarInfo] = []
    json_bytes_of: dict[str, bytes | None] = {}
    tail_error = ""
    with tarfile.open(unit.path, "r:") as tar:
        try:
            for m in tar:
                if m.isfile():
                    infos.append(m)
        except (tarfile.TarError, EOFError, OSError) as e:
            tail_error = f"tar listing stopped after {len(infos)} members: {type(e).__name__}: {e}"
        # tarfile silently ends the listing at a truncated header; detect a cut-short file here.
        size = os.path.getsize(unit.path)
        if not tail_error and infos and infos[-1].offset_data + infos[-1].size > size:
            tail_error = f"file ends inside member {infos[-1].name!r}: truncated tar ({size} bytes)"
        for m in infos:
            if m.name.lower().endswith(".json"):
                try:
                    f = tar.extractfile(m)
                    json_bytes_of[m.name] = f.read() if f else b""
                except (tarfile.TarError, EOFError, OSError):
                    json_bytes_of[m.name] = None
    members = {m.name: m for m in infos}
    resolver = _TarMembers(unit.path, members)
    groups: dict[str, list[tarfile.TarInfo]] = {}
    order: list[str] = []
    for m in infos:
        key, _ = _key_of(m.name)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(m)
    for index, key in enumerate(order):
        group = groups[key]
        jsons = [m for m in group if _key_of(m.name)[1] == "json"]
        images = [m.name for m in group if m.name.lower().endswith(IMAGE_EXTS)]
        prov = {"dataset": "infinity-mm", "file": unit.rel, "member": key, "index": index}
        if not jsons:
            yield RawRecord(f"{unit.rel}:{key}", f"{unit.path}:{key}", None, prov, resolver,
                            error="json_missing", error_detail=f"members {[m.name for m in group]} have no .json",
                            default_media=images)
            continue
        jm = jsons[0]
        prov["member"] = jm.name
        data = json_bytes_of[jm.name]
        yield RawRecord(f"{unit.rel}:{jm.name}", f"{unit.path}:{jm.name}", data, prov, resolver,
                        error=None if data is not None else "input_truncated",
                        error_detail="" if data is not None else f"{jm.name}: data cut short", default_media=images)
    if tail_error:
        prov = {"dataset": "infinity-mm", "file": unit.rel, "member": "<rest of file>", "index": len(order)}
        yield RawRecord(f"{unit.rel}:<rest>", f"{unit.path}:<after member {len(infos)}>", None, prov, resolver,
                        error="input_truncated", error_detail=tail_error)
