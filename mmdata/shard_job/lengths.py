"""What both jobs' per-sample length indexes share: the file name (`DIR/lengths.parquet`), the
vision-tiles column and the tokenizer fingerprint the index depends on. What goes into a row is
each job's own (mmdata/preprocess/lengths.py, mmdata/vision_tokens/lengths.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

LENGTHS_NAME = "lengths.parquet"
VISION_TILES = "vision_tiles"  # the index's column of tiles + frames per sample


def tokenizer_fingerprint(path: str | Path) -> str:
    """sha256 over the tokenizer folder's files (names and bytes): the index depends on them."""
    h = hashlib.sha256()
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"--tokenizer {path}: not a folder")
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()
