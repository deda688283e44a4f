"""Stopping a run early and cleanly: SIGTERM (a scheduler's warning before the time limit, a
preemption), `train.exit_interval` steps and `train.exit_duration_mins` of wall time.

The train loop asks `due(step)` after each step; the run then saves a checkpoint and exits 0,
and rerunning the same recipe resumes exactly. SIGTERM only sets a flag, so a step or a
checkpoint save in progress is never cut. Ranks may see the signal or the clock at different
moments, so the verdict is one MAX all-reduce over the world: every rank stops after the
same step (otherwise some would wait forever in the next step's collectives).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# The verdicts as numbers for the all-reduce (higher wins when ranks disagree), and their words.
_REASONS = {1: "train.exit_interval reached", 2: "train.exit_duration_mins reached", 3: "SIGTERM received"}


class StopRequests:
    def __init__(self, exit_interval: int = 0, exit_duration_mins: float = 0.0) -> None:
        self.exit_interval = exit_interval
        self.deadline = time.monotonic() + exit_duration_mins * 60 if exit_duration_mins > 0 else None
        self.sigterm = False

    @contextlib.contextmanager
    def catching_sigterm(self) -> Iterator[None]:
        """SIGTERM sets the flag instead of killing the process (main thread only: signals are
        delivered there; elsewhere, e.g. a test calling fit() in a thread, it is left alone)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigterm(signum: int, frame: object) -> None:
            if not self.sigterm:
                log.warning("SIGTERM received: finishing the current step, then saving a checkpoint and exiting")
            self.sigterm = True

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def local_verdict(self, step: int) -> int:
        if self.sigterm:
            return 3
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return 2
        if self.exit_interval > 0 and step % self.exit_interval == 0:
            return 1
        return 0

    def due(self, step: int, device: torch.device) -> Optional[str]:
        """Why the run stops after `step` (the same on every rank), or None. Collective."""
        verdict = self.local_verdict(step)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([verdict], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            verdict = int(flag.item())
        return _REASONS.get(verdict)
