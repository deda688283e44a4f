"""`--prompts FILE` of `mmtrain generate`: one prompt per line, or a `.jsonl` file of objects
with a "prompt" string and the keys a family allows (each family turns the records into its own
requests). Bad lines are named by file and line number. And `--output`, checked before the model
loads so that a path that cannot be written, or that holds the user's files, does not cost a
generation run: the policy of every writing command (mmdata/folder_lock.py `fresh_folder`): an
existing file or a non-empty folder is refused unless `--overwrite`, and outputs are written
aside and put in place at the end (`staged_file`, `fresh_folder`), so nothing is half-written."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable

from mmdata.folder_lock import is_non_empty
from mmdata.units import plural
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


def check_output(path: Path, *, directory: bool, overwrite: bool, suffixes: Iterable[str] = ()) -> None:
    """`--output` can be written: a directory (created) that is not a file, or a file that is not
    a directory, with one of `suffixes` when given; no file stands where a parent folder goes. An
    existing file or a non-empty directory is refused unless `overwrite`."""
    if directory and path.exists() and not path.is_dir():
        raise GenerationError(f"--output {path} is a file; with --prompts it is a directory to write into")
    if not directory and path.is_dir():
        raise GenerationError(f"--output {path} is a directory; give a file name")
    if directory and not overwrite and is_non_empty(path):
        entries = sorted(p.name for p in path.iterdir())
        raise GenerationError(
            f"--output {path} is not empty ({plural(len(entries), 'entry', 'entries')}, e.g. {entries[0]!r}); choose "
            f"an "
            f"empty or new folder, or pass --overwrite to replace it"
        )
    if not directory and not overwrite and path.exists():
        raise GenerationError(f"--output {path} exists; choose a new file name, or pass --overwrite to replace it")
    known = sorted(suffixes)
    if not directory and known and path.suffix.lower() not in known:
        raise GenerationError(
            f"--output {path}: unknown extension {path.suffix or '(none)'!r}; e.g. "
            f"{'.png' if '.png' in known else known[0]}"
        )
    blocking = next((a for a in path.parents if a.exists() and not a.is_dir()), None)
    if blocking is not None:
        raise GenerationError(f"--output {path}: {blocking} is a file, not a folder")


@contextmanager
def staged_file(path: Path) -> Iterator[Path]:
    """A hidden sibling of `path` (same suffix) to write, renamed over `path` at the end: an error
    or Ctrl-C midway leaves no partial file, and an old one (--overwrite) as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.stem}.tmp-{os.getpid()}{path.suffix}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
