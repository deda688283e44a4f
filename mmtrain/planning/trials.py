"""One auto-tune trial: a short run of the real job on one layout, measured.

The trial is the recipe itself with the layout applied, `train.iters = auto_tune.trial_steps`, no
checkpoints, no evaluation, its own run_dir, started through the same launcher as
`mmtrain FAMILY RECIPE` (torchrun workers on `mmtrain.runtime.worker`, on this node) in its own
process group, and killed with that group when it passes its time limit. Measured:
tokens/s and step time, the medians over the steps after `auto_tune.warmup_steps` (from the
trial's metrics.jsonl), and every rank's peak memory (`<trial>/memory/rank*.json`, written by the
trainer). A failure is classified (oom, timeout, crash) with the line that says why; it never
raises.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from mmtrain.config import Recipe, save_resolved
from mmtrain.runtime.torchrun import torchrun_command
from mmtrain.runtime.metrics import read_metrics
from mmtrain.runtime.throughput import RANK_MEMORY_DIR

TRIAL_LOG = "trial.log"
OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory", re.IGNORECASE)
ERROR_LINE = re.compile(r"^\s*(\w+(\.\w+)*(Error|Exception)\b.*|.*\berror: .*)$")


@dataclass
class TrialResult:
    status: str  # "ran" | "oom" | "timeout" | "crash"
    reason: str = ""
    tokens_per_s: float | None = None  # whole job, steps after the warm-up
    step_time_s: float | None = None  # mean over the same steps
    peak_mem_gib: list[float] = field(default_factory=list)  # per rank: peak - base (what the model estimates)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ran"

    @property
    def max_peak_gib(self) -> float | None:
        return max(self.peak_mem_gib) if self.peak_mem_gib else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trial_recipe(recipe: Recipe, run_dir: Path) -> Recipe:
    """The job as a trial: few steps, nothing saved or evaluated, its own run_dir and port."""
    a = recipe.auto_tune
    return dataclasses.replace(
        recipe,
        action="run",
        run_dir=str(run_dir),
        train=dataclasses.replace(recipe.train, iters=a.trial_steps, eval_interval=0),
        checkpoint=dataclasses.replace(recipe.checkpoint, save=False),
        logging=dataclasses.replace(recipe.logging, interval=1, tensorboard=False),
        parallel=dataclasses.replace(
            recipe.parallel, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=free_port()
        ),
    )


def run_trial(recipe: Recipe, run_dir: Path, time_limit_s: float) -> TrialResult:
    """Run `recipe` (already the layout to try) as a trial in `run_dir` (emptied first)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    trial = trial_recipe(recipe, run_dir)
    resolved = save_resolved(trial, run_dir / "config.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.monotonic()
    with open(run_dir / TRIAL_LOG, "w") as log:
        proc = subprocess.Popen(
            torchrun_command(trial, resolved), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )  # its own group: a timeout kills every worker
        try:
            rc = proc.wait(timeout=time_limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = proc.returncode, True
        except BaseException:  # Ctrl-C of the search: its own session would outlive us otherwise
            _kill_group(proc)
            raise
    wall = time.monotonic() - start
    return measure(run_dir, trial, rc, timed_out, wall, time_limit_s)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def measure(run_dir: Path, trial: Recipe, rc: int, timed_out: bool, wall_s: float, time_limit_s: float) -> TrialResult:
    """Read what the trial left in `run_dir` into a TrialResult."""
    mem = rank_peaks(run_dir)
    log_text = (run_dir / TRIAL_LOG).read_text(errors="replace") if (run_dir / TRIAL_LOG).exists() else ""
    if timed_out:
        return TrialResult("timeout", f"still running after {time_limit_s:.0f} s", peak_mem_gib=mem, wall_s=wall_s)
    if rc != 0:
        oom = OOM_PATTERNS.search(log_text) or rc in (-signal.SIGKILL, 128 + signal.SIGKILL)
        return TrialResult("oom" if oom else "crash", failure_line(log_text, rc), peak_mem_gib=mem, wall_s=wall_s)
    steps = [
        (int(r.get("tokens") or 0), float(r.get("step_time_s") or 0))
        for r in read_metrics(run_dir)
        if r["step"] > trial.auto_tune.warmup_steps
    ]
    steps = [(n, t) for n, t in steps if t > 0]
    if not steps:
        return TrialResult(
            "crash",
            f"exited 0 but logged no step after the {trial.auto_tune.warmup_steps} warm-up steps",
            peak_mem_gib=mem,
            wall_s=wall_s,
        )
    # medians: one step stalled by another job on a shared machine does not decide the ranking
    return TrialResult(
        "ran", "", statistics.median(n / t for n, t in steps), statistics.median(t for _, t in steps), mem, wall_s
    )


def rank_peaks(run_dir: Path) -> list[float]:
    """Per-rank peak memory growth (GiB), ordered by rank."""
    out = []
    for path in sorted((run_dir / RANK_MEMORY_DIR).glob("rank*.json")):
        try:
            out.append(float(json.loads(path.read_text())["grown_gib"]))
        except (ValueError, KeyError, OSError):
            continue
    return out


def failure_line(log_text: str, rc: int) -> str:
    """The most telling line of a failed trial's log (the last exception line), for history.csv."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    if m := OOM_PATTERNS.search(log_text):
        hit = next((ln for ln in reversed(lines) if m.group(0) in ln), m.group(0))
        return hit[:300]
    errors = [ln for ln in lines if ERROR_LINE.match(ln)]
    return (errors[-1] if errors else f"exited with code {rc}")[:300]
