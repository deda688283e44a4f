"""Train (or dry-run / auto-tune) a FAMILY model from a YAML recipe (keys: docs/recipes.md).

  mmtrain FAMILY RECIPE [a.b.c=value ...]        e.g. train.iters=100 "data.paths=[/data/s2]"
  mmtrain FAMILY RECIPE --print-config           the resolved recipe, nothing run

The recipe is validated (every problem at once, each naming its key) and the overrides applied
(written `a.b.c=value`, without dashes). Then, by `action:`:
  run          - check what the run will touch (data paths, tokenizer, the run dir's
                 checkpoints: mmtrain/runtime/preflight.py), write the resolved recipe to
                 `<run_dir>/config.yaml` (absolute paths) and train. Inside torchrun
                 (RANK/WORLD_SIZE set) or a SLURM step with one task per process, this process
                 is one worker (srun: the rendezvous comes from the allocation, see
                 mmtrain/runtime/slurm.py). Otherwise, when parallel.nproc_per_node x parallel.nnodes > 1,
                 the workers are started here with torchrun (run the same command on every node
                 with its parallel.node_rank=K); a world of one trains in this process.
  dry_run      - print parameter counts and the per-rank memory estimate (nothing is built)
  auto_tune    - search parallel layouts: prune with the cost model, run short trials of the real
                 job on the survivors, write run_dir/auto_tune/{history.csv,best.yaml};
                 exits 1 when no layout fits or none ran (--launch: then train best.yaml)
  print_config - print the resolved recipe (as --print-config) and exit

Exit status: 0 done, 2 a problem with the recipe or what it points at (one message, nothing
written), 130 interrupted, 1 an unexpected error (its traceback in a log file, or on stderr
with --verbose).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from mmdata.units import plural
from mmtrain.config import Recipe
from mmtrain.runtime.torchrun import torchrun_command

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="YAML recipe (see recipes/ and docs/recipes.md)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides, e.g. train.iters=10 (no leading dashes); a value is YAML")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved recipe (stage, overrides and defaults applied) and exit; "
                             "the same as action=print_config")
    parser.add_argument("--launch", action="store_true",
                        help="with action=auto_tune: train the best layout (run_dir/auto_tune/best.yaml) right "
                             "after the search")


def run(args: argparse.Namespace, family: str) -> int:
    from mmdata.errors import UserError
    from mmtrain import registry
    from mmtrain.config import dump_recipe, load_recipe, save_resolved

    verbose = bool(getattr(args, "verbose", False))
    setup_logging(verbose_third_party=verbose)
    recipe_path = Path(args.recipe)
    if not recipe_path.is_file():
        raise UserError(f"recipe {args.recipe} {'is a folder' if recipe_path.exists() else 'does not exist'}; "
                        "give a YAML recipe file (see recipes/)")
    overrides = [*args.overrides, *(["action=print_config"] if args.print_config else []), *launcher_world()]
    recipe = load_recipe(recipe_path, overrides, family=family)
    spec = registry.get_family(recipe.family)
    if recipe.action == "print_config":
        print(dump_recipe(recipe), end="")
        return 0
    if recipe.action == "dry_run":
        from mmtrain.planning.dry_run import run_dry_run

        run_dry_run(recipe, spec)  # prints the report
        return 0
    with contextlib.ExitStack() as locks:
        if recipe.action == "auto_tune":
            from mmtrain.planning.auto_tune import run_auto_tune

            locks.enter_context(run_dir_lock(recipe))  # its trials and results live in run_dir
            result = run_auto_tune(recipe, spec)  # prints the summary and the best layout
            if result.exit_code or not getattr(args, "launch", False):
                return result.exit_code
            # (type checker: exit code 0 means a recipe was written)
            recipe = load_recipe(result.recipe_path, family=family)  # type: ignore[arg-type]
            log.info("--launch: training the best layout, %s", result.recipe_path)
        elif getattr(args, "launch", False):
            raise UserError("--launch goes with action=auto_tune (it trains the layout the search found best)")

        from mmtrain.runtime.distributed import env_rank_world
        from mmtrain.runtime.preflight import preflight

        preflight(recipe, spec)  # before anything is built, spawned or written
        if verbose:
            os.environ["MMTRAIN_VERBOSE"] = "1"  # the workers' third-party warnings too
        use_slurm_allocation(recipe)
        locks.enter_context(run_dir_lock(recipe))  # before anything is written into run_dir
        done = finished_step(recipe)
        if done is not None:  # a rerun of a finished training: nothing to build or spawn
            log.info("%s: already at train.iters=%d (checkpoint iter_%07d); nothing to do (raise train.iters to "
                     "train on)", recipe.run_dir, recipe.train.iters, done)
            return 0
        inside_launcher = env_rank_world() is not None
        if inside_launcher or recipe.parallel.world_size == 1:
            return train(recipe)
        # Every node's launcher writes this file in the shared run dir and hands it to its workers, so
        # it must be the same on every node: the job's recipe, node_rank left at 0 (each launcher's own
        # goes to torchrun; the workers take theirs from torchrun, not from the file).
        job = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, node_rank=0))
        resolved = save_resolved(job, Path(recipe.run_dir) / "config.yaml")
        return spawn_workers(recipe, resolved)


#: set by a launcher holding the run_dir lock for the workers it starts (their rank 0 then does
#: not take it again): the run_dir, resolved
RUN_DIR_LOCK_ENV = "MMTRAIN_RUN_DIR_LOCKED"


def run_dir_lock(recipe: Recipe) -> contextlib.AbstractContextManager:
    """One job per run_dir (mmdata/folder_lock.py): a second job exits 2 naming the first.
    The process that owns the run takes it: a launcher started by hand on node 0 (one per job),
    or, inside a launcher that is not ours (torchrun, srun with one task per process), the
    worker of rank 0. Workers of our own launcher find it held (RUN_DIR_LOCK_ENV) and take
    nothing, so the ranks of one job never compete for it."""
    from mmdata.folder_lock import FolderLock
    from mmtrain.runtime.distributed import env_rank_world

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
    from mmtrain.runtime.checkpoint.layout import iteration_of, latest_checkpoint

    latest = latest_checkpoint(recipe.run_dir)
    step = iteration_of(latest) if latest is not None else None
    return step if step is not None and step >= recipe.train.iters else None


def launcher_world(environ: dict[str, str] | None = None) -> list[str]:
    """Inside a launcher that is not ours (`torchrun --nproc_per_node 2 mmtrain ...`), its world
    decides: the overrides `parallel.nproc_per_node` and `parallel.nnodes` from torchrun's
    WORLD_SIZE and LOCAL_WORLD_SIZE (applied last, so the recipe need not repeat what the launcher
    was told). Empty when this process was started by hand or by srun."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return []
    world = int(env["WORLD_SIZE"])
    per_node = int(env.get("LOCAL_WORLD_SIZE", world))
    if per_node <= 0 or world % per_node:
        return []
    return [f"parallel.nproc_per_node={per_node}", f"parallel.nnodes={world // per_node}"]


