"""`manifest.json`: what went in (inputs with fingerprints, seed, options), what came out
(shards with counts, sizes, sha256) and the reconciliation, overall and per source:

    read = written + quarantined + filtered + duplicates + mixed_out - repeated

(`repeated`: extra copies written by an up-sampling --mix), with quarantine per reason, filtered
per rule and how the media were found. Everything except `wall_time_s` and `run` depends only
on inputs + options + seed."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

VOLATILE_KEYS = ("wall_time_s", "run")
UNREFERENCED = "unreferenced_members"
SOURCE_KEYS = ("read", "written", "quarantined", "filtered", "duplicates", "mixed_out", "repeated")
CURATION = ("duplicates", "mixed_out", "repeated")
#: how a record's media were found, from strongest to weakest evidence (preprocess/adapters/media_resolution.py)
MEDIA_RULES = ("by_name", "by_basename", "by_stem")


def _media_resolution_zero() -> dict[str, int]:
    return dict.fromkeys((*MEDIA_RULES, UNREFERENCED), 0)


@dataclass
class Counts:
    read: int = 0
    written: int = 0
    quarantined: int = 0
    filtered: int = 0
    duplicates: int = 0
    mixed_out: int = 0
    repeated: int = 0
    valid_bytes: int = 0  # of the records kept after filters (sizes the shards)
    by_source: dict = field(default_factory=dict)
    by_reason: dict = field(default_factory=dict)
    by_filter: dict = field(default_factory=dict)
    # How valid records found their media (media_resolution.py), and own image members unused.
    media_resolution: dict = field(default_factory=_media_resolution_zero)

    def _source(self, source: str) -> dict:
        counts = self.by_source.get(source)
        if counts is None:
            counts = self.by_source[source] = dict.fromkeys(SOURCE_KEYS, 0)
        return counts

    def _bump(self, source: str, what: str, n: int = 1) -> None:
        setattr(self, what, getattr(self, what) + n)
        self._source(source)[what] += n

    def add_media(self, rule: str | None, unreferenced: int) -> None:
        if rule is not None:
            self.media_resolution[rule] += 1
        self.media_resolution[UNREFERENCED] += unreferenced

    def add_record(self, source: str, ok: bool, reason: str | None = None, nbytes: int = 0) -> None:
        counts = self._source(source)  # (once per record: spelled out rather than two _bump calls)
        self.read += 1
        counts["read"] += 1
        if ok:
            self.written += 1
            counts["written"] += 1
            self.valid_bytes += nbytes
        else:
            self.quarantined += 1
            counts["quarantined"] += 1
            self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def add_filtered(self, source: str, rule: str) -> None:
        self._bump(source, "read")
        self._bump(source, "filtered")
        self.by_filter[rule] = self.by_filter.get(rule, 0) + 1

    def add_curation(self, by_source: dict[str, dict[str, int]]) -> None:
        """Records a later stage dropped as duplicates / mixed out, or repeated (mix)."""
        for source, c in by_source.items():
            for what in CURATION:
                n = c.get(what, 0)
                self._bump(source, what, n)
                self._bump(source, "written", n if what == "repeated" else -n)

    def merge(self, other: dict) -> None:
        for k in (*SOURCE_KEYS, "valid_bytes"):
            setattr(self, k, getattr(self, k) + other.get(k, 0))
        for src, c in other["by_source"].items():
            mine = self._source(src)
            for k in SOURCE_KEYS:
                mine[k] += c.get(k, 0)
        for name in ("by_reason", "by_filter"):
            mine = getattr(self, name)
            for r, n in other.get(name, {}).items():
                mine[r] = mine.get(r, 0) + n
        for k, n in other.get("media_resolution", {}).items():
            self.media_resolution[k] += n

    def reconciles(self) -> bool:
        def ok(c: dict) -> bool:
            return c["read"] == (
                c["written"] + c["quarantined"] + c["filtered"] + c["duplicates"] + c["mixed_out"] - c["repeated"]
            )

        return ok(vars(self)) and all(ok(c) for c in self.by_source.values())

    def to_json(self) -> dict:
        return {
            **{k: getattr(self, k) for k in SOURCE_KEYS},
            "valid_bytes": self.valid_bytes,
            "by_source": {k: self.by_source[k] for k in sorted(self.by_source)},
            "by_reason": {k: self.by_reason[k] for k in sorted(self.by_reason)},
            "by_filter": {k: self.by_filter[k] for k in sorted(self.by_filter)},
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
