"""Measuring how `mmdata preprocess` scales with its input: nested inputs (the N-record input is
a prefix of the 4N one, so the slope between them is the job's marginal rate) and the job run as
a user runs it, in its own process, reporting that process's own peak RSS.

benchmarks/bench_preprocess.py and tests/test_preprocess_scaling.py both measure this way.

    python -m benchmarks.scaling preprocess ARGS...        # `mmdata preprocess`, then PEAK_RSS_KB=...
    python -m benchmarks.scaling tokenize-images ARGS...   # `mmdata tokenize-images`, the same
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import psutil

from benchmarks.common import peak_rss_kb, ray_job_env
from mmdata.cli import run_alone

POLL_S = 0.25  # how often run_python reads the CPU time of the measured process tree


@dataclass(frozen=True)
class NestedInputs:
    parts: Path  # the generated parts, one folder of `part_records` records each
    part_records: int
    by_size: dict[int, Path]  # size -> its input folder

    def part_dirs(self, first: int, last: int) -> list[Path]:
        """The folders of the parts holding records [first, last) (whole parts)."""
        return [_part_dir(self.parts, start, self.part_records) for start in range(first, last, self.part_records)]


def write_nested_inputs(
    root: Path,
    sizes: list[int],
    *,
    seed: int = 0,
    synthetic: bool = False,
    part_records: int = 1000,
    processes: int = 1,
) -> NestedInputs:
    """`mmdata synth` Infinity-MM inputs of each size under `root/raw_<n>`, each a prefix of the
    larger ones: parts of `part_records` records (the part starting at record `start` seeded
    `seed + start`; one tar per subset, so tars of a quarter part) are generated once, for the
    largest size, and each size hard-links the tars of its first parts. Parts already under
    `root` (same seed, image kind and part size) are reused: synth is deterministic.
    `processes` > 1 generates the missing parts in that many processes."""
    bad = [n for n in sizes if n <= 0 or n % part_records]
    if bad:
        raise ValueError(f"input sizes must be positive multiples of {part_records} records, got {bad}")
    kind = "synthetic" if synthetic else "photo"
    inputs = NestedInputs(
        root / f"parts-{kind}-seed{seed}-{part_records}", part_records, {n: root / f"raw_{n}" for n in sizes}
    )
    todo = [d for d in inputs.part_dirs(0, max(sizes)) if not d.is_dir()]
    jobs = (todo, [seed] * len(todo), [part_records] * len(todo), [synthetic] * len(todo))
    if processes > 1 and len(todo) > 1:
        with ProcessPoolExecutor(min(processes, len(todo)), mp_context=get_context("spawn")) as pool:
            list(pool.map(_write_part, *jobs))
    else:
        list(map(_write_part, *jobs))
    for n, raw in inputs.by_size.items():
        shutil.rmtree(raw, ignore_errors=True)
        for part in inputs.part_dirs(0, n):
            for tar in sorted(part.rglob("*.tar")):
                link = raw / tar.relative_to(inputs.parts)
                link.parent.mkdir(parents=True, exist_ok=True)
                os.link(tar, link)
    return inputs


def _part_dir(parts: Path, start: int, part_records: int) -> Path:
    return parts / f"part{start // part_records:05d}"


def _write_part(final: Path, seed: int, part_records: int, synthetic: bool) -> None:
    """Generate one part into a temporary folder and rename it into place (a part folder is
    always complete)."""
    # (here, not at the top: the measured job runs this module's `main`, and its peak RSS should
    # be `mmdata preprocess`'s own, without the generator's imports)
    from mmdata.dev.synth import generate_records, write_infinity_mm

    start = int(final.name.removeprefix("part")) * part_records
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_infinity_mm(
        generate_records(part_records, seed=seed + start, synthetic=synthetic),
        tmp,
        samples_per_tar=-(-part_records // 4),
    )
    tmp.rename(final)


def run_python(args: list[str]) -> tuple[dict[str, float], float]:
    """`python ARGS` in a new process (`common.ray_job_env()`): its `KEY=value` stdout lines (upper-case keys,
    numeric values) plus `CPU_S`, and its wall time in seconds. RuntimeError with its output if it
    fails. `CPU_S` is the CPU time of the process and all its descendants (a Ray job's workers,
    raylet, GCS, agents), read every POLL_S seconds: a descendant that ends between two reads
    loses at most that much. It is also split by who spent it (`process_kind`): `CPU_DRIVER_S`,
    `CPU_WORKERS_S` and `CPU_RAY_S`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ray_job_env()
    )
    root, cpu, kinds, threads = psutil.Process(proc.pid), {}, {}, {}
    while True:
        try:
            out, err = proc.communicate(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            _read_cpu(root, cpu, kinds)
            _read_threads(root, threads)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        shown = " ".join(a if len(a) < 80 else a.strip().splitlines()[0] + " ..." for a in args)
        raise RuntimeError(f"python {shown} exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}")
    values = {"CPU_S": sum(cpu.values())}
    for kind in PROCESS_KINDS:
        values[f"CPU_{kind.upper()}_S"] = sum(c for pid, c in cpu.items() if kinds[pid] == kind)
    main = threads.pop(proc.pid, ("", 0.0))[1]
    values["CPU_DRIVER_MAIN_S"] = main
    values["CPU_DRIVER_THREADS_S"] = sum(c for _, c in threads.values())
    for name, c in threads.values():  # by thread name: "THREAD ray_core_worker" etc.
        values[f"THREAD {name}"] = values.get(f"THREAD {name}", 0.0) + c
    for line in out.splitlines():
        key, eq, value = line.partition("=")
        if eq and key.isupper():
            values[key] = float(value)
    return values, wall


PROCESS_KINDS = ("driver", "workers", "ray")


def process_kind(p: psutil.Process, root: psutil.Process) -> str:
    """Who a measured process is: "driver" (the measured process itself), "workers" (a Ray worker,
    where the job's tasks run: its command line runs Ray's `default_worker.py`) or "ray" (Ray's
    own processes: raylet, GCS, dashboard, autoscaler monitor; any other descendant too). The
    split matters at cluster scale: the workers' CPU grows with the records, Ray's own processes
    cost per second and per node, so their share per record shrinks as cores are added.
    tests/test_preprocess_scaling.py fails if a real job's workers are not found this way."""
    if p.pid == root.pid:
        return "driver"
    try:
        return "workers" if any(a.endswith("default_worker.py") for a in p.cmdline()) else "ray"
    except psutil.Error:
        return "ray"


def _read_cpu(root: psutil.Process, cpu: dict[int, float], kinds: dict[int, str]) -> None:
    """Record the CPU seconds so far of `root` and its descendants in `cpu`, and the kind of each
    in `kinds` (looked at again while it is "ray": a worker caught between fork and exec still
    shows its parent's command line)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:  # (it just ended)
        return
    for p in procs:
        try:
            times = p.cpu_times()
            if kinds.get(p.pid, "ray") == "ray":
                kinds[p.pid] = process_kind(p, root)
            cpu[p.pid] = times.user + times.system
        except psutil.Error:
            pass


def _read_threads(root: psutil.Process, threads: dict[int, tuple[str, float]]) -> None:
    """Record the CPU seconds so far of each thread of `root` (the driver) in `threads`, by thread
    id: (name, seconds). The main thread (id = the process id) runs the job's Python; the others
    are Ray's (its core worker's event loops and gRPC) and the job's background threads. A thread
    that ends between two reads loses at most POLL_S of its time."""
    try:
        found = root.threads()
    except psutil.Error:
        return
    for t in found:
        name = threads.get(t.id, ("", 0.0))[0]
        if not name:
            try:
                name = Path(f"/proc/{root.pid}/task/{t.id}/comm").read_text().strip()
            except OSError:
                name = "?"
        threads[t.id] = (name, t.user_time + t.system_time)


def run_job(args: list[str], command: str = "preprocess") -> tuple[dict[str, float], float]:
    """`mmdata COMMAND ARGS` (preprocess, tokenize-images) in its own process, as a user runs it:
    ({"PEAK_RSS_KB": the driver's peak RSS, "CPU_S": the whole job's CPU seconds, ...: see
    run_python}, wall seconds including interpreter start-up, imports and Ray's start and stop)."""
    return run_python(["-m", __name__, command, *args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rc = run_alone(argv[0], argv[1:])
    print(f"PEAK_RSS_KB={peak_rss_kb()}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
