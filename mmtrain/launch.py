"""Train (or dry-run / auto-tune) a model family from a YAML recipe.

  mmtrain llava-ov RECIPE [a.b.c=value ...]

The recipe is validated, overrides applied, and the resolved copy written to
`<run_dir>/config.yaml`. Then, by `action:`:
  run       - train. Inside torchrun (RANK/WORLD_SIZE set) or a SLURM step with one task per
              process (SLURM_PROCID/SLURM_NTASKS), this process is one worker. Otherwise, when
              parallel.nproc_per_node x parallel.nnodes > 1, the workers are started here with
              torchrun (run the same command on every node with its parallel.node_rank=K) and
              the launcher returns their exit code; a world of one trains in this process.
  dry_run   - print parameter counts and the per-rank memory estimate (mmtrain.dry_run)
  auto_tune - search parallel layouts for the recipe (mmtrain.auto_tune)
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("mmtrain.launch")


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("recipe", help="YAML recipe (see recipes/ and docs/recipes.md)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. train.iters=10"
    )
    parser.set_defaults(family=name)


def run(args: argparse.Namespace) -> int:
    from mmtrain.recipe import RecipeError, load_recipe, save_resolved

    setup_logging()
    try:
        recipe = load_recipe(args.recipe, args.overrides, family=args.family)
    except RecipeError as err:
        print(err, file=sys.stderr)
        return 2
    if recipe.action == "dry_run":
        from mmtrain import dry_run

        dry_run.run_dry_run(recipe)  # prints the report
        return 0
    if recipe.action == "auto_tune":
        from mmtrain import auto_tune

        auto_tune.run_auto_tune(recipe)  # prints the table and the best layout
        return 0

    from mmtrain.distributed import env_rank_world

    inside_launcher = env_rank_world() is not None
    world = recipe.parallel.nproc_per_node * recipe.parallel.nnodes
    if inside_launcher or world == 1:
        return train(recipe)
    resolved = save_resolved(recipe, Path(recipe.run_dir) / "config.yaml")
    return spawn_workers(recipe, resolved)


def spawn_workers(recipe: Any, resolved_recipe: Path) -> int:
    """Start this node's workers with torchrun on the resolved recipe; return their exit code."""
    p = recipe.parallel
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={p.nproc_per_node}",
        f"--nnodes={p.nnodes}",
        f"--node_rank={p.node_rank}",
        f"--master_addr={p.master_addr}",
        f"--master_port={p.master_port}",
        "-m", "mmtrain.train_entry", str(resolved_recipe),
    ]  # fmt: skip
    log.info("launching %d worker(s) on this node: %s", p.nproc_per_node, " ".join(cmd))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        log.error("workers exited with code %d", proc.returncode)
    return proc.returncode


def train(recipe: Any) -> int:
    """Train in this process (one worker of a distributed job, or the whole job)."""
    from mmtrain.distributed import destroy_distributed, init_distributed
    from mmtrain.model_spec import get_model_spec
    from mmtrain.recipe import dump_recipe, save_resolved
    from mmtrain.train_loop import Trainer

    ctx = init_distributed(recipe.parallel, seed=int(recipe.seed))
    setup_logging(ctx.rank, verbose=ctx.rank == 0 or ctx.is_logging_rank)
    try:
        if ctx.rank == 0:
            save_resolved(recipe, Path(recipe.run_dir) / "config.yaml")
        spec = get_model_spec(recipe.family)
        trainer = Trainer(recipe, spec, ctx, dump_recipe(recipe))
        trainer.setup()
        trainer.fit()
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
