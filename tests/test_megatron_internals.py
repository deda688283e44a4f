"""The private megatron-core name mmtrain uses (`filesystem_async._results_queue`, set by
runtime/child_processes.py) is gated by version, and this file fails when megatron changes it:
renames it, or stops taking its writer's queue from it."""

from __future__ import annotations

import queue
import re
from importlib import metadata

import pytest

from mmtrain.runtime import megatron_internals

pytestmark = pytest.mark.unit


def test_the_installed_megatron_is_the_tested_minor_version() -> None:
    assert metadata.version("megatron-core").startswith(megatron_internals.TESTED_MEGATRON + ".")
    megatron_internals.require_tested_megatron()


@pytest.mark.parametrize("other", ["0.17.0", "0.15.3", "1.0.0rc1"])
def test_another_megatron_is_refused_by_name(other: str) -> None:
    with pytest.raises(RuntimeError, match=rf"megatron-core {re.escape(other)} is installed.*"
                                           r"megatron-core>=0\.16,<0\.17"):
        megatron_internals.require_tested_megatron(other)


def test_megatron_keeps_the_writer_queue_where_mmtrain_sets_it() -> None:
    """megatron still has the module-level name, still starts empty (None: made at the first
    save), and its writer's queue getter returns whatever is stored there."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert hasattr(filesystem_async, megatron_internals.RESULTS_QUEUE)
    before = megatron_internals.writer_results_queue()
    ours = queue.Queue()
    try:
        megatron_internals.set_writer_results_queue(ours)
        assert filesystem_async._get_write_results_queue() is ours
    finally:
        megatron_internals.set_writer_results_queue(before)


def test_a_megatron_without_the_name_is_refused(monkeypatch) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.delattr(filesystem_async, megatron_internals.RESULTS_QUEUE)
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.16\.\d+: filesystem_async has no _results_queue"):
        megatron_internals.writer_results_queue()