def use_slurm_allocation(recipe: Recipe) -> None:
    """Inside `srun` (and not already a torchrun worker): take the rendezvous from the
    allocation (mmtrain/runtime/slurm.py), as worker env vars or as this node's launcher settings."""
    from mmtrain.runtime.slurm import slurm_allocation

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
    from mmdata.folder_lock import holds

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
        log.warning("SIGTERM: passed to %s; they finish the current step, save a checkpoint and exit",
                    plural(len(workers), "worker") if workers else "torchrun")
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


def train(recipe: Recipe) -> int:
    """Train in this process (one worker of a distributed job, or the whole job). A starting
    checkpoint that does not fit the recipe is a user error: one line, exit code 2. The
    run_dir is held for the whole run (`run_dir_lock`)."""
    with run_dir_lock(recipe):  # (a no-op where the launcher of this process holds it)
        return _train(recipe)


def _train(recipe: Recipe) -> int:
    from mmdata.errors import UserError
    from mmtrain import registry
    from mmtrain.config import dump_recipe, save_resolved
    from mmtrain.models.state_dict_adapter import ConversionError
    from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError
    from mmtrain.runtime.child_processes import forked_children_die_with_this_process
    from mmtrain.runtime.cuda_settings import apply_process_env, apply_torch_flags, torch_flags
    from mmtrain.runtime.distributed import UnsupportedLayout, destroy_distributed, init_distributed
    from mmtrain.runtime.trainer import Trainer

    forked_children_die_with_this_process()  # loader workers, checkpoint writers: not even after kill -9
    apply_process_env(recipe.parallel.tp, recipe.train.deterministic)  # before CUDA starts
    try:
        ctx = init_distributed(recipe.parallel, seed=recipe.seed)
    except UnsupportedLayout as err:
        destroy_distributed()
        raise UserError(str(err)) from None
    apply_torch_flags(torch_flags(ctx.on_cuda, ctx.precision, recipe.train.deterministic))
    setup_logging(ctx.rank, verbose=ctx.rank == 0 or ctx.is_logging_rank)
    try:
        if ctx.rank == 0:
            config = save_resolved(recipe, Path(recipe.run_dir) / "config.yaml")
            keep_tokenizer(recipe)
            announce(recipe, config)
        trainer = Trainer(recipe, registry.get_family(recipe.family), ctx, dump_recipe(recipe))
        trainer.setup()
        trainer.fit()
    except (CheckpointMismatchError, ConversionError) as err:
        raise UserError(str(err)) from None
    finally:
        destroy_distributed()
    return 0


