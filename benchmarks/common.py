"""What the benchmark scripts share: where the repository is, and the environment their child
processes (the jobs and training runs they measure) start in, and how such a process reports its
own peak memory. Light on purpose: a measured baseline process imports it."""

from __future__ import annotations

import os
import resource
from pathlib import Path

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


def peak_rss_kb() -> int:
    """This process's own peak RSS in KiB: VmHWM. Not getrusage's ru_maxrss: Linux carries the
    RSS of the process that forked it across exec, so a job started from a big pytest process
    would report the test session's memory."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))
    except (OSError, StopIteration):  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
