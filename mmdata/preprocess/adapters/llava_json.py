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

    def __call__(self, ref: str) -> MediaRef | None:
        path = os.path.realpath(os.path.join(self.root, ref))
        # Never follow a reference out of the image root.
        if os.path.commonpath([path, self.root]) != self.root or not os.path.isfile(path):
            return None
        return MediaRef(path, 0, os.path.getsize(path), ref)


def iter_records(unit: InputUnit) -> Iterator[RawRecord]:
    resolver = _Files(unit.image_root or os.path.dirname(unit.path))
    if unit.path.endswith(".jsonl"):
        with open(unit.path, "rb") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                prov = {"dataset": "llava-json", "file": unit.rel, "line": line_no, "index": line_no - 1}
                yield RawRecord(f"{unit.rel}:{line_no}", f"{unit.path}:{line_no}", line.rstrip(b"\r\n"),
                                prov, resolver)
        return
    try:
        with open(unit.path, "rb") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        prov = {"dataset": "llava-json", "file": unit.rel, "index": 0}
        yield RawRecord(f"{unit.rel}", unit.path, None, prov, resolver, error="json_malformed",
                        error_detail=f"whole file unreadable: {e}")
        return
    if not isinstance(data, list):
        data = [data]
    for i, rec in enumerate(data):
        prov = {"dataset": "llava-json", "file": unit.rel, "item": i, "index": i}
        yield RawRecord(f"{unit.rel}:{i}", f"{unit.path}[{i}]", json.dumps(rec, ensure_ascii=False).encode(),
                        prov, resolver)
