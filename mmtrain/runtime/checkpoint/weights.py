"""Model weights in megatron's distributed-checkpoint format (torch_dist), reshardable across
TP/PP/DP, with the model config they were made with, and the architecture check that refuses a
checkpoint whose model does not match the recipe's.

    CKPT_DIR/iter_0000100/model/              dist_checkpointing.save of {"model": sharded_state_dict}
    CKPT_DIR/iter_0000100/model_config.yaml   the family's model config (plain YAML)

Entry scripts that save must have an `if __name__ == "__main__":` guard: the torch_dist writer
uses a `spawn` multiprocessing manager (started by runtime/child_processes.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import yaml
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.validation import StrictHandling

from mmtrain.config.typed import to_plain
from mmtrain.runtime.checkpoint.layout import find_latest_iteration, iter_dir, unwrap, write_latest
from mmtrain.runtime.child_processes import install_writer_results_queue

MODEL_CONFIG = "model_config.yaml"


class CheckpointMismatchError(ValueError):
    """A checkpoint was made for another model than the recipe describes (the message names
    the key); raised before anything is loaded."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded(model_chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    chunks = [unwrap(m) for m in model_chunks]
    if len(chunks) == 1:
        # (type checker: megatron modules define sharded_state_dict())
        return {"model": chunks[0].sharded_state_dict()}  # type: ignore[operator]
    # a chunk without weights (a virtual stage of 0 layers) is left out: megatron checks that the
    # ranks' non-sharded parts agree, and its empty dict would be one on this rank only
    # (type checker: megatron modules define sharded_state_dict())
    sharded = {f"model{i}": m.sharded_state_dict() for i, m in enumerate(chunks)}  # type: ignore[operator]
    return {k: sd for k, sd in sharded.items() if sd}


def model_sharded_state_dict(model_chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """The weights' sharded state dict as one flat mapping (the optimizer's state is sharded
    through it, so its moments re-shard exactly like the weights)."""
    merged: dict[str, Any] = {}
    for i, chunk in enumerate(model_chunks):
        # (type checker: megatron modules define sharded_state_dict())
        sd = unwrap(chunk).sharded_state_dict()  # type: ignore[operator]
        merged.update(sd if len(model_chunks) == 1 else {f"chunk{i}.{k}": v for k, v in sd.items()})
    return merged


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
    _barrier()
    install_writer_results_queue()
    dist_checkpointing.save(_sharded(model_chunks), str(model_dir))
    _barrier()
    if _rank0():
        if model_config is not None:
            tmp = out / (MODEL_CONFIG + ".tmp")
            tmp.write_text(yaml.safe_dump(to_plain(model_config), sort_keys=False))
            tmp.replace(out / MODEL_CONFIG)
        if update_latest:
            write_latest(ckpt_dir, iteration)
    _barrier()
    return out


def load_model_weights(
    model_chunks: Sequence[torch.nn.Module],
    ckpt_dir: str | os.PathLike,
    iteration: int | None = None,
    *,
    strict: bool = True,
) -> int:
    """Collective. Loads into the chunks in place (any TP/PP layout); returns the iteration."""
    if iteration is None:
        iteration = find_latest_iteration(ckpt_dir)
        if iteration is None:
            raise FileNotFoundError(f"{ckpt_dir}: no checkpoint (no 'latest' file and no iter_*/model)")
    model_dir = iter_dir(ckpt_dir, iteration) / "model"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: checkpoint model directory not found")
    loaded = dist_checkpointing.load(
        _sharded(model_chunks),
        str(model_dir),
        strict=StrictHandling.RAISE_ALL if strict else StrictHandling.LOG_UNEXPECTED,
    )
    chunks = [unwrap(m) for m in model_chunks]
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"], strict=strict)
    else:
        for i, m in enumerate(chunks):  # a chunk without weights has no entry (`_sharded`)
            m.load_state_dict(loaded.get(f"model{i}", {}), strict=strict)
    return iteration


def load_model_config_dict(ckpt_dir: str | os.PathLike, iteration: int | None = None) -> dict:
    if iteration is None:
        iteration = find_latest_iteration(ckpt_dir)
    if iteration is None:
        raise FileNotFoundError(f"{ckpt_dir}: no checkpoint")
    f = iter_dir(ckpt_dir, iteration) / MODEL_CONFIG
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing (the model config is saved next to the weights)")
    return yaml.safe_load(f.read_text())


def check_architecture(
    ckpt_dir: str | os.PathLike, expected: Any, keys: Sequence[str], iteration: int | None = None
) -> None:
    """Refuse (CheckpointMismatchError naming `model.<key>`) when the checkpoint's saved model
    config and `expected` (the recipe's model config) disagree on one of `keys`, the family's
    architecture keys. A checkpoint without a saved model config is not checked."""
    try:
        saved = load_model_config_dict(ckpt_dir, iteration)
    except FileNotFoundError:
        return  # nothing recorded to compare with
    want = to_plain(expected)

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}")
        elif a != b:
            raise CheckpointMismatchError(
                f"{ckpt_dir}: {path} is {b!r} in the recipe but {a!r} in the checkpoint; "
                "the checkpoint holds another model's weights (fix the recipe or checkpoint.load)"
            )

    for key in keys:
        if key in saved or key in want:
            walk(saved.get(key), want.get(key), f"model.{key}")