def keep_tokenizer(recipe: Recipe) -> Path:
    """The run's tokenizer, as its loader resolves it (the family's added tokens included), next
    to its checkpoints (`checkpoints/hf_assets/`): `mmtrain convert mcore-to-hf` exports it with the
    weights, so transformers and `mmtrain generate` load the vocabulary the model was trained on."""
    from mmdata.local_tokenizer import load_local_tokenizer
    from mmtrain import registry
    from mmtrain.runtime.checkpoint.layout import checkpoints_root
    from mmtrain.runtime.hf_conversion import ASSETS_DIR

    # (type checker: load_local_tokenizer names a missing path itself)
    tokenizer = load_local_tokenizer(recipe.tokenizer.path, "tokenizer.path:")  # type: ignore[arg-type]
    prepare = registry.get_family(recipe.family).prepare_tokenizer
    if prepare is not None:
        prepare(tokenizer)
    out = checkpoints_root(recipe.run_dir) / ASSETS_DIR
    tokenizer.save_pretrained(str(out))
    return out


def announce(recipe: Recipe, config: Path) -> None:
    """Where this run's outputs go, said once at the start."""
    from mmtrain.runtime.metrics import METRICS_FILE

    run_dir = Path(recipe.run_dir).resolve()
    c = recipe.checkpoint
    every = f"every {c.interval} steps and at the end" if c.interval > 0 else "at the end"
    keep = f", keeping the last {c.keep_last}" if c.keep_last > 0 else ""
    checkpoints = f"checkpoints {run_dir / 'checkpoints'}/ ({every}{keep})" if c.save else \
        "no checkpoints (checkpoint.save: false)"
    log.info("run_dir %s: metrics %s, %s, resolved recipe %s", run_dir, run_dir / METRICS_FILE, checkpoints,
             config.resolve())


def setup_logging(rank: int | None = None, verbose: bool = True, verbose_third_party: bool | None = None) -> None:
    """INFO logs on the ranks that matter (rank 0, and the one holding the loss), warnings
    everywhere (MMTRAIN_LOG_ALL_RANKS=1: INFO everywhere). Third-party noise (megatron's and
    torch's warnings about optional packages, energon's "Filling reading buffer" bars) is
    silenced unless --verbose (MMTRAIN_VERBOSE=1 in the workers)."""
    if verbose_third_party is None:
        verbose_third_party = os.environ.get("MMTRAIN_VERBOSE") == "1"
    if not verbose_third_party:
        quiet_third_party()
    prefix = f"[rank {rank}] " if rank is not None else ""
    level = logging.INFO if (verbose or os.environ.get("MMTRAIN_LOG_ALL_RANKS")) else logging.WARNING
    root = logging.getLogger()
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(name)s %(levelname)s: %(message)s", "%H:%M:%S")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        root.addHandler(handler)
    # (type checker: the loop rebinds the name to every root handler)
    for handler in root.handlers:  # type: ignore[assignment]
        handler.setFormatter(fmt)
    root.setLevel(logging.WARNING)
    logging.getLogger("mmtrain").setLevel(level)


#: modules whose warnings are not the user's business by default (optional accelerators absent,
#: deprecations inside megatron, pin_memory without a GPU)
THIRD_PARTY_WARNINGS = r"(megatron|torch|transformers|apex|transformer_engine|tensorboard)(\.|$)"


def quiet_third_party() -> None:
    """Hide third-party warnings and progress bars (inherited by loader workers)."""
    import warnings

    os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm at import (energon's packing buffer bar)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY_WARNINGS)
