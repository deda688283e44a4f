"""The launcher of `mmtrain train RECIPE` (action: run): check what the run will touch
(preflight), take the rendezvous from a SLURM allocation, hold the run_dir, then train in this
process (a world of one, or this process is already one worker under torchrun / srun) or start
this node's workers with torchrun and pass SIGTERM on to them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from mmdata.folder_lock import holds
from mmdata.units import plural
from mmtrain.config import save_resolved
from mmtrain.config.schema import Recipe
from mmtrain.runtime.distributed import env_rank_world
from mmtrain.runtime.preflight import preflight
from mmtrain.runtime.run_dir import RUN_DIR_LOCK_ENV, finished_step, run_dir_lock
from mmtrain.runtime.slurm import slurm_allocation
from mmtrain.runtime.torchrun import torchrun_command
from mmtrain.runtime.training import train
from mmtrain.spec import FamilySpec

log = logging.getLogger(__name__)


def launch(recipe: Recipe, spec: FamilySpec, locks: contextlib.ExitStack, verbose: bool = False) -> int:
    """Train `recipe` (action: run); `locks` holds the run_dir lock until the caller's stack closes
    (auto-tune's --launch took it already for the search)."""
    preflight(recipe, spec)  # before anything is built, spawned or written
    if verbose:
        os.environ["MMTRAIN_VERBOSE"] = "1"  # the workers' third-party warnings too
    use_slurm_allocation(recipe)
    locks.enter_context(run_dir_lock(recipe))  # before anything is written into run_dir
    done = finished_step(recipe)
    if done is not None:  # a rerun of a finished training: nothing to build or spawn
        log.info(
            "%s: already at train.iters=%d (checkpoint iter_%07d); nothing to do (raise train.iters to train on)",
            recipe.run_dir,
            recipe.train.iters,
            done,
        )
        return 0
    inside_launcher = env_rank_world() is not None
    if inside_launcher or recipe.parallel.world_size == 1:
        return train(recipe, spec)
    # Every node's launcher writes this file in the shared run dir and hands it to its workers, so
    # it must be the same on every node: the job's recipe, node_rank left at 0 (each launcher's own
    # goes to torchrun; the workers take theirs from torchrun, not from the file).
    job = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, node_rank=0))
    resolved = save_resolved(job, Path(recipe.run_dir) / "config.yaml")
    return spawn_workers(recipe, resolved)


def use_slurm_allocation(recipe: Recipe) -> None:
    """Inside `srun` (and not already a torchrun worker): take the rendezvous from the
    allocation (mmtrain/runtime/slurm.py), as worker env vars or as this node's launcher settings."""
    slurm = None if "RANK" in os.environ else slurm_allocation(os.environ)
    if slurm is None:
        return
    if slurm.one_task_per_process(recipe.parallel.nproc_per_node):
        os.environ.update(slurm.worker_env())
        how = f"task {slurm.procid} of {slurm.ntasks} is one worker"
    else:
        recipe.parallel = slurm.launcher_settings(recipe.parallel)
        how = f"node {slurm.node_rank} of {slurm.nnodes} starts {recipe.parallel.nproc_per_node} workers"
    log.info("SLURM job %d: %s (rendezvous %s:%d)", slurm.job_id, how, slurm.nodes[0], slurm.master_port)


def spawn_workers(recipe: Recipe, resolved_recipe: Path) -> int:
    """Start this node's workers with torchrun on the resolved recipe; return their exit code."""
    p = recipe.parallel
    cmd = torchrun_command(recipe, resolved_recipe)
    log.info("launching %d worker(s) on this node: %s", p.nproc_per_node, " ".join(cmd))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if holds(recipe.run_dir):
        env[RUN_DIR_LOCK_ENV] = str(Path(recipe.run_dir).resolve())
    with subprocess.Popen(cmd, env=env) as proc:
        with sigterm_to_workers(proc.pid):
            try:
                returncode = proc.wait()
            except BaseException:  # Ctrl-C (it reached the workers too) or an error here: take them down
                proc.kill()
                raise
    if returncode != 0:
        log.error("workers exited with code %d", returncode)
    return returncode


@contextlib.contextmanager
def sigterm_to_workers(torchrun_pid: int) -> Iterator[None]:
    """SIGTERM to this launcher (a scheduler's warning before the time limit, `kill PID`) goes to
    the workers, which finish the step, save a checkpoint and exit 0 (runtime/stopping.py);
    torchrun then ends with them, and so do we, with 0. Sent to torchrun itself, it would stop
    the workers after 30 s and fail the job. Where the workers cannot be found (no /proc), torchrun
    gets it."""

    def forward(signum: int, frame: object) -> None:
        workers = child_pids(torchrun_pid)
        log.warning(
            "SIGTERM: passed to %s; they finish the current step, save a checkpoint and exit",
            plural(len(workers), "worker") if workers else "torchrun",
        )
        for pid in workers or [torchrun_pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid`, from /proc (Linux); [] elsewhere."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return sorted(children)
