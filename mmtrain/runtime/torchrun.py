"""The torchrun command line that starts a node's workers: the launcher's, and auto-tune's trials
(mmtrain/planning/trials.py) without importing the launcher; and the world a foreign torchrun
gave this process (light: `mmtrain train` reads it before it knows whether it will train)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mmtrain.config.schema import Recipe


def torchrun_command(recipe: Recipe, resolved_recipe: Path) -> list[str]:
    """The torchrun command line that starts this node's workers (also auto-tune's trials)."""
    p = recipe.parallel
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={p.nproc_per_node}",
        f"--nnodes={p.nnodes}",
        f"--node_rank={p.node_rank}",
        f"--master_addr={p.master_addr}",
        f"--master_port={p.master_port}",
        "-m", "mmtrain.runtime.worker", str(resolved_recipe),
    ]  # fmt: skip


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
