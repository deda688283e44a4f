"""`manifest.json`: what went in (inputs with fingerprints, seed, options), what came out
(shards with counts, sizes, sha256) and the reconciliation (read = written + quarantined, per
source and per reason). Everything except `wall_time_s` and `run` depends only on inputs + seed."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from mmdata.preprocess.adapters.media_resolution import RULES

VOLATILE_KEYS = ("wall_time_s", "run")
UNREFERENCED = "unreferenced_members"


def _media_resolution_zero() -> dict[str, int]:
    return dict.fromkeys((*RULES, UNREFERENCED), 0)


@dataclass
class Counts:
    read: int = 0
    written: int = 0
    quarantined: int = 0
    valid_bytes: int = 0
    by_source: dict = field(default_factory=dict)
    by_reason: dict = field(default_factory=dict)
    # How valid records found their media (media_resolution.py), and own image members unused.
    media_resolution: dict = field(default_factory=_media_resolution_zero)

    def add_media(self, rule: str | None, unreferenced: int) -> None:
        if rule is not None:
            self.media_resolution[rule] += 1
        self.media_resolution[UNREFERENCED] += unreferenced

    def add_record(self, source: str, ok: bool, reason: str | None = None, nbytes: int = 0) -> None:
        src = self.by_source.setdefault(source, {"read": 0, "written": 0, "quarantined": 0})
        self.read += 1
        src["read"] += 1
        if ok:
            self.written += 1
            self.valid_bytes += nbytes
            src["written"] += 1
        else:
            self.quarantined += 1
            src["quarantined"] += 1
            self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def merge(self, other: dict) -> None:
        for k in ("read", "written", "quarantined", "valid_bytes"):
            setattr(self, k, getattr(self, k) + other[k])
        for src, c in other["by_source"].items():
            mine = self.by_source.setdefault(src, {"read": 0, "written": 0, "quarantined": 0})
            for k in mine:
                mine[k] += c[k]
        for r, n in other["by_reason"].items():
            self.by_reason[r] = self.by_reason.get(r, 0) + n
        for k, n in other.get("media_resolution", {}).items():
            self.media_resolution[k] += n

    def to_json(self) -> dict:
        return {
            "read": self.read, "written": self.written, "quarantined": self.quarantined,
            "valid_bytes": self.valid_bytes,
            "by_source": {k: self.by_source[k] for k in sorted(self.by_source)},
            "by_reason": {k: self.by_reason[k] for k in sorted(self.by_reason)},
            "media_resolution": dict(self.media_resolution),
        }


def fingerprint(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def stable_view(manifest: dict) -> dict:
    """The manifest without run-dependent keys (for equality checks across runs)."""
    return {k: v for k, v in manifest.items() if k not in VOLATILE_KEYS}
