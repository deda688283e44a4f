"""Bring up torch.distributed + megatron model-parallel state for standalone use (conversion,
`load_llava_ov`, tests) when no launcher did it. The training runtime's `init_distributed`
also builds its ParallelContext from a recipe; this one only acts when nothing is initialised
yet, and seeds the same way (`seed_model_parallel`)."""

from __future__ import annotations

import os

import torch.distributed as dist
from megatron.core import parallel_state

from mmtrain.device import enable_cpu_compat
from mmtrain.distributed import free_port, resolve_backend, seed_model_parallel


def ensure_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """Single-process default (world 1) unless torch.distributed is already up."""
    enable_cpu_compat()
    if not dist.is_initialized():
        backend = resolve_backend("auto")
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # a launcher set it up
            dist.init_process_group(backend=backend, rank=rank, world_size=world)
        elif world == 1:
            # private rendezvous; nothing written to os.environ, so child processes (e.g. a
            # training launcher started later) never inherit a port this process holds
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
        else:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        seed_model_parallel(seed, parallel_state.get_pipeline_model_parallel_rank())
    else:
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(f"model parallel already initialised with (tp, pp)={have}, asked for {(tp, pp)}")
