"""One resumable runner for the Ray jobs (`mmdata preprocess`, `mmdata tokenize-images`), as the
training side has one runtime for its families. A job declares what it is and its stages; the
runner does the rest, the same way for every job:

    job.check()              flags and inputs: a UserError (exit 2) before anything is written
    FolderLock(--output)     one job per output folder (mmdata/folder_lock.py)
    job.identity(ray)        what the output depends on: its description and fingerprint
    check_output_dir         another job's folder refused; this very job, finished: nothing to do
    work folder              DIR/.mmdata-work/work.json, the job's subfolders, a killed run's
                             temporary files removed
    job.stages(run)          a generator of Stages, each a list of units (input files, buckets,
                             chunks, shards): a unit an earlier run finished is taken from its
                             done-marker, the rest run on Ray (bounded tasks, or the job's own
                             executor: actors); progress, resumed counts and phase times kept here
    job.finish(run)          the outputs beside the shards, on the runner's background thread
                             while Ray shuts down
    manifest.json            published atomically (Ctrl-C held back), then the work folder goes

Ctrl-C anywhere else: Ray is shut down and `Interrupted` raised ("rerun the same command to
resume", exit status 130). Ray starts on first use (a job whose identity needs the cluster asks
for it in `identity`; otherwise the first stage with work to run starts it).
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from rich.console import Console

from mmdata import shard_format as sf
from mmdata.errors import Interrupted, UserError, deferred_interrupt
from mmdata.folder_lock import FolderLock
from mmdata.ray_job import (
    INTERRUPTED,
    check_output_dir,
    discard,
    init_ray,
    remove,
    run_bounded,
    shard_outputs,
    shutdown_ray,
)
from mmdata.shard_job.manifest import fingerprint, write_json_atomic
from mmdata.shard_job.progress import JobProgress

NODE_KEY = "_ray_node"  # in a task's result: the node that ran it (counted in `run.task_nodes`)
CPU_KEY = "_task_cpu_s"  # ... and the CPU seconds its worker process spent on it (`run.task_cpu_s`)
#: what a killed run leaves in the output folder: temporary shards, tar indexes, energon metadata
STALE_OUTPUT_GLOBS = (".shard-*.tar.tmp-*", "shard-*.tar.idx.tmp", f"{sf.ENERGON_META}.tmp-*")

OnResult = Callable[[Any, dict], None]


def _nothing(_unit: Any) -> None:
    return None


def _ignore(_unit: Any, _result: dict) -> None:
    return None


@dataclass
class Stage:
    """One stage of a job: its units, the Ray work that does one, and how a finished one is found.

    A unit's result is a JSON-able dict. A unit whose result `recorded(unit)` returns (its
    done-marker, left by an earlier run) is not run again; the others are run by `submit` (one
    Ray task per unit, at most a few per CPU in flight) or by `execute(todo, on_done)` (a job's
    own executor, e.g. a pool of actors). A result with `"resumed": True` is a unit its task
    found already done (e.g. a shard whose bytes match its marker). `on_result` sees every
    result, recorded ones first."""

    name: str  # on the progress display
    key: str  # its count in the manifest's `run.resumed`
    phase: str  # the `run.phases` entry its time adds to (several stages may share one)
    units: Sequence[Any]
    submit: Callable[[Any], Any] | None = None
    execute: Callable[[list, OnResult], None] | None = None
    recorded: Callable[[Any], dict | None] = _nothing
    on_result: OnResult = _ignore
    noun: str = "task"  # what a unit is called in "resumed, 6/8 input files already done"
    records: Callable[[], int] | None = None  # records done so far, shown with their rate
    record_noun: str = "records"

    def __post_init__(self) -> None:
        if (self.submit is None) == (self.execute is None):
            raise ValueError(f"stage {self.name!r}: give exactly one of submit and execute")


def json_marker(path_of: Callable[[Any], Path]) -> Callable[[Any], dict | None]:
    """`Stage.recorded` for units whose done-marker is a JSON file holding their result."""

    def recorded(unit: Any) -> dict | None:
        path = path_of(unit)
        return json.loads(path.read_text()) if path.exists() else None

    return recorded


@dataclass(frozen=True)
class Identity:
    """What a job's output depends on (`description`, fingerprinted), and the settings of its
    intermediate files (`work_settings`: a change removes the job's `settings_dirs`, never the
    output, which does not depend on them)."""

    description: dict
    work_settings: dict

    @functools.cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.description)


class RunOptions(Protocol):
    """The options every job has (its config dataclass has these fields)."""

    output: Path
    address: str | None
    num_cpus: int | None
    overwrite: bool
    progress: bool
    keep_work_dir: bool


class RayCluster:
    """Ray for one job: started on first use (a private local instance, or `--address` /
    RAY_ADDRESS), shut down by the runner."""

    def __init__(self, address: str | None, num_cpus: int | None):
        self.address, self.num_cpus = address, num_cpus
        self.owned: bool | None = None  # None: not started
        self.init_s: float | None = None
        self.up_cpu_s = 0.0  # the driver's CPU time (process_time) once Ray was up

    def start(self) -> None:
        if self.owned is None:
            t0 = time.perf_counter()
            self.owned = init_ray(self.address, self.num_cpus)
            self.init_s = round(time.perf_counter() - t0, 3)
            self.up_cpu_s = time.process_time()

    def resources(self) -> dict:
        import ray  # (2 s to import: only a job with work to run pays it, see `start`)

        self.start()
        return ray.cluster_resources()

    @functools.cached_property
    def max_in_flight(self) -> int:
        """Tasks pending at once: two per CPU, so no CPU waits for the driver."""
        return max(2, 2 * int(self.resources().get("CPU", 1)))

    def shutdown(self) -> None:
        if self.owned is not None:
            shutdown_ray(self.owned)


class ResumableJob:
    """A job the runner can run: its options, identity, work folder, stages, finish and manifest."""

    tool: str  # "mmdata preprocess": in work.json (readiness.py names it) and the manifest
    error: type[UserError]  # its user errors
    work_dirs: tuple[str, ...]  # subfolders of the work folder
    settings_dirs: tuple[str, ...] = ()  # removed when the work settings change
    per_run_dirs: tuple[str, ...] = ()  # emptied at every start (records of this run only)

    options: RunOptions

    def positive_flags(self) -> dict[str, float | None]:
        """Flags that must be positive when given (--num-cpus is checked for every job)."""
        return {}

    def check(self) -> None:
        """Check the flags and inputs (raise `self.error`); nothing may be written."""

    def identity(self, ray: RayCluster) -> Identity:
        """The job's description and work settings (`ray.start()` when it needs the cluster)."""
        raise NotImplementedError

    def own_outputs(self, out: Path) -> list[Path]:
        """What `--overwrite` removes: the files this tool writes."""
        return shard_outputs(out)

    def saved_job(self, manifest: dict) -> dict | None:
        """The job description in a finished output's manifest (for "changed: ..." messages)."""
        return manifest.get("job") if isinstance(manifest.get("job"), dict) else None

    def stages(self, run: JobRun) -> Iterator[Stage]:
        """The stages in order; code between two yields runs once the first stage is done."""
        raise NotImplementedError

    def finish(self, run: JobRun) -> None:
        """Write the outputs beside the shards (runs while Ray shuts down)."""

    def manifest(self, run: JobRun) -> dict:
        """The manifest, written last."""
        raise NotImplementedError

    def summary(self, manifest: dict, out: Path) -> Any:
        """A rich renderable printed after the manifest (with progress on)."""
        return None


