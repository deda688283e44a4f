"""Process-group and model-parallel set-up shared by every model family.

One call, `init_distributed(parallel_cfg)`, turns the recipe's `parallel:` section plus the
torchrun/SLURM environment into an initialised `torch.distributed` world (gloo on CPU, NCCL on
GPU), megatron-core's `parallel_state` (TP x PP x DP groups) and a small `ParallelContext` that
model builders and the train loop read instead of poking at globals.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mmtrain import device as device_layer

log = logging.getLogger("mmtrain.distributed")


@dataclass
class ParallelContext:
    """Where this process sits in the TP x PP x DP grid, and the knobs the model needs."""

    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    backend: str  # "gloo" | "nccl"
    device: torch.device
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    precision: str = "fp32"  # fp32 | bf16 | fp16
    distributed_optimizer: bool = False

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints step logs: last PP stage (it has the loss), TP rank 0, DP rank 0."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0

    @property
    def params_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            self.precision
        ]


def env_rank_world() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun (RANK/WORLD_SIZE) or SLURM (SLURM_PROCID),
    or None when this process was started by hand (single process)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", "0")),
        )
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return (
            int(os.environ["SLURM_PROCID"]),
            int(os.environ["SLURM_NTASKS"]),
            int(os.environ.get("SLURM_LOCALID", "0")),
        )
    return None


def resolve_backend(requested: str) -> str:
    if requested in ("gloo", "nccl"):
        if requested == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("parallel.backend=nccl but CUDA is not available")
        return requested
    if requested != "auto":
        raise ValueError(f"parallel.backend must be auto|gloo|nccl, got {requested!r}")
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_layout(world_size: int, tp: int, pp: int) -> int:
    """DP size for a world of `world_size` processes, or a clear error."""
    if tp < 1 or pp < 1:
        raise ValueError(f"parallel.tp and parallel.pp must be >= 1 (got tp={tp}, pp={pp})")
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} (nproc_per_node x nnodes) is not divisible by "
            f"tp x pp = {tp} x {pp}"
        )
    return world_size // (tp * pp)


def init_distributed(parallel_cfg: Any, seed: int) -> ParallelContext:
    """Initialise torch.distributed + megatron parallel_state from the recipe's `parallel:`.

    Works the same for a single process (a world of one, so megatron's groups exist and every
    code path is the distributed one) and for torchrun/SLURM workers.
    """
    from megatron.core import parallel_state

    device_layer.enable_runtime_cpu_compat()
    env = env_rank_world()
    if env is None:
        rank, world_size, local_rank = 0, 1, 0
        os.environ.setdefault("MASTER_ADDR", str(parallel_cfg.master_addr))
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    else:
        rank, world_size, local_rank = env
        # SLURM launches: torch's env:// init needs these names.
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        os.environ.setdefault("MASTER_ADDR", str(parallel_cfg.master_addr))
        os.environ.setdefault("MASTER_PORT", str(parallel_cfg.master_port))

    expected = int(parallel_cfg.nproc_per_node) * int(parallel_cfg.nnodes)
    if env is not None and world_size != expected:
        log.warning(
            "the launcher started %d processes but the recipe says nproc_per_node x nnodes = %d; "
            "using the launcher's world size (DP adapts)", world_size, expected,
        )  # fmt: skip
    tp, pp = int(parallel_cfg.tp), int(parallel_cfg.pp)
    dp = check_layout(world_size, tp, pp)
    backend = resolve_backend(str(getattr(parallel_cfg, "backend", "auto")))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("MMTRAIN_CPU_THREADS", "1")))

    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=30),
            **({"device_id": device} if backend == "nccl" else {}),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )

    precision = str(getattr(parallel_cfg, "precision", "fp32"))
    ctx = ParallelContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        tp=tp,
        pp=pp,
        dp=dp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        backend=backend,
        device=device,
        sequence_parallel=bool(getattr(parallel_cfg, "sequence_parallel", False)) and tp > 1,
        recompute=str(getattr(parallel_cfg, "recompute", "none")),
        precision=precision,
        distributed_optimizer=bool(getattr(parallel_cfg, "distributed_optimizer", False))
        and backend == "nccl",
    )
    if device.type == "cpu" and precision != "fp32":
        log.warning("precision=%s requested on CPU; training runs in fp32 on CPU", precision)
        ctx.precision = "fp32"
    seed_model_parallel(seed, ctx.pp_rank)
    log.info(
        "distributed: rank %d/%d backend=%s tp=%d pp=%d dp=%d (tp_rank=%d pp_rank=%d dp_rank=%d)",
        rank, world_size, backend, tp, pp, dp, ctx.tp_rank, ctx.pp_rank, ctx.dp_rank,
    )  # fmt: skip
    return ctx


def seed_model_parallel(seed: int, pp_rank: int) -> None:
    """Megatron's seeding: one default stream per PP stage, plus the named TP-region stream.

    On GPU this is `model_parallel_cuda_manual_seed`; on CPU the device layer has replaced the
    CUDA RNG tracker with a CPU one, and the same function seeds it.
    """
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    # torch.cuda.manual_seed inside is a documented no-op without CUDA; the tracker it fills is
    # the device layer's CPU tracker there.
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for single-process rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
