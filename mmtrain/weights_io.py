"""Model weights in megatron's distributed-checkpoint format (torch_dist), reshardable across
TP/PP/DP. Layout shared with the training checkpoints and the converter:

    CKPT_DIR/latest                       text: the latest iteration number
    CKPT_DIR/iter_0000100/model/          dist_checkpointing.save of {"model": sharded_state_dict}
    CKPT_DIR/iter_0000100/model_config.yaml

Entry scripts that save must have an `if __name__ == "__main__":` guard: the torch_dist writer
may start a `spawn` multiprocessing manager.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing

LATEST = "latest"


def iter_dir_name(iteration: int) -> str:
    """`iter_0000100`: the one spelling of an iteration directory (weights, checkpoints, converter)."""
    return f"iter_{iteration:07d}"


def iter_dir(ckpt_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(ckpt_dir) / iter_dir_name(iteration)


def write_latest(ckpt_dir: str | os.PathLike, iteration: int) -> None:
    """Atomically point CKPT_DIR/latest at `iteration` (written to a temp file, then renamed)."""
    tmp = Path(ckpt_dir) / (LATEST + ".tmp")
    tmp.write_text(f"{iteration}\n")
    tmp.replace(Path(ckpt_dir) / LATEST)


def find_latest_iteration(ckpt_dir: str | os.PathLike) -> int | None:
    """The iteration in CKPT_DIR/latest, else the highest iter_* dir holding a model, else None."""
    ckpt_dir = Path(ckpt_dir)
    f = ckpt_dir / LATEST
    if f.is_file():
        text = f.read_text().strip()
        try:
            return int(text)
        except ValueError as err:
            raise ValueError(f"{f}: expected an iteration number, got {text!r}") from err
    its = sorted(int(p.name[5:]) for p in ckpt_dir.glob("iter_*") if p.name[5:].isdigit() and (p / "model").is_dir())
    return its[-1] if its else None


def _sharded(model_chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    chunks = [getattr(m, "module", m) for m in model_chunks]  # unwrap DDP
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(chunks)}


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_model_weights(
    model_chunks: Sequence[torch.nn.Module],
    ckpt_dir: str | os.PathLike,
    iteration: int = 0,
    model_config: Any = None,
    *,
    update_latest: bool = True,
) -> Path:
    """Collective: every rank passes its own chunks. Returns the iteration directory."""
    out = iter_dir(ckpt_dir, iteration)
    model_dir = out / "model"
    if _rank0():
        model_dir.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(_sharded(model_chunks), str(model_dir))
    if dist.is_initialized():
        dist.barrier()
    if _rank0():
        if model_config is not None:
            data = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
            tmp = out / "model_config.yaml.tmp"
            tmp.write_text(yaml.safe_dump(data, sort_keys=False))
            tmp.replace(out / "model_config.yaml")
        if update_latest:
            write_latest(ckpt_dir, iteration)
    if dist.is_initialized():
        dist.barrier()
    return out


#: model-config sections that decide the weights' shapes/meaning (dtype, max_tiles ... may change)
ARCH_KEYS = ("llm", "vision", "projector", "image_token_id", "video_token_id")


def check_model_config(ckpt_dir: str | os.PathLike, expected: Any, iteration: int | None = None) -> None:
    """Raise ValueError naming `model.<key>` where the checkpoint's saved model config and
    `expected` (the recipe's model config) disagree on architecture."""
    try:
        saved = load_model_config_dict(ckpt_dir, iteration)
    except FileNotFoundError:
        return  # nothing recorded to compare with
    want = expected.to_dict() if hasattr(expected, "to_dict") else dict(expected)

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}")
        elif a != b:
            raise ValueError(f"{ckpt_dir}: {path} is {b!r} in the recipe but {a!r} in the checkpoint")

    for key in ARCH_KEYS:
        if key in saved or key in want:
            walk(saved.get(key), want.get(key), f"model.{key}")


def load_model_weights(
    model_chunks: Sequence[torch.nn.Module], ckpt_dir: str | os.PathLike, iteration: int | None = None, *,
    strict: bool = True, expected_config: Any = None,
) -> int:
    """Collective. Loads into the chunks in place (any TP/PP layout); returns the iteration.
    With `expected_config`, an architecture mismatch is refused first, naming the key."""
    if iteration is None:
        iteration = find_latest_iteration(ckpt_dir)
        if iteration is None:
            raise FileNotFoundError(f"{ckpt_dir}: no checkpoint (no 'latest' file and no iter_*/model)")
    if expected_config is not None:
        check_model_config(ckpt_dir, expected_config, iteration)
    model_dir = iter_dir(ckpt_dir, iteration) / "model"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: checkpoint model directory not found")
    sharded = _sharded(model_chunks)
    from megatron.core.dist_checkpointing.validation import StrictHandling

    loaded = dist_checkpointing.load(
        sharded, str(model_dir), strict=StrictHandling.RAISE_ALL if strict else StrictHandling.LOG_UNEXPECTED
    )
    chunks = [getattr(m, "module", m) for m in model_chunks]
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"], strict=strict)
    else:
        for i, m in enumerate(chunks):
            m.load_state_dict(loaded[f"model{i}"], strict=strict)
    return iteration


def load_model_config_dict(ckpt_dir: str | os.PathLike, iteration: int | None = None) -> dict:
    if iteration is None:
        iteration = find_latest_iteration(ckpt_dir)
    if iteration is None:
        raise FileNotFoundError(f"{ckpt_dir}: no checkpoint")
    f = iter_dir(ckpt_dir, iteration) / "model_config.yaml"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing (the model config is saved next to the weights)")
    return yaml.safe_load(f.read_text())
