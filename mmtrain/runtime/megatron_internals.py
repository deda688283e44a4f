"""The one private megatron-core name mmtrain uses, next to the version it was tested with.

megatron's torch_dist checkpoint writer collects its workers' results through a queue it keeps
in `megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue` (created at the
first save by `_get_write_results_queue()`, from a `spawn` multiprocessing manager that megatron
never stops). `child_processes.install_writer_results_queue` puts its own queue there, from a
manager that dies with the training process, so a SIGKILLed trainer leaves nothing behind.
megatron has no public way to pass that queue, so the name is used only here, and only for the
minor version pyproject.toml pins (megatron-core>=0.16,<0.17): `require_tested_megatron()`
refuses any other, naming it, and tests/test_megatron_internals.py fails when megatron renames
or stops reading the name.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

TESTED_MEGATRON = "0.16"  # the minor version pyproject.toml pins and CI runs
RESULTS_QUEUE = "_results_queue"  # filesystem_async's module-level queue (see the module docstring)


def require_tested_megatron(installed: str | None = None) -> None:
    """Raise RuntimeError, naming the installed version, unless megatron-core is the tested minor
    version. `installed`: the version to judge (default: the installed distribution's)."""
    version = installed if installed is not None else metadata.version("megatron-core")
    if version.split(".")[:2] != TESTED_MEGATRON.split("."):
        major, minor = TESTED_MEGATRON.split(".")
        raise RuntimeError(f"megatron-core {version} is installed, but mmtrain sets megatron's private "
                           f"filesystem_async.{RESULTS_QUEUE} as megatron-core {TESTED_MEGATRON}.x keeps it: "
                           f"install 'megatron-core>={TESTED_MEGATRON},<{major}.{int(minor) + 1}'")


def filesystem_async_module() -> Any:
    """megatron's filesystem_async module, once the version and the name are checked."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    require_tested_megatron()
    if not hasattr(filesystem_async, RESULTS_QUEUE):
        raise RuntimeError(f"megatron-core {metadata.version('megatron-core')}: filesystem_async has no "
                           f"{RESULTS_QUEUE} (mmtrain/runtime/megatron_internals.py needs updating)")
    return filesystem_async


def writer_results_queue() -> Any:
    """The queue megatron's torch_dist writer will use (None until its first save)."""
    return getattr(filesystem_async_module(), RESULTS_QUEUE)


def set_writer_results_queue(queue: Any) -> None:
    """Make `queue` the one megatron's torch_dist writer uses from its next save on."""
    setattr(filesystem_async_module(), RESULTS_QUEUE, queue)
