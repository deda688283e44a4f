"""`--prompts FILE` of `mmtrain generate`: one prompt per line, or a `.jsonl` file of objects
with a "prompt" string and the keys a family allows (each family turns the records into its own
requests). Bad lines are named by file and line number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from mmtrain.generation.checkpoint import GenerationError


def read_prompt_file(path: str | Path, keys: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
    """[(where, record)] in file order, empty lines skipped; `where` is "FILE:LINE" for the
    family's own messages. Plain text lines become {"prompt": line}."""
    p, allowed = Path(path), {"prompt", *keys}
    if not p.is_file():
        raise GenerationError(f"--prompts {p}: no such file")
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--prompts {p}:{n}"
        if p.suffix != ".jsonl":
            out.append((where, {"prompt": line.strip()}))
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise GenerationError(f"{where}: not JSON ({exc})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise GenerationError(f'{where}: expected an object with a "prompt" string')
        unknown = sorted(set(rec) - allowed)
        if unknown:
            raise GenerationError(f"{where}: unknown keys {unknown} (known: {sorted(allowed)})")
        out.append((where, rec))
    if not out:
        raise GenerationError(f"--prompts {p}: no prompts")
    return out
