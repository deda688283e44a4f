"""Process-group and model-parallel set-up shared by every model family.

`init_distributed(parallel_cfg)` turns the recipe's `parallel:` section plus the torchrun/SLURM
environment into an initialised `torch.distributed` world (gloo on CPU, NCCL on GPU),
megatron-core's `parallel_state` (TP x CP x DP x PP groups, megatron's default rank order) and a
small `ParallelContext` that the train loop reads instead of poking at globals.
`ensure_model_parallel(tp, pp, cp=...)` does the same for standalone use (conversion, inference,
tests) when no launcher did it.

Context parallelism: the CP ranks of one data-parallel rank share its batch (they build the same
loader, at the same DP rank) and each runs its share of every sequence; megatron's DDP reduces
gradients over the data-parallel x CP group.

Both bring megatron up through `_bring_up_megatron`, the one place the CPU adaptations
(`cpu_compat.apply`) are applied.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from mmtrain.models.device import compute_device as compute_device  # re-exported: the loss reads it here
from mmtrain.models.te_support import te_status
from mmtrain.runtime import cpu_compat, cuda_settings

if TYPE_CHECKING:
    from mmtrain.config.schema import ParallelConfig

log = logging.getLogger(__name__)


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
    cp: int = 1
    cp_rank: int = 0
    vpp: int = 1  # virtual pipeline stages (model chunks) per rank
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
        """The rank that prints step logs: last PP stage (it has the loss), TP, CP and DP rank 0."""
        return self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0

    @property
    def params_dtype_name(self) -> str:
        """The run's precision in the model configs' spelling (`params_dtype`)."""
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.precision]

    @property
    def params_dtype(self) -> torch.dtype:
        return getattr(torch, self.params_dtype_name)


def env_rank_world() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's RANK/WORLD_SIZE (under srun, the launcher
    sets them from the allocation: slurm.py), or None when this process was started by hand."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", "0")),
        )
    return None


def resolve_backend(requested: str, cuda_visible: bool | None = None) -> str:
    """The process-group backend, which is THE run-device decision (nccl: CUDA, gloo: CPU).

    `cuda_visible` is asked here, once (default: `torch.cuda.is_available()`); everything after
    keys on the resulting device. gloo while CUDA is visible is refused: megatron,
    cpu_compat and TE would still see the GPU, giving a half-CPU half-GPU model; hide the GPUs
    instead (CUDA_VISIBLE_DEVICES="")."""
    if cuda_visible is None:
        cuda_visible = torch.cuda.is_available()
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"parallel.backend must be auto|gloo|nccl, got {requested!r}")
    if requested == "nccl" and not cuda_visible:
        raise RuntimeError("parallel.backend=nccl but CUDA is not available")
    if requested == "gloo" and cuda_visible:
        raise UnsupportedLayout(
            "parallel.backend=gloo while CUDA devices are visible: a CPU run on a GPU host needs "
            'the GPUs hidden (CUDA_VISIBLE_DEVICES=""); or use parallel.backend=auto|nccl'
        )
    if requested == "auto":
        return "nccl" if cuda_visible else "gloo"
    return requested


def cuda_device_index(local_rank: int, device_count: int, local_world_size: int | None = None) -> int:
    """The CUDA device of this process: LOCAL_RANK modulo the visible devices (under
    `srun --gpus-per-task=1` each task sees one device while LOCAL_RANK runs 0..7).

    `local_world_size` (torchrun's LOCAL_WORLD_SIZE: processes of this node sharing one device
    list) larger than `device_count` means two ranks on one GPU, which NCCL refuses
    ("Duplicate GPU detected"): a clear error instead."""
    if device_count < 1:
        raise RuntimeError("a CUDA run but no CUDA device is visible")
    if local_world_size is not None and local_world_size > device_count:
        raise UnsupportedLayout(
            f"{local_world_size} processes on this node but only {device_count} CUDA device(s) visible: NCCL "
            "cannot put two ranks on one GPU; lower parallel.nproc_per_node (or tp x pp for conversion) to "
            f"{device_count}, or make more GPUs visible"
        )
    return local_rank % device_count


def set_cuda_device(local_rank: int) -> torch.device:
    """Choose and set this process's CUDA device (before init_process_group: NCCL binds to it)."""
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    index = cuda_device_index(local_rank, torch.cuda.device_count(), int(lws) if lws else None)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class UnsupportedLayout(ValueError):
    """The recipe's layout cannot run in this process's world (a user error: one line, exit 2)."""


