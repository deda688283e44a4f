"""What the curation steps look at, computed once per valid record in the scan: the filter
fields, and for near-duplicate removal the perceptual hashes of its images and a key of its
normalised conversation text."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import Any

from mmdata.preprocess.curation.phash import phash_bytes
from mmdata.shard_format import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, modality_of

_SPACES = re.compile(r"\s+")


def _plain(text: str) -> str:
    return text.replace(IMAGE_PLACEHOLDER, " ").replace(VIDEO_PLACEHOLDER, " ")


def filter_fields(record: dict, subset: str) -> dict[str, Any]:
    """The values `--filter` rules test (curation.filters.FIELDS); None: the record lacks it."""
    meta = record.get("meta") or {}
    sizes = meta.get("image_sizes") or []
    conv = record["conversations"]
    loss = meta.get("qw2vl_loss")
    return {
        "qw2vl_loss": float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None,
        "source": record.get("source", ""),
        "subset": subset,
        "id": record["id"],
        "modality": modality_of(len(sizes), record.get("video") is not None),
        "images": len(sizes),
        "min_side": min(min(w, h) for w, h, _ in sizes) if sizes else None,
        "max_side": max(max(w, h) for w, h, _ in sizes) if sizes else None,
        "turns": sum(1 for t in conv if t["from"] != "system"),
        "text_chars": sum(len(_plain(t["value"])) for t in conv),
    }


def conversation_key(conversations: list[dict]) -> int:
    """64-bit key of the normalised conversation: roles and text, placeholders removed,
    Unicode NFKC, case-folded, runs of white space as one space. Two records whose keys are
    equal ask and answer the same thing, whatever their images."""
    parts = []
    for t in conversations:
        text = _SPACES.sub(" ", unicodedata.normalize("NFKC", _plain(t["value"])).casefold()).strip()
        parts.append(f"{t['from']}\x1f{text}")
    return int.from_bytes(hashlib.blake2b("\x1e".join(parts).encode(), digest_size=8).digest(), "big")


def _as_hash(v: Any) -> int | None:
    """One 64-bit hash as the field may hold it: an int (the card's format) or a hex string."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int) and 0 <= v < 1 << 64:
        return v
    if isinstance(v, int) and -(1 << 63) <= v < 0:  # a signed 64-bit spelling of the same bits
        return v + (1 << 64)
    if isinstance(v, str) and 0 < len(v) <= 16:
        try:
            return int(v, 16)
        except ValueError:
            return None
    return None


def image_hashes(field: Any, image_bytes: list[bytes]) -> tuple[list[int], bool]:
    """(one perceptual hash per image, whether any was computed). The record's `phash` field is
    used when it holds one readable hash per image (Infinity-MM: a list with one 64-bit integer);
    otherwise every hash is computed from the image (curation.phash, imagehash-compatible)."""
    given = field if isinstance(field, list) else [field]
    hashes = [_as_hash(v) for v in given]
    if len(hashes) == len(image_bytes) and all(h is not None for h in hashes):
        return hashes, False  # type: ignore[return-value]
    return [phash_bytes(data) for data in image_bytes], True