class JobRun:
    """One run of a job in its output folder: what the stages share, and the stage loop."""

    def __init__(
        self,
        job: ResumableJob,
        out: Path,
        work: Path,
        created: bool,
        ray: RayCluster,
        progress,
        background: ThreadPoolExecutor,
        t_start: float,
    ):
        self.job, self.out, self.work, self.created, self.ray = job, out, work, created, ray
        self.progress, self.background, self.t_start = progress, background, t_start
        self.c_start = time.process_time()  # the driver's CPU so far: start-up, imports, Ray's start
        self.resumed: dict[str, int] = {}  # units found done, per stage key
        self.task_nodes: Counter[str] = Counter()  # Ray tasks run per node id
        self._phases: dict[str, float] = {}
        self._task_cpu: dict[str, float] = {}  # Ray tasks' CPU seconds, per phase

    # ------------------------------------------------------------------ for the job's stages

    def remote(self, fn: Callable[..., dict]):
        """`fn` as a Ray task of one CPU whose result also says which node ran it and the CPU its
        worker spent on it (`run.task_nodes`, `run.task_cpu_s`). SPREAD: tasks go round the nodes
        (each reads and writes the shared file system) rather than filling the driver's node
        first; on one node it changes nothing."""
        import ray  # (see RayCluster.resources)

        return ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_reporting(fn))

    def refuse(self, message: str) -> NoReturn:
        """Stop with a user error, leaving nothing behind (a job that has nothing to write)."""
        discard(self.out, self.work, self.created)
        raise self.job.error(message)

    def wall_time_s(self) -> float:
        return round(time.perf_counter() - self.t_start, 3)

    def driver_cpu_s(self) -> float:
        """The driver process's CPU seconds (all its threads, Ray's included) since its stages
        began and Ray was up: its start-up, imports and Ray's start (fixed, seconds, and noisy on
        a busy machine) left out, so that what it spends per record shows (`run.driver_cpu_s`;
        docs/preprocess.md, "The driver at cluster scale")."""
        return round(time.process_time() - max(self.c_start, self.ray.up_cpu_s), 3)

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase: Ray's start, the stages', then the finish step."""
        start = {} if self.ray.init_s is None else {"ray_init_s": self.ray.init_s}
        return {**start, **{k: round(v, 3) for k, v in self._phases.items()}}

    @property
    def task_cpu_s(self) -> dict[str, float]:
        """CPU seconds per phase that this run's Ray tasks spent, each measured in its worker
        process while it ran: what the work cost on any cluster, without Ray's start, its idle
        processes and the driver (docs/preprocess.md, "Benchmark")."""
        return {k: round(v, 3) for k, v in self._task_cpu.items()}

    # ------------------------------------------------------------------ the stage loop

    def run(self, stage: Stage) -> None:
        prog, name, total = self.progress, stage.name, len(stage.units)
        todo = []
        for unit in stage.units:
            result = stage.recorded(unit)
            if result is None:
                todo.append(unit)
            else:
                stage.on_result(unit, result)
        found = total - len(todo)
        if todo and stage.submit is not None:
            self.ray.start()
        t0 = time.perf_counter()
        # (type checker: stage.records is checked in the same expression)
        records = (lambda: {"records": stage.records(), "unit": stage.record_noun}) if stage.records else dict  # type: ignore[misc]
        prog.stage(name, total, base_records=stage.records() if stage.records else 0)
        prog.resumed(name, found, total, stage.noun)
        if found:
            prog.advance(name, found, **records())
        kept = 0  # units their task found done

        def done(unit: Any, result: dict) -> None:
            nonlocal kept
            node, cpu = result.pop(NODE_KEY, None), result.pop(CPU_KEY, None)
            if node is not None:
                self.task_nodes[node] += 1
            if cpu is not None:
                self._task_cpu[stage.phase] = self._task_cpu.get(stage.phase, 0.0) + cpu
            kept += bool(result.get("resumed"))
            stage.on_result(unit, result)
            prog.advance(name, **records())

        if todo and stage.submit is not None:
            run_bounded(stage.submit, todo, self.ray.max_in_flight, done)
        elif todo:
            stage.execute(todo, done)  # type: ignore[misc]
        prog.resumed(name, kept, total, stage.noun, after=True)
        self.resumed[stage.key] = self.resumed.get(stage.key, 0) + found + kept
        self._phases[stage.phase] = self._phases.get(stage.phase, 0.0) + time.perf_counter() - t0

    def _finished(self, seconds: float) -> None:
        self._phases["finish_s"] = seconds


def _reporting(task: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(task)
    def run(*args, **kwargs) -> dict:
        import ray  # a Ray task body (runs in the worker)

        c0 = time.process_time()  # the worker process's: threads a task starts count too
        result = task(*args, **kwargs)
        return {**result, NODE_KEY: ray.get_runtime_context().get_node_id(), CPU_KEY: time.process_time() - c0}

    return run


# ----------------------------------------------------------------------------- the runner


def run_job(job: ResumableJob) -> dict:
    """Run `job` to its published manifest (returned). A user error is raised as the job's
    `error`; Ctrl-C, once Ray is shut down, as `Interrupted`: a rerun of the same job resumes."""
    try:
        return _run(job)
    except KeyboardInterrupt:
        raise Interrupted(INTERRUPTED) from None


def _run(job: ResumableJob) -> dict:
    t_start = time.perf_counter()
    opts = job.options
    for flag, value in {"--num-cpus": opts.num_cpus, **job.positive_flags()}.items():
        if value is not None and value <= 0:
            raise job.error(f"{flag} must be a positive number, got {value}")
    out = Path(opts.output).resolve()
    if out.exists() and not out.is_dir():
        raise job.error(f"--output {out} is a file; give a folder (a new one, or one this tool wrote)")
    job.check()
    with FolderLock(out, "--output"):
        return _run_locked(job, out, t_start)


def _run_locked(job: ResumableJob, out: Path, t_start: float) -> dict:
    opts = job.options
    ray = RayCluster(opts.address, opts.num_cpus)
    background = ThreadPoolExecutor(1, thread_name_prefix="mmdata-finish")  # the job's driver-side writes, in order
    finished: Future | None = None
    try:
        ident = job.identity(ray)
        done = check_output_dir(
            out, ident.fingerprint, ident.description, opts.overwrite, job.own_outputs, job.error, job.saved_job
        )
        if done is not None:
            print(f"{out}: already complete for these inputs and options; nothing to do", file=sys.stderr)
            if not opts.keep_work_dir:  # killed between writing the manifest and cleaning up
                shutil.rmtree(out / sf.WORK_DIR_NAME, ignore_errors=True)
            return done
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        work = prepare_work_dir(out, job, ident)
        with JobProgress(opts.progress) as prog:
            run = JobRun(job, out, work, created, ray, prog, background, t_start)
            for stage in job.stages(run):
                run.run(stage)
        t_finish = time.perf_counter()
        finished = background.submit(job.finish, run)
    finally:
        background.shutdown(wait=False, cancel_futures=finished is None)
        ray.shutdown()
    finished.result()  # re-raises an error of the finish step
    run._finished(time.perf_counter() - t_finish)
    manifest = job.manifest(run)
    with deferred_interrupt():  # the manifest says "finished": then the work folder goes
        write_json_atomic(out / sf.MANIFEST_NAME, manifest)
        if not opts.keep_work_dir:
            shutil.rmtree(work, ignore_errors=True)
    if opts.progress and (table := job.summary(manifest, out)) is not None:
        Console(stderr=True).print(table)
    return manifest


def prepare_work_dir(out: Path, job: ResumableJob, ident: Identity) -> Path:
    """DIR/.mmdata-work with work.json (what readiness.py and a rerun read), the job's subfolders,
    and no temporary file of a killed run."""
    work = out / sf.WORK_DIR_NAME
    wj = work / "work.json"
    state = {"fingerprint": ident.fingerprint, **ident.work_settings, "tool": job.tool, "job": ident.description}
    if wj.exists() and any(json.loads(wj.read_text()).get(k) != v for k, v in ident.work_settings.items()):
        remove([work / d for d in job.settings_dirs])
    remove([work / d for d in job.per_run_dirs])
    for d in job.work_dirs:
        (work / d).mkdir(parents=True, exist_ok=True)
    stale = list(work.rglob(".*.tmp-*")) + [p for g in STALE_OUTPUT_GLOBS for p in out.glob(g)]
    remove(stale)
    write_json_atomic(wj, state)
    return work