def check_layout(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """DP size for a world of `world_size` processes, or a clear error."""
    if tp < 1 or pp < 1 or cp < 1:
        raise UnsupportedLayout(
            f"parallel.tp, parallel.pp and parallel.cp must be >= 1 (got tp={tp}, pp={pp}, cp={cp})"
        )
    if world_size % (tp * pp * cp) != 0:
        raise UnsupportedLayout(
            f"world size {world_size} (nproc_per_node x nnodes) is not divisible by tp x pp x cp = {tp} x {pp} x {cp}"
        )
    return world_size // (tp * pp * cp)


def check_context_parallel_backend(cp: int, on_cuda: bool) -> None:
    """megatron's context-parallel attention on GPU is Transformer Engine's; refuse early and
    clearly without it (on CPU, mmtrain's K/V all-gather attention serves). Asked through
    te_support: megatron's TE import succeeds with a MagicMock when TE is missing."""
    if cp <= 1 or not on_cuda:
        return
    st = te_status()
    if not st.available:
        raise UnsupportedLayout(
            f"parallel.cp={cp} on GPU needs Transformer Engine for megatron's context-parallel attention "
            f"({st.reason}); install transformer-engine[pytorch] or set parallel.cp=1"
        )


def init_distributed(parallel_cfg: ParallelConfig, seed: int) -> ParallelContext:
    """Initialise torch.distributed + megatron parallel_state from the recipe's `parallel:`.

    Works the same for a single process (a world of one, so megatron's groups exist and every
    code path is the distributed one) and for torchrun/SLURM workers.
    """
    env = env_rank_world()
    if env is None:
        rank, world_size, local_rank = 0, 1, 0
        os.environ.setdefault("MASTER_ADDR", str(parallel_cfg.master_addr))
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    else:
        rank, world_size, local_rank = env
        # (set already by torchrun, or by the launcher under srun)
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
        os.environ.setdefault("MASTER_ADDR", str(parallel_cfg.master_addr))
        os.environ.setdefault("MASTER_PORT", str(parallel_cfg.master_port))

    expected = parallel_cfg.world_size
    if env is not None and world_size != expected:
        log.warning(
            "the launcher started %d processes but the recipe says nproc_per_node x nnodes = %d; "
            "using the launcher's world size (DP adapts)", world_size, expected,
        )  # fmt: skip
    tp, pp, cp = parallel_cfg.tp, parallel_cfg.pp, parallel_cfg.cp
    dp = check_layout(world_size, tp, pp, cp)
    backend = resolve_backend(parallel_cfg.backend)
    check_context_parallel_backend(cp, backend == "nccl")
    precision_problem = cuda_settings.precision_problem(parallel_cfg.precision, cp, backend == "nccl")
    if precision_problem:
        raise UnsupportedLayout(precision_problem)
    note = cuda_settings.fp32_on_cuda_note(parallel_cfg.precision, backend == "nccl")
    if note and rank == 0:
        log.warning("%s", note)
    if backend == "nccl":
        device = set_cuda_device(local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("MMTRAIN_CPU_THREADS", "1")))

    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=parallel_cfg.collective_timeout_mins),
            # (type checker: device_id, passed by name for nccl only)
            **({"device_id": device} if backend == "nccl" else {}),  # type: ignore[arg-type]
        )
    _bring_up_megatron(
        tp,
        pp,
        cp,
        parallel_cfg.hierarchical_cp_sizes or None,
        parallel_cfg.collective_timeout_mins,
        vpp=parallel_cfg.vpp,
    )

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
        cp=cp,
        cp_rank=parallel_state.get_context_parallel_rank(),
        vpp=parallel_cfg.vpp,
        sequence_parallel=parallel_cfg.sequence_parallel and tp > 1,
        recompute=parallel_cfg.recompute,
        precision=parallel_cfg.precision,  # bf16 too on CPU (megatron's own optimizers, cpu_compat)
        distributed_optimizer=parallel_cfg.distributed_optimizer,
    )
    seed_model_parallel(seed, ctx.pp_rank)
    log.info(
        "distributed: rank %d/%d backend=%s tp=%d pp=%d cp=%d dp=%d (tp_rank=%d pp_rank=%d cp_rank=%d dp_rank=%d)",
        rank, world_size, backend, tp, pp, cp, dp, ctx.tp_rank, ctx.pp_rank, ctx.cp_rank, ctx.dp_rank,
    )  # fmt: skip
    return ctx


def ensure_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, cp: int = 1) -> None:
    """Standalone use (conversion, inference, tests): a world of one unless a launcher set
    torch.distributed up; refuses a different (tp, pp, cp) than the one already initialised."""
    if not dist.is_initialized():
        backend = resolve_backend("auto")
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if backend == "nccl":  # without it every rank of a conversion sits on cuda:0
            set_cuda_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # a launcher set it up
            dist.init_process_group(backend=backend, rank=rank, world_size=world)
        elif world == 1:
            # private rendezvous; nothing written to os.environ, so child processes (e.g. a
            # training launcher started later) never inherit a port this process holds
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        else:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set")
    if _bring_up_megatron(tp, pp, cp):
        seed_model_parallel(seed, parallel_state.get_pipeline_model_parallel_rank())


def _bring_up_megatron(
    tp: int, pp: int, cp: int = 1, hierarchical_cp: list[int] | None = None, timeout_mins: float = 30.0, vpp: int = 1
) -> bool:
    """The CPU adaptations (no-op with CUDA) and megatron's TP x CP x DP x PP groups; True when
    the groups were created here (False: they existed already, with these sizes). `vpp` > 1 sets
    megatron's virtual pipeline size, which selects its interleaved schedule.

    `timeout_mins` bounds every collective on megatron's groups (the gradient all-reduce runs on
    its DP group, not the default one): without it they keep megatron's own 30 minutes whatever
    `parallel.collective_timeout_mins` says, and a frozen rank stalls the job that long."""
    cpu_compat.apply()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            hierarchical_context_parallel_sizes=hierarchical_cp,
            distributed_timeout_minutes=timeout_mins,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        )
        return True
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )
    if have != (tp, pp, cp):
        raise RuntimeError(f"model parallel already initialised with (tp, pp, cp)={have}, asked for {(tp, pp, cp)}")
    return False


def seed_model_parallel(seed: int, pp_rank: int) -> None:
    """Megatron's seeding: one default stream per PP stage, plus the named TP-region stream.

    On GPU this is `model_parallel_cuda_manual_seed`; on CPU `cpu_compat` has replaced the
    CUDA RNG tracker with a CPU one, and the same function seeds it.
    """
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    # torch.cuda.manual_seed inside is a documented no-op without CUDA; the tracker it fills is
    # cpu_compat's CPU tracker there.
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def single_node_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The torch.distributed environment of rank `rank` of `world` processes on this machine, the
    rendezvous at 127.0.0.1:`port` (for processes we spawn ourselves, without torchrun)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for single-process rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
