"""Every random-number stream a training step can touch, captured and restored as plain tensors.

Exact resume needs python, numpy, torch (CPU), CUDA and megatron's named RNG-tracker streams
(dropout inside TP regions) to continue where they stopped. The state is stored per rank as
tensors/ints only, so it round-trips through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core.tensor_parallel import random as mrandom

from mmtrain.models.device import compute_device


def get_rng_state() -> dict[str, Any]:
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {
            "version": py_version,
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss": py_gauss,
        },
        "numpy": {
            "name": np_name,
            # (type checker: np.random.get_state() is the legacy tuple form)
            "keys": torch.from_numpy(np_keys.astype(np.int64)),  # type: ignore[attr-defined]
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if _on_cuda() else None,
        "tracker": {},
    }
    tracker = mrandom.get_cuda_rng_tracker()
    if tracker.is_initialized():
        state["tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    return state


def _on_cuda() -> bool:
    """The run's device (a CPU run on a GPU host has no CUDA stream to save)."""
    return compute_device().type == "cuda"


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["name"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and _on_cuda():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        mrandom.get_cuda_rng_tracker().set_states(dict(state["tracker"]))
