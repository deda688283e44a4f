"""The private names of other libraries that mmdata and mmtrain use (mmdata/private_api.py,
mmtrain/private_api.py) are gated, and this file fails when a library changes one:
- megatron-core's `filesystem_async._results_queue` (set by runtime/child_processes.py): gated by
  version; fails when megatron renames it, or stops taking its writer's queue from it;
- torch's CPU flash-attention ops (models/cp_attention.py): gated by schema; fails when they stop
  computing attention with its log-sum-exp and its gradients;
- torch's `UntypedStorage._new_shared` (the LLaVA-OV batch in a loader worker): gated by signature;
  fails when it stops giving shared memory."""

from __future__ import annotations

import queue
import re
from importlib import metadata

import pytest

import torch

from mmdata import private_api as mmdata_private_api
from mmtrain import private_api

pytestmark = pytest.mark.unit


def test_the_installed_megatron_is_the_tested_minor_version() -> None:
    assert metadata.version("megatron-core").startswith(private_api.TESTED_MEGATRON + ".")
    private_api.require_tested_megatron()


@pytest.mark.parametrize("other", ["0.17.0", "0.15.3", "1.0.0rc1"])
def test_another_megatron_is_refused_by_name(other: str) -> None:
    with pytest.raises(
        RuntimeError,
        match=rf"megatron-core {re.escape(other)} is installed.*"
        r"megatron-core>=0\.16,<0\.17",
    ):
        private_api.require_tested_megatron(other)


def test_megatron_keeps_the_writer_queue_where_mmtrain_sets_it() -> None:
    """megatron still has the module-level name, still starts empty (None: made at the first
    save), and its writer's queue getter returns whatever is stored there."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert hasattr(filesystem_async, private_api.RESULTS_QUEUE)
    before = private_api.writer_results_queue()
    ours = queue.Queue()
    try:
        private_api.set_writer_results_queue(ours)
        assert filesystem_async._get_write_results_queue() is ours
    finally:
        private_api.set_writer_results_queue(before)


def test_a_megatron_without_the_name_is_refused(monkeypatch) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.delattr(filesystem_async, private_api.RESULTS_QUEUE)
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.16\.\d+: filesystem_async has no _results_queue"):
        private_api.writer_results_queue()


# ----------------------------------------------------------------------------- torch (mmtrain)


def test_cpu_flash_attention_computes_attention_its_lse_and_gradients() -> None:
    """Against torch's public SDPA: the output, the log-sum-exp (log of the softmax denominator)
    and the gradients of q, k, v, causal and not."""
    fwd, bwd = private_api.cpu_flash_attention()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    scale = 8**-0.5
    for causal in (False, True):
        out, lse = fwd(q, k, v, 0.0, causal, scale=scale)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        torch.testing.assert_close(out, ref)
        scores = (q @ k.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
        grad = torch.randn_like(ref)
        dq, dk, dv = bwd(grad, q, k, v, out, lse, 0.0, causal, scale=scale)
        torch.testing.assert_close((dq, dk, dv), torch.autograd.grad(ref, (q, k, v), grad))


def test_another_cpu_flash_attention_schema_is_refused_by_name(monkeypatch) -> None:
    name = "_scaled_dot_product_flash_attention_for_cpu"
    monkeypatch.setitem(private_api.CPU_FLASH_ATTENTION_SCHEMAS, name, "aten::" + name + "(Tensor q) -> Tensor")
    private_api.cpu_flash_attention.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)}: aten::{name} is aten::"):
            private_api.cpu_flash_attention()
    finally:
        private_api.cpu_flash_attention.cache_clear()


# ----------------------------------------------------------------------------- torch (mmdata)


def test_new_shared_storage_is_shared_memory_of_the_size_asked() -> None:
    storage = mmdata_private_api.new_shared_storage(1000)
    assert isinstance(storage, torch.UntypedStorage) and storage.nbytes() == 1000 and storage.is_shared()
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (10, 100))
    tensor.fill_(7)
    assert int(tensor.sum()) == 7000


def test_a_torch_without_new_shared_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", None)  # defined on a base class: shadow it
    mmdata_private_api._new_shared.cache_clear()
    try:
        with pytest.raises(
            RuntimeError,
            match=rf"torch {re.escape(torch.__version__)}: UntypedStorage._new_shared "
            r"is missing",
        ):
            mmdata_private_api.new_shared_storage(10)
    finally:
        mmdata_private_api._new_shared.cache_clear()


def test_a_torch_without_shutdown_workers_is_refused_by_name(monkeypatch) -> None:
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", None)
    mmdata_private_api._check_loader_shutdown.cache_clear()
    try:
        with pytest.raises(
            RuntimeError,
            match=rf"torch {re.escape(torch.__version__)}: _MultiProcessingDataLoaderIter._shutdown_workers is missing",
        ):
            mmdata_private_api.stop_loader_workers(object())
    finally:
        mmdata_private_api._check_loader_shutdown.cache_clear()


def test_stop_loader_workers_leaves_other_objects_alone() -> None:
    """A loader without workers (energon's BasicDataLoader, num_workers=0) or another object: nothing to stop."""
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    assert list(loader) and loader._iterator is None
    mmdata_private_api.stop_loader_workers(loader)
    assert loader._iterator is None
