"""Every private name of another library that mmdata uses, each behind a gate that fails loudly
(naming the installed version) and a test (tests/test_private_api.py); nothing else in mmdata
reaches a private name (tests/test_private_names.py). mmtrain keeps its own (mmtrain/private_api.py):
mmdata imports nothing from mmtrain.

- torch's `UntypedStorage._new_shared(size, *, device)`: a storage allocated in shared memory
  directly. torch's own `default_collate` allocates a DataLoader worker's batch this way, so the
  batch reaches the trainer process without another copy; there is no public equivalent (a
  tensor's `share_memory_()` copies it). Gated by its signature: `new_shared_storage` refuses
  another one, naming the torch version.
- torch's `_MultiProcessingDataLoaderIter._shutdown_workers()` (what torch's own `__del__` calls)
  and energon's `SavableDataLoader._epoch_iterator`: stopping a loader's workers at once
  (`stop_loader_workers`). energon's loader and its epoch iterator refer to each other, so a
  dropped loader waits for the cyclic collector, which finalizes torch's index queues before
  torch's iterator: the workers never hear the stop signal and each waits out torch's 5 s status
  interval. Neither library has a public shutdown (energon 7.4, torch 2.13). Gated by the method's
  signature and energon's attribute: `stop_loader_workers` refuses others, naming the versions.
"""

from __future__ import annotations

import functools
import inspect
from importlib.metadata import version
from typing import Any, Callable

import torch
from megatron.energon.savable_loader import SavableDataLoader
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

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


@functools.cache
def _check_loader_shutdown() -> None:
    method = getattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", None)
    found = tuple(inspect.signature(method).parameters) if method is not None else "missing"
    if found != ("self",) or not hasattr(SavableDataLoader, "_epoch_iterator"):
        raise RuntimeError(
            f"torch {torch.__version__}: _MultiProcessingDataLoaderIter._shutdown_workers is {found}, or "
            f"megatron-energon {version('megatron-energon')}: SavableDataLoader has no _epoch_iterator "
            "(mmdata/private_api.py needs updating)"
        )


def stop_loader_workers(loader: Any) -> None:
    """Stop a torch/energon loader's worker processes now, on torch's stop signal, and break
    energon's loader <-> epoch-iterator cycle so the rest is freed by reference counts."""
    _check_loader_shutdown()
    workers = getattr(loader, "_iterator", None)  # torch's iterator of the persistent workers
    if isinstance(workers, _MultiProcessingDataLoaderIter):
        workers._shutdown_workers()
        loader._iterator = None
    if isinstance(loader, SavableDataLoader):
        loader._epoch_iterator = None
