"""Nothing a training process starts outlives it, even when it is SIGKILLed (`kill -9 PID`).

Two kinds of helper processes stayed behind for good after a bare SIGKILL:
- megatron's torch_dist writer forks one writer per bucket at every save; killed mid-save, a
  writer waits forever on a queue condition only the dead parent could signal;
- the same writer collects results through a `multiprocessing` manager (spawned at the first save,
  kept for the process's life), and with it stays
  multiprocessing's resource tracker (which lives while any process holds its pipe).

Linux can SIGKILL a child when its parent dies (PR_SET_PDEATHSIG, `mmdata/parent_death.py`). Forked children ask for it
in an at-fork hook; the manager is started here, the way megatron starts it, with the request
in its initializer, and megatron is handed its queue before its first save (through the one
private megatron name mmtrain uses, gated by version in `mmtrain/private_api.py`).

PR_SET_PDEATHSIG fires when the *thread* that started the child ends, so only children started
from the main thread ask for it; elsewhere, and off Linux, nothing changes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from multiprocessing.managers import SyncManager

from mmdata.parent_death import LINUX, die_with_parent, prctl
from mmtrain import private_api

_manager: SyncManager | None = None  # kept alive with its queue
_fork_hook_installed = False
_forking_parent: int | None = None  # set in the parent just before a fork from its main thread


def _before_fork() -> None:
    global _forking_parent
    _forking_parent = os.getpid() if threading.current_thread() is threading.main_thread() else None


def _after_fork_in_child() -> None:
    if _forking_parent is not None:
        die_with_parent(_forking_parent)


def forked_children_die_with_this_process() -> None:
    """From now on, every process forked from this one's main thread dies with it."""
    global _fork_hook_installed
    if LINUX and not _fork_hook_installed:
        prctl()
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def install_writer_results_queue() -> bool:
    """Give megatron's torch_dist writer a result queue whose manager dies with this process;
    call before `dist_checkpointing.save`. Returns whether this process now uses it."""
    global _manager
    if _manager is not None:
        return True
    if (
        not LINUX
        or threading.current_thread() is not threading.main_thread()
        or private_api.writer_results_queue() is not None
    ):
        return False  # elsewhere, or megatron already has its queue
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    private_api.set_writer_results_queue(manager.Queue())
    _manager = manager
    return True
