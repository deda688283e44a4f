"""The run settings that only matter on CUDA, each decided by a pure function (so CPU tests pin the
decision) and applied in one place (`apply_process_env` before the process touches CUDA,
`apply_torch_flags` once the run's device is known).

- `CUDA_DEVICE_MAX_CONNECTIONS=1` when tp > 1: megatron's TP/SP communication overlap orders its
  all-gathers and GEMMs on one hardware queue (megatron-core 0.16 `tensor_parallel/layers.py`
  warns without it).
- determinism (`train.deterministic`): TE's deterministic attention kernels
  (`NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`, which megatron's `deterministic_mode` requires:
  `extensions/transformer_engine.py:1254`), cuBLAS's fixed workspace, torch's deterministic
  algorithms (index_add_ backward in media splicing and the CP split).
- fp32 on CUDA: TF32 matmuls on (the GPU peak the MFU uses is TF32's); refused under
  context parallelism, where TE has no fp32 attention (flash/fused attention take bf16/fp16 only
  and the unfused backend is disabled with CP).
- `cp_comm_type` against what TE can do with THD (every decoder call is packed).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: the cuBLAS workspace setting torch documents for deterministic CUDA matmuls
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"

#: the newest Transformer Engine release the cp_comm_type rules below were read against
TE_LAST_CHECKED = (2, 18)
#: the first TE release whose all-gather CP attention takes THD (NVIDIA/TransformerEngine#2829)
TE_ALL_GATHER_THD = (2, 18)


def process_env(tp: int, deterministic: bool) -> dict[str, str]:
    """Environment variables this process needs before its first CUDA call."""
    env = {}
    if tp > 1:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if deterministic:
        env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACE
    return env


def apply_process_env(tp: int, deterministic: bool) -> dict[str, str]:
    """Set `process_env` (before torch.distributed / CUDA start). A different value the user
    exported is replaced, with a warning: megatron's overlap and the determinism switch need these."""
    env = process_env(tp, deterministic)
    for key, value in env.items():
        old = os.environ.get(key)
        if old is not None and old != value:
            log.warning(
                "%s=%s in the environment: set to %s (%s)",
                key,
                old,
                value,
                "parallel.tp > 1" if key == "CUDA_DEVICE_MAX_CONNECTIONS" else "train.deterministic",
            )
        os.environ[key] = value
    return env


@dataclass(frozen=True)
class TorchFlags:
    tf32: bool  # torch.backends.{cuda.matmul,cudnn}.allow_tf32
    deterministic_algorithms: bool


def torch_flags(on_cuda: bool, precision: str, deterministic: bool) -> TorchFlags:
    """TF32 on CUDA (fp32 runs' GEMMs; bf16 runs' few fp32 matmuls; TF32 is deterministic too);
    torch's deterministic algorithms with `train.deterministic`."""
    return TorchFlags(tf32=on_cuda, deterministic_algorithms=deterministic)


def apply_torch_flags(flags: TorchFlags) -> None:
    if flags.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if flags.deterministic_algorithms:
        # warn_only: an op without a deterministic kernel is named in a warning instead of stopping
        # a run; the run is then reproducible except for that op
        torch.use_deterministic_algorithms(True, warn_only=True)


def precision_problem(precision: str, cp: int, on_cuda: bool) -> str | None:
    """Why this precision cannot run on this device and CP size, or None."""
    if on_cuda and precision == "fp32" and cp > 1:
        return (
            f"parallel.precision=fp32 with parallel.cp={cp} on GPU: Transformer Engine's context-parallel "
            "attention takes bf16/fp16 only (its fp32 'unfused' backend is disabled under CP); set "
            "parallel.precision=bf16"
        )
    return None


def fp32_on_cuda_note(precision: str, on_cuda: bool) -> str | None:
    if on_cuda and precision == "fp32":
        return (
            "parallel.precision=fp32 on GPU: TF32 matmuls, and Transformer Engine's unfused attention "
            "(memory quadratic in the packed row); bf16 is the fast path"
        )
    return None


def cp_comm_type_problem(
    cp_comm_type: str, cp: int, tp: int, kv_groups: int, attention_heads: int, te_version: tuple[int, ...]
) -> str | None:
    """Why TE cannot run `cp_comm_type` on packed (THD) sequences with this layout, or None.

    - a2a+p2p: TE asserts "thd format is not supported with hierarchical CP implementation yet!" in
      every release up to TE_LAST_CHECKED (the gate is gone only on TE's unreleased main);
    - all_gather: THD only from TE 2.18 (before: "thd format is not supported!");
    - a2a: the heads are split over the CP ranks, so each TP rank's query and K/V heads must divide
      by cp."""
    if cp <= 1:
        return None
    version = ".".join(map(str, te_version)) or "unknown"
    if cp_comm_type == "a2a+p2p" and (not te_version or te_version[:2] <= TE_LAST_CHECKED):
        return (
            f"parallel.cp_comm_type=a2a+p2p: Transformer Engine {version} has no hierarchical CP for packed "
            "(THD) sequences, which every decoder call uses; use p2p (or all_gather with TE >= 2.18)"
        )
    if cp_comm_type == "all_gather" and (not te_version or te_version[:2] < TE_ALL_GATHER_THD):
        return (
            f"parallel.cp_comm_type=all_gather: Transformer Engine {version} takes packed (THD) sequences "
            f"with all_gather only from {'.'.join(map(str, TE_ALL_GATHER_THD))}; use p2p or upgrade TE"
        )
    if cp_comm_type == "a2a":
        for what, heads in (("key/value heads", kv_groups), ("attention heads", attention_heads)):
            if heads % tp or (heads // tp) % cp:
                return (
                    f"parallel.cp_comm_type=a2a splits the heads over CP: {heads} {what} / tp {tp} is not a "
                    f"multiple of cp {cp}; use p2p"
                )
    return None
