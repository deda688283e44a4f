"""The torchrun command line that starts a node's workers: the launcher and auto-tune's trials
both run it, so it lives apart from the launcher (planning imports it without importing launch)."""

from __future__ import annotations

import sys
from pathlib import Path

from mmtrain.config import Recipe


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
