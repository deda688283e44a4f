"""LLaVA-style layout: JSON (a list of records) or JSONL annotation files, with `image`
fields relative to an image root (default: the annotation file's folder)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from mmdata.preprocess.adapters.base import InputUnit, MediaRef, MediaResolver, RawRecord, walk_files


def list_units(inputs: list[Path], image_root: Path | None) -> list[InputUnit]:
    units: list[InputUnit] = []
    for root in inputs:
        root = root.resolve()
        for p in walk_files(root, (".json", ".jsonl")):
            rel = p.name if root.is_file() else str(p.relative_to(root))
            st = p.stat()
            img_root = str(image_root.resolve()) if image_root else str(p.parent)
            units.append(InputUnit(len(units), str(p), rel, st.st_size, st.st_mtime_ns, img_root))
    return units


class _Files(MediaResolver):
    def __init__(self, root: str):
        self.root = os.path.realpath(root)

    def by_name(self, ref: str) -> MediaRef | None:
        path = os.path.realpath(os.path.join(self.root, ref))
        # Never follow a reference out of the image root.
        if os.path.commonpath([path, self.root]) != self.root or not os.path.isfile(path):
            return None
        return MediaRef(path, 0, os.path.getsize(path), ref)

    def outside(self, ref: str) -> str | None:
        path = os.path.realpath(os.path.join(self.root, ref))
        return path if os.path.commonpath([path, self.root]) != self.root else None


def iter_records(unit: InputUnit) -> Iterator[RawRecord]:
    resolver = _Files(unit.image_root or os.path.dirname(unit.path))
    if unit.path.endswith(".jsonl"):
        with open(unit.path, "rb") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                prov = {"dataset": "llava-json", "file": unit.rel, "line": line_no, "index": line_no - 1}
                yield RawRecord(f"{unit.rel}:{line_no}", f"{unit.path}:{line_no}", line.rstrip(b"\r\n"), prov, resolver)
        return
    try:
        with open(unit.path, "rb") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        prov = {"dataset": "llava-json", "file": unit.rel, "index": 0}
        yield RawRecord(
            f"{unit.rel}",
            unit.path,
            None,
            prov,
            resolver,
            error="json_malformed",
            error_detail=f"whole file unreadable: {e}",
        )
        return
    if not isinstance(data, list):
        data = [data]
    for i, rec in enumerate(data):
        prov = {"dataset": "llava-json", "file": unit.rel, "item": i, "index": i}
        yield RawRecord(
            f"{unit.rel}:{i}", f"{unit.path}[{i}]", json.dumps(rec, ensure_ascii=False).encode(), prov, resolver
        )


def check_image_root(units: list[InputUnit], max_refs: int = 32, max_records: int = 2000) -> str | None:
    """Why the job would lose every image, or None: when none of the first `max_refs` image
    entries (from at most `max_records` records) resolves under its image root, the root is
    almost surely wrong; say so before any work starts, naming a folder that works if one of
    the annotation file's ancestors (or the working directory) is it."""
    tried: list[tuple[InputUnit, str]] = []
    records = 0
    for unit in units:
        resolver = _Files(unit.image_root or os.path.dirname(unit.path))
        for raw in iter_records(unit):
            records += 1
            try:
                entries = json.loads(raw.json_bytes or b"null").get("image")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                entries = None
            for ref in [entries] if isinstance(entries, str) else entries if isinstance(entries, list) else []:
                if not isinstance(ref, str) or not ref:
                    continue
                if resolver.by_name(ref) is not None:
                    return None
                tried.append((unit, ref))
            if len(tried) >= max_refs or records >= max_records:
                break
        if len(tried) >= max_refs or records >= max_records:
            break
    if not tried:
        return None
    unit, ref = tried[0]
    root = unit.image_root or os.path.dirname(unit.path)
    msg = (
        f"none of the first {len(tried)} image paths of {unit.rel} resolves under the image root {root} "
        f"(e.g. {ref!r} -> {os.path.join(root, ref)}: not found)"
    )
    if os.path.isabs(ref):
        return msg + "; the paths are absolute: pass --image-root with a folder that contains them"
    for candidate in [*list(Path(unit.path).parents)[:5], Path.cwd()]:
        if str(candidate) != root and all((candidate / r).is_file() for _, r in tried[:4]):
            return msg + f"; they resolve under {candidate}: pass --image-root {candidate}"
    return msg + "; pass --image-root DIR, the folder the image paths are relative to"
