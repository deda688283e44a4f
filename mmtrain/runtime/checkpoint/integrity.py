"""Is a training checkpoint whole, and is it ours? Checked before anything is built or loaded.

On save, rank 0 lists every file of the finished checkpoint with its size (`files.json`), after
all ranks wrote theirs and before the directory is published. On load, a missing or resized
file (a copy cut short, a full disk, a checkpoint from another tool), an unreadable
`trainer_state.json` and a checkpoint saved by another model family are refused with a message
naming the file or the key. Damage inside a file that keeps its size is caught by the loaders
themselves, and `CheckpointManager.restore` reports it the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import yaml

from mmtrain.runtime.checkpoint.layout import CHECKPOINT_FORMAT, TRAINER_STATE
from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError

FILE_LIST = "files.json"
RECIPE = "config.yaml"


class CheckpointDamagedError(CheckpointMismatchError):
    """The checkpoint is incomplete, unreadable or not a checkpoint of this kind of run."""


def write_file_list(ckpt: Path) -> None:
    files = {
        p.relative_to(ckpt).as_posix(): p.stat().st_size
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != FILE_LIST
    }
    (ckpt / FILE_LIST).write_text(json.dumps(files, indent=1, sort_keys=True))


def _advice(ckpt: Path) -> str:
    return (
        f"resume from an earlier checkpoint (checkpoint.load={ckpt.parent}/iter_...) or move {ckpt} "
        "away; the `latest` file names the checkpoint a rerun resumes"
    )


def _parsed(
    path: Path, parse: Callable[[str], Any], errors: tuple[type[Exception], ...], ckpt: Path, named: bool = False
) -> Any:
    """`parse` of the file's text; one of `errors` (with `named`, prefixed by its type) is a
    damaged checkpoint."""
    try:
        return parse(path.read_text())
    except errors as e:
        what = f"{type(e).__name__}: {e}" if named else str(e)
        raise CheckpointDamagedError(f"{path}: unreadable ({what}); {_advice(ckpt)}") from None


def _trainer_state(text: str) -> dict:
    """The trainer state record, refused (KeyError, TypeError) without an integer step."""
    record = json.loads(text)
    step = record["step"]
    if not isinstance(step, int):
        raise TypeError(f"step is {step!r}")
    return record


def check_checkpoint(ckpt: Path, family: str) -> None:
    """Raise CheckpointDamagedError when `ckpt` (an iter_* dir of a training or weights-only
    checkpoint) is incomplete, unreadable or another family's."""
    listing = ckpt / FILE_LIST
    if listing.is_file():
        files = _parsed(listing, json.loads, (json.JSONDecodeError, UnicodeDecodeError), ckpt)
        for name, size in files.items():
            f = ckpt / name
            if not f.is_file():
                raise CheckpointDamagedError(f"{ckpt}: incomplete, {name} is missing; {_advice(ckpt)}")
            if f.stat().st_size != size:
                raise CheckpointDamagedError(
                    f"{ckpt}: damaged, {name} has {f.stat().st_size} bytes but was saved with {size} "
                    f"(truncated or overwritten); {_advice(ckpt)}"
                )
    state = ckpt / TRAINER_STATE
    if state.exists():
        record = _parsed(
            state, _trainer_state, (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError), ckpt, named=True
        )
        written = record.get("format", 1)
        if written != CHECKPOINT_FORMAT:
            raise CheckpointDamagedError(
                f"{state}: checkpoint format {written}, this mmtrain reads format {CHECKPOINT_FORMAT} (a checkpoint "
                f"of another mmtrain version); {_advice(ckpt)}"
            )
    recipe = ckpt / RECIPE
    if recipe.is_file():
        saved = _parsed(recipe, yaml.safe_load, (yaml.YAMLError,), ckpt)
        theirs = saved.get("family") if isinstance(saved, dict) else None
        if theirs is not None and theirs != family:
            raise CheckpointDamagedError(
                f"{ckpt}: a checkpoint of a {theirs} run, not {family}; give a checkpoint of a {family} run "
                "(or convert the weights: docs/conversion.md)"
            )
