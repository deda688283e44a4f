"""Who holds a run_dir, and whether its run is finished: shared by the launcher (which takes the
lock before it spawns workers) and the worker entry (which takes it when no launcher of ours did)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mmdata.folder_lock import FolderLock
from mmtrain.config.schema import Recipe
from mmtrain.runtime.checkpoint.layout import iteration_of, latest_checkpoint
from mmtrain.runtime.distributed import env_rank_world

#: set by a launcher holding the run_dir lock for the workers it starts (their rank 0 then does
#: not take it again): the run_dir, resolved
RUN_DIR_LOCK_ENV = "MMTRAIN_RUN_DIR_LOCKED"


def run_dir_lock(recipe: Recipe) -> contextlib.AbstractContextManager:
    """One job per run_dir (mmdata/folder_lock.py): a second job exits 2 naming the first.
    The process that owns the run takes it: a launcher started by hand on node 0 (one per job),
    or, inside a launcher that is not ours (torchrun, srun with one task per process), the
    worker of rank 0. Workers of our own launcher find it held (RUN_DIR_LOCK_ENV) and take
    nothing, so the ranks of one job never compete for it."""
    run_dir = Path(recipe.run_dir).resolve()
    rank_world = env_rank_world()
    if rank_world is None:
        owner = recipe.parallel.node_rank == 0
    else:
        owner = rank_world[0] == 0 and os.environ.get(RUN_DIR_LOCK_ENV) != str(run_dir)
    return FolderLock(run_dir, "run_dir") if owner else contextlib.nullcontext()


def finished_step(recipe: Recipe) -> int | None:
    """The step of the run's own latest checkpoint (what a rerun resumes) when it has reached
    train.iters already, else None."""
    latest = latest_checkpoint(recipe.run_dir)
    step = iteration_of(latest) if latest is not None else None
    return step if step is not None and step >= recipe.train.iters else None
