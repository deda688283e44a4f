"""The driver's CPU per second of wall time while Ray runs long tasks elsewhere, with Ray's
defaults and with the settings that might cut the driver core worker's periodic work
(docs/preprocess.md, "at scale": what the scale benchmark's driver margin is made of).

Each setting runs in its own process: a private local Ray started as `mmdata/ray_job.py` starts
it (no dashboard, no worker logs), two tasks that sleep SECONDS while the driver waits on them
as `run_bounded` does (`ray.wait`, one at a time), then TASKS tiny tasks with four in flight.
Every thread of the driver is read with its own CPU clock (nanoseconds, not psutil's 10 ms
ticks) and summed by thread name. Prints, per setting, the driver's ms of CPU per wall second
and per tiny task, and the threads that spent them.

    python -m benchmarks.ray_driver_ticks [--seconds 30] [--tasks 300] [SETTING ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: the settings tried: RAY_<name> are Ray's config (ray_config_def.h) read from the environment
#: by every Ray process, the driver's core worker included; GRPC_* is gRPC's own.
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "task_events_off": {"RAY_task_events_report_interval_ms": "0"},
    "metrics_off": {"RAY_enable_metrics_collection": "0"},
    "metrics_60s": {"RAY_metrics_report_interval_ms": "60000"},
    "event_stats_off": {"RAY_event_stats": "0"},
    "lag_probe_off": {"RAY_io_context_event_loop_lag_collection_interval_ms": "-1"},
    "heartbeat_10s": {"RAY_core_worker_internal_heartbeat_ms": "10000"},
    "backlog_10s": {"RAY_report_worker_backlog_interval_ms": "10000"},
    "grpc_backup_poll_off": {"GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS": "0"},
    "usage_stats_off": {"RAY_USAGE_STATS_ENABLED": "0"},
}
ALL_OFF = ("task_events_off", "metrics_off", "event_stats_off", "lag_probe_off")
SETTINGS["all_off"] = {k: v for name in ALL_OFF for k, v in SETTINGS[name].items()}
THREAD_CPU_CLOCK = 6  # Linux: (~tid << 3) | CPUCLOCK_PERTHREAD_MASK | CPUCLOCK_SCHED, a thread's own CPU clock


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads, summed by thread name (/proc's `comm`)."""
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            cpu = time.clock_gettime((~int(task.name) << 3) | THREAD_CPU_CLOCK)
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + cpu
    return out


def _delta(after: dict[str, float], before: dict[str, float], per: float) -> dict[str, float]:
    return {k: round((v - before.get(k, 0.0)) / per * 1e3, 3) for k, v in after.items() if v > before.get(k, 0.0)}


def _nap(seconds: float) -> None:
    time.sleep(seconds)


def _tiny(i: int) -> int:
    return i


def measure(seconds: float, tasks: int) -> dict:
    """One setting, in this process (its environment already set)."""
    import ray  # (only in the measured process)

    from mmdata.ray_job import init_ray

    os.environ.pop("RAY_ADDRESS", None)  # a private instance, whatever the caller's environment
    init_ray(None, num_cpus=2)  # started as the jobs start it
    nap, tiny = ray.remote(_nap), ray.remote(_tiny)
    ray.get([nap.remote(0.1) for _ in range(2)])  # workers up before the window
    time.sleep(2)
    before, t0, p0 = thread_cpu(), time.monotonic(), time.process_time()
    pending = [nap.remote(seconds) for _ in range(2)]
    while pending:
        _, pending = ray.wait(pending, num_returns=1)
    after, wall, cpu = thread_cpu(), time.monotonic() - t0, time.process_time() - p0
    t_before, q0 = thread_cpu(), time.process_time()
    in_flight: list = []
    for i in range(tasks):
        in_flight.append(tiny.remote(i))
        if len(in_flight) >= 4:
            done, in_flight = ray.wait(in_flight, num_returns=1)
            ray.get(done)
    ray.get(in_flight)
    per_task, t_after = (time.process_time() - q0) / tasks, thread_cpu()
    ray.shutdown()
    return {
        "ms_per_s": round(cpu / wall * 1e3, 2),
        "threads_ms_per_s": _delta(after, before, wall),
        "ms_per_task": round(per_task * 1e3, 3),
        "threads_ms_per_task": _delta(t_after, t_before, tasks),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="how long the two tasks sleep")
    p.add_argument("--tasks", type=int, default=300, help="tiny tasks for the per-task cost")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process
    p.add_argument("settings", nargs="*", choices=[[], *SETTINGS], default=[])
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.seconds, args.tasks)))
        return 0
    for name in args.settings or list(SETTINGS):
        cmd = [sys.executable, "-m", "benchmarks.ray_driver_ticks", "--measure", f"--seconds={args.seconds}"]
        cmd.append(f"--tasks={args.tasks}")
        done = subprocess.run(cmd, env={**os.environ, **SETTINGS[name]}, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        print(name, lines[-1] if lines else f"failed: {done.stderr[-500:]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
