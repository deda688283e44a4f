"""A SLURM allocation mapped onto the launcher's settings, so `srun mmtrain FAMILY R.yaml` works
without hand-written rendezvous flags (docs/scale-out.md).

Two ways to run under `srun`, told apart by the tasks per node:
- one task per node (`srun --ntasks-per-node=1`): each task is this node's launcher; it starts
  `parallel.nproc_per_node` workers with torchrun, and `parallel.nnodes`, `node_rank`,
  `master_addr` and `master_port` come from the allocation;
- one task per process (`srun --ntasks-per-node=K`, K > 1, or one task per node when the
  recipe asks for one process per node): each task is one worker; RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torch's env:// names) come from the allocation.

The rendezvous host is the allocation's first node; the port is derived from the job id (the
same on every node, different for two jobs sharing a node) unless MASTER_PORT is set.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmtrain.config.schema import ParallelConfig

_PORT_BASE, _PORT_SPAN = 20000, 20000


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list, expanded in order: `gpu[01-03,07],login1` -> gpu01, gpu02,
    gpu03, gpu07, login1 (zero padding kept; several bracket groups per name expand as a product)."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]+|\[[^\]]*\])+", hostlist):
        names = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if not literal and not ranges:
                continue
            options = [literal]
            if ranges:
                options = []
                for part in ranges.split(","):
                    lo, _, hi = part.partition("-")
                    options += [f"{literal}{n:0{len(lo)}d}" for n in range(int(lo), int(hi or lo) + 1)]
            names = [n + o for n in names for o in options]
        hosts += names
    return hosts


@dataclass(frozen=True)
class SlurmAllocation:
    nodes: list[str]
    node_rank: int  # SLURM_NODEID
    ntasks: int
    procid: int
    localid: int
    job_id: int
    port: int | None  # MASTER_PORT when the user set it

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def tasks_per_node(self) -> int:
        return max(1, self.ntasks // self.nnodes)

    @property
    def master_port(self) -> int:
        return self.port if self.port is not None else _PORT_BASE + self.job_id % _PORT_SPAN

    def one_task_per_process(self, nproc_per_node: int) -> bool:
        return self.tasks_per_node > 1 or nproc_per_node == 1

    def launcher_settings(self, parallel: "ParallelConfig") -> "ParallelConfig":
        """The recipe's `parallel:` for this node's launcher (one task per node)."""
        return replace(
            parallel,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.nodes[0],
            master_port=self.master_port,
        )

    def worker_env(self) -> dict[str, str]:
        """torch's env:// variables for one task = one worker."""
        return {
            "RANK": str(self.procid),
            "WORLD_SIZE": str(self.ntasks),
            "LOCAL_RANK": str(self.localid),
            "MASTER_ADDR": self.nodes[0],
            "MASTER_PORT": str(self.master_port),
        }


def slurm_allocation(env: Mapping[str, str]) -> SlurmAllocation | None:
    """The allocation this process runs in (from srun's environment), or None outside SLURM or
    in a batch script's own shell (no SLURM_PROCID: not started by srun)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if "SLURM_PROCID" not in env or not nodelist:
        return None
    nodes = expand_hostlist(nodelist)
    return SlurmAllocation(
        nodes=nodes,
        node_rank=int(env.get("SLURM_NODEID", "0")),
        ntasks=int(env.get("SLURM_NTASKS", str(len(nodes)))),
        procid=int(env["SLURM_PROCID"]),
        localid=int(env.get("SLURM_LOCALID", "0")),
        job_id=int(env.get("SLURM_JOB_ID", "0")),
        port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
    )
