"""Quarantine lines: every rejected record with its id, where it came from and a
machine-readable reason. Scan tasks write one part per input file; the driver concatenates
them in input order (streaming), so quarantine.jsonl is deterministic and never held in memory."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path


# A decoder's message may name a Python object by its address ("cannot identify image file
# <_io.BytesIO object at 0x7f...>"), which differs in every run: the detail keeps the rest.
_ADDRESS = re.compile(r" (?:object )?at 0x[0-9a-fA-F]+")


def quarantine_line(record_id: str, location: str, reason: str, detail: str) -> str:
    return json.dumps(
        {"id": record_id, "source_location": location, "reason": reason, "detail": _ADDRESS.sub("", detail)},
        ensure_ascii=False,
        sort_keys=True,
    )


def concat_parts(parts: list[Path], dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp")
    with open(tmp, "wb") as out:
        for p in parts:
            if p.exists():
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out)
    os.replace(tmp, dest)
