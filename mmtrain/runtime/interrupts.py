"""What a Ctrl-C of a training says, wherever it lands: while the run starts, in a step, or in
the middle of a checkpoint save (which leaves `checkpoints/.staging/iter_N`, removed at the next
start by the checkpoint manager). One line on rank 0: which step the last complete checkpoint
holds and that the same command resumes from it. The interrupt itself still ends the run (exit
130, mmdata/errors.py)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

from mmtrain.runtime.checkpoint.layout import iteration_of, latest_checkpoint

log = logging.getLogger(__name__)


def resume_hint(run_dir: str | os.PathLike, where: str) -> str:
    """ "interrupted WHERE: the last checkpoint holds step N (PATH); run the same command again to
    resume from it", read from what is on disk (a save may have just ended)."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return (
            f"interrupted {where} before any checkpoint of this run was saved; the same command starts again "
            "from its starting point"
        )
    return (
        f"interrupted {where}: the last checkpoint holds step {iteration_of(latest)} ({latest}); run the same "
        "command again to resume from it"
    )


@contextlib.contextmanager
def saying_where_to_resume(run_dir: str | os.PathLike, where: Callable[[], str], say: bool) -> Iterator[None]:
    """Around a whole training process: on Ctrl-C, log `resume_hint` (when `say`: rank 0) with
    `where()` (e.g. "in step 3/10", "while saving the checkpoint of step 2/10"), then re-raise."""
    try:
        yield
    except KeyboardInterrupt:
        if say:
            log.warning("%s", resume_hint(run_dir, where()))
        raise
