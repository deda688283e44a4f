"""Every private name of another library that mmdata uses, each behind a gate that fails loudly
(naming the installed version) and a test (tests/test_private_api.py); nothing else in mmdata
reaches a private name (tests/test_private_names.py). mmtrain keeps its own (mmtrain/private_api.py):
mmdata imports nothing from mmtrain.

- torch's `UntypedStorage._new_shared(size, *, device)`: a storage allocated in shared memory
  directly. torch's own `default_collate` allocates a DataLoader worker's batch this way, so the
  batch reaches the trainer process without another copy; there is no public equivalent (a
  tensor's `share_memory_()` copies it). Gated by its signature: `new_shared_storage` refuses
  another one, naming the torch version.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

#: the parameters of `torch.UntypedStorage._new_shared` as torch 2.13 has them
NEW_SHARED_PARAMETERS = ("size", "device")


@functools.cache
def _new_shared() -> Callable[..., Any]:
    method = getattr(torch.UntypedStorage, "_new_shared", None)
    found = tuple(inspect.signature(method).parameters) if method is not None else "missing"
    if found != NEW_SHARED_PARAMETERS:
        raise RuntimeError(
            f"torch {torch.__version__}: UntypedStorage._new_shared is {found}, not "
            f"{NEW_SHARED_PARAMETERS} (mmdata/private_api.py needs updating)"
        )
    return method


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """An untyped CPU storage of `nbytes` bytes in shared memory, as torch's default_collate
    allocates a DataLoader worker's batch."""
    return _new_shared()(nbytes)
