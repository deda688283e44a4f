"""What the benchmark scripts share: where the repository is, and the environment their child
processes (the jobs and training runs they measure) start in, how such a process reports its
own peak memory, and how a check reads a checkpoint back. Light on purpose: a measured baseline
process imports it (torch only inside `read_dist_ckpt`)."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def ray_job_env() -> dict[str, str]:
    """The environment of a measured process: the repository importable (a child may run
    `python -m benchmarks.…`), no RAY_ADDRESS from the caller's shell (a cold run starts its own
    Ray, never joins another; a warm one passes --address), and Ray's token authentication off
    unless RAY_AUTH_MODE says otherwise."""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("RAY_ADDRESS", None)
    return env


def tokenize_images_args(shards: Path, vq: Path, out: Path, image_area: int, *extra: str) -> list[str]:
    """The arguments of `mmdata tokenize-images` (`python -m mmdata.vision_tokens.cli`): the
    images of `shards` through the VQ model `vq` at `image_area` pixels into `out`."""
    return [str(shards), "--vision-tokenizer", str(vq), "--output", str(out), "--image-area", str(image_area), *extra]


def peak_rss_kb() -> int:
    """This process's own peak RSS in KiB: VmHWM. Not getrusage's ru_maxrss: Linux carries the
    RSS of the process that forked it across exec, so a job started from a big pytest process
    would report the test session's memory."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))
    except (OSError, StopIteration):  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def read_dist_ckpt(path: Path, prefix: str = "") -> dict[str, Any]:
    """Every tensor (whose name starts with `prefix`) of a megatron torch_dist checkpoint dir,
    unsharded (torch DCP, no process group)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    md = reader.read_metadata()
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)
    }
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": intended, one process
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd
