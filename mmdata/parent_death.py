"""A child process that dies with its parent, even when the parent is SIGKILLed (`kill -9`).

Linux can SIGKILL a child when its parent dies (PR_SET_PDEATHSIG); a child asks for it itself.
Shared by the preprocessing job's scan process and the training runtime's helper processes
(`mmtrain/runtime/child_processes.py`). Elsewhere than Linux nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LINUX = sys.platform.startswith("linux")


@functools.cache
def prctl():
    """libc's prctl, looked up before any fork (no dlopen in a child forked from threads)."""
    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when its parent (`parent_pid`) dies; exits at once when
    the parent is already gone. Off Linux, or when the kernel refuses, nothing changes."""
    if not LINUX or prctl()(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # refused: live as before
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)
