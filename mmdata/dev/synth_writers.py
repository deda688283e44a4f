"""The synthetic records on disk: Infinity-MM tar shards or LLaVA-style JSONL + image folder."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from mmdata.dev.synth_records import SynthRecord


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def write_infinity_mm(records: list[SynthRecord], output: Path, *, samples_per_tar: int = 100) -> list[Path]:
    """stageN/<subset>/NNNNNN.tar, each sample `{stem}.json` followed by its image(s)."""
    by_subset: dict[tuple[str, str], list[SynthRecord]] = {}
    for rec in records:
        by_subset.setdefault((rec.stage, rec.subset), []).append(rec)
    files: list[Path] = []
    for (stage, subset), recs in sorted(by_subset.items()):
        folder = output / stage / subset
        folder.mkdir(parents=True, exist_ok=True)
        for t, start in enumerate(range(0, len(recs), samples_per_tar)):
            path = folder / f"{t:06d}.tar"
            with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
                for rec in recs[start : start + samples_per_tar]:
                    _add_member(tar, f"{rec.stem}.json", rec.json_bytes)
                    members = [
                        (name, img.data)
                        for k, (name, img) in enumerate(zip(rec.member_names, rec.images))
                        if not (rec.broken == "missing_image" and k == 0)
                    ]
                    for name, data in sorted(members) if rec.members_sorted else members:
                        _add_member(tar, name, data)
                    if rec.video is not None:
                        _add_member(tar, rec.record["video"], rec.video)
            files.append(path)
    return files


def write_llava_json(records: list[SynthRecord], output: Path) -> list[Path]:
    """`annotations.jsonl` (one record per line, `image` relative to the output dir) + `images/`."""
    (output / "images").mkdir(parents=True, exist_ok=True)
    ann = output / "annotations.jsonl"
    with ann.open("wb") as f:
        for rec in records:
            names = [f"images/{n}" for n in rec.member_names]
            if rec.broken == "malformed_json":
                f.write(rec.json_bytes.replace(b"\n", b" ") + b"\n")
            else:
                r = dict(rec.record)
                if names:
                    r["image"] = names[0] if len(names) == 1 else names
                if rec.video is not None:
                    r["video"] = f"videos/{rec.record['video']}"
                    (output / "videos").mkdir(exist_ok=True)
                    (output / r["video"]).write_bytes(rec.video)
                f.write(json.dumps(r, ensure_ascii=False).encode() + b"\n")
            for k, (name, img) in enumerate(zip(names, rec.images)):
                if rec.broken == "missing_image" and k == 0:
                    continue
                (output / name).write_bytes(img.data)
    return [ann]
