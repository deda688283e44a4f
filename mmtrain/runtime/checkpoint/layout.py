"""The on-disk layout of megatron checkpoint directories, owned here and nowhere else:
iteration directories, the `latest` pointer, what a user-given path points at, and unwrapping
model chunks to the modules whose state is saved.

    CKPT_DIR/latest                       text: the latest complete iteration number
    CKPT_DIR/iter_0000100/model/          the weights (weights.py)
    CKPT_DIR/iter_0000100/...             a training checkpoint's other parts (manager.py)

The same layout serves training runs (`<run_dir>/checkpoints`), `mmtrain convert` output and
weights-only starting points, so any of them is a valid `checkpoint.load`.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
#: the training checkpoint format, recorded in trainer_state.json (`format`); a checkpoint of
#: another format is refused (integrity.check_checkpoint). 2: the data identity, the optimizer
#: layout and the context-parallel size are always recorded (1: before the field existed)
CHECKPOINT_FORMAT = 2
ITER_RE = re.compile(r"^iter_(\d{7})$")


def iter_dir_name(iteration: int) -> str:
    """`iter_0000100`: the one spelling of an iteration directory."""
    return f"iter_{iteration:07d}"


def iter_dir(ckpt_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(ckpt_dir) / iter_dir_name(iteration)


def iteration_of(ckpt: Path) -> int:
    m = ITER_RE.match(ckpt.name)
    if not m:
        raise ValueError(f"{ckpt}: not an iter_NNNNNNN checkpoint dir")
    return int(m.group(1))


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def write_latest(ckpt_dir: str | os.PathLike, iteration: int) -> None:
    """Atomically point CKPT_DIR/latest at `iteration` (written to a temp file, then renamed)."""
    tmp = Path(ckpt_dir) / (LATEST + ".tmp")
    tmp.write_text(f"{iteration}\n")
    tmp.replace(Path(ckpt_dir) / LATEST)


def read_latest(ckpt_dir: str | os.PathLike) -> int | None:
    """The iteration in CKPT_DIR/latest, or None without that file."""
    f = Path(ckpt_dir) / LATEST
    if not f.is_file():
        return None
    text = f.read_text().strip()
    try:
        return int(text)
    except ValueError as err:
        raise ValueError(f"{f}: expected an iteration number, got {text!r}") from err


def find_latest_iteration(ckpt_dir: str | os.PathLike) -> int | None:
    """The iteration in CKPT_DIR/latest, else the highest iter_* dir holding a model, else None."""
    latest = read_latest(ckpt_dir)
    if latest is not None:
        return latest
    its = sorted(
        iteration_of(p) for p in Path(ckpt_dir).glob("iter_*") if ITER_RE.match(p.name) and (p / "model").is_dir()
    )
    return its[-1] if its else None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The run's newest complete training checkpoint (what a rerun resumes), or None."""
    root = checkpoints_root(run_dir)
    latest = read_latest(root)
    target = iter_dir(root, latest) if latest is not None else None
    return target if target is not None and (target / TRAINER_STATE).is_file() else None


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
    )


def resolve_checkpoint(path: str | os.PathLike) -> tuple[str, Path]:
    """What a user-given `checkpoint.load` points at:
    ('mmtrain', iter dir)  a full training checkpoint (resume: model, optimizer, step, loader...)
    ('weights', iter dir)  weights only, e.g. from `mmtrain convert hf-to-mcore` (start from them)
    ('hf', dir)            an HF model dir (converted on the fly)
    Accepts an iter dir, a checkpoints dir (follows `latest`), a run dir, or an HF dir."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint.load: {p} does not exist")
    candidates = [p]
    for root in (p, checkpoints_root(p)):
        latest = read_latest(root)
        if latest is not None:
            candidates.append(iter_dir(root, latest))
    for c in candidates:
        if (c / TRAINER_STATE).is_file():
            return "mmtrain", c
    for c in candidates:
        if ITER_RE.match(c.name) and (c / "model").is_dir():
            return "weights", c
    if is_hf_dir(p):
        return "hf", p
    raise FileNotFoundError(
        f"checkpoint.load: {p} is neither an mmtrain checkpoint (iter_NNNNNNN dir, or a dir with "
        "a `latest` file) nor an HF model dir (config.json + *.safetensors)"
    )


def prune(ckpt_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` iteration dirs (0 = keep all)."""
    if keep_last <= 0:
        return
    steps = sorted(int(m.group(1)) for d in ckpt_dir.iterdir() if (m := ITER_RE.match(d.name)))
    for step in steps[:-keep_last]:
        shutil.rmtree(iter_dir(ckpt_dir, step), ignore_errors=True)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model module inside its wrappers (megatron DDP, Float16Module): the one whose
    parameters are named as the family's model names them and whose state is saved."""
    while hasattr(chunk, "module") and not hasattr(chunk, "sharded_state_dict_unwrapped"):
        inner = chunk.module
        if not isinstance(inner, torch.nn.Module):
            break
        chunk = inner
    return chunk
