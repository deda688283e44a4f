"""Train (or dry-run / auto-tune) a model family from a YAML recipe.

  mmtrain FAMILY RECIPE [a.b.c=value ...]

The recipe is validated, overrides applied, and the resolved copy written to
`<run_dir>/config.yaml`. Then, by `action:`:
  run       - train. Inside torchrun (RANK/WORLD_SIZE set) or a SLURM step with one task per
              process (SLURM_PROCID/SLURM_NTASKS), this process is one worker. Otherwise, when
              parallel.nproc_per_node x parallel.nnodes > 1, the workers are started here with
              torchrun (run the same command on every node with its parallel.node_rank=K) and
              the launcher returns their exit code; a world of one trains in this process.
  dry_run   - print parameter counts and the per-rank memory estimate (mmtrain/planning/dry_run.py)
  auto_tune - search parallel layouts for the recipe (mmtrain/planning/auto_tune.py); exits 1
              when no layout fits
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from mmtrain.config import Recipe

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (see recipes/ and docs/recipes.md)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. train.iters=10"
    )


def run(args: argparse.Namespace, family: str) -> int:
    from mmtrain import registry
    from mmtrain.config import RecipeError, load_recipe, save_resolved

    setup_logging()
    try:
        recipe = load_recipe(args.recipe, args.overrides, family=family)
    except RecipeError as err:
        print(err, file=sys.stderr)
        return 2
    spec = registry.get_family(recipe.family)
    if recipe.action == "dry_run":
        from mmtrain.planning.dry_run import run_dry_run

        run_dry_run(recipe, spec)  # prints the report
        return 0
    if recipe.action == "auto_tune":
        from mmtrain.planning.auto_tune import run_auto_tune

        return run_auto_tune(recipe, spec).exit_code  # prints the table and the best layout

    from mmtrain.runtime.distributed import env_rank_world

    inside_launcher = env_rank_world() is not None
    if inside_launcher or recipe.parallel.world_size == 1:
        return train(recipe)
    resolved = save_resolved(recipe, Path(recipe.run_dir) / "config.yaml")
    return spawn_workers(recipe, resolved)


def spawn_workers(recipe: Recipe, resolved_recipe: Path) -> int:
    """Start this node's workers with torchrun on the resolved recipe; return their exit code."""
    p = recipe.parallel
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={p.nproc_per_node}",
        f"--nnodes={p.nnodes}",
        f"--node_rank={p.node_rank}",
        f"--master_addr={p.master_addr}",
        f"--master_port={p.master_port}",
        "-m", "mmtrain.runtime.worker", str(resolved_recipe),
    ]  # fmt: skip
    log.info("launching %d worker(s) on this node: %s", p.nproc_per_node, " ".join(cmd))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        log.error("workers exited with code %d", proc.returncode)
    return proc.returncode


def train(recipe: Recipe) -> int:
    """Train in this process (one worker of a distributed job, or the whole job). A starting
    checkpoint that does not fit the recipe is a user error: one line, exit code 2."""
    from mmtrain import registry
    from mmtrain.config import dump_recipe, save_resolved
    from mmtrain.models.state_dict_adapter import ConversionError
    from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError
    from mmtrain.runtime.distributed import UnsupportedLayout, destroy_distributed, init_distributed
    from mmtrain.runtime.trainer import Trainer

    try:
        ctx = init_distributed(recipe.parallel, seed=recipe.seed)
    except UnsupportedLayout as err:
        print(f"mmtrain: {err}", file=sys.stderr)
        destroy_distributed()
        return 2
    setup_logging(ctx.rank, verbose=ctx.rank == 0 or ctx.is_logging_rank)
    try:
        if ctx.rank == 0:
            save_resolved(recipe, Path(recipe.run_dir) / "config.yaml")
        trainer = Trainer(recipe, registry.get_family(recipe.family), ctx, dump_recipe(recipe))
        trainer.setup()
        trainer.fit()
    except (CheckpointMismatchError, ConversionError, UnsupportedLayout) as err:
        print(f"mmtrain: {err}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return 0


def setup_logging(rank: int | None = None, verbose: bool = True) -> None:
    """INFO logs on the ranks that matter (rank 0, and the one holding the loss), warnings
    everywhere (MMTRAIN_LOG_ALL_RANKS=1: INFO everywhere)."""
    prefix = f"[rank {rank}] " if rank is not None else ""
    level = logging.INFO if (verbose or os.environ.get("MMTRAIN_LOG_ALL_RANKS")) else logging.WARNING
    root = logging.getLogger()
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(name)s %(levelname)s: %(message)s", "%H:%M:%S")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        root.addHandler(handler)
    for handler in root.handlers:
        handler.setFormatter(fmt)
    root.setLevel(logging.WARNING)
    logging.getLogger("mmtrain").setLevel(level)
