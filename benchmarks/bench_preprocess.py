"""Benchmark `mmdata preprocess` on photo-like data: per core against the decode checks alone,
end to end against Ray Data doing the same validation and shuffle, and against a plain
`webdataset.ShardWriter` copy for reference.

Input: `mmdata synth` Infinity-MM tars (realistic layout) whose images are photo-like: crops of
real photos at synth's mix of sizes, formats and modes (`--synthetic`: the gradient images the
tests use, which compress to almost nothing and decode 4-6 times faster). Sizes N and 4N (default
N = 12,000, so 48,000 at the largest; `--quick`: 250 and 1,000, one run each), generated once
in parts, the N input a prefix of the 4N one (benchmarks/scaling.py); with `--workdir`
the parts are kept and reused by later runs with the same seed and image kind.

Sides, each its own subprocess on the same tars:

- ShardWriter: one process reads every record of the tars in input order and writes it with
  `webdataset.ShardWriter` (no validation, no shuffle, no manifest). It never decodes, so it is
  a reference, not a target: matching it on photos would mean weakening validation.
- Ray Data: `ray.data.read_webdataset(paths, decoder=None)` -> a `flat_map` running our own
  record validation (`mmdata.preprocess.validation.validate`: JSON, conversation, media
  resolution, the full decode check of every image; invalid records dropped) -> `random_shuffle
  (seed=0)` -> `write_webdataset(out, encoder=None)` (only bytes/str fields are kept: samples
  whose member sets differ come back with NaN for the members they lack, which
  `write_webdataset` rejects).
- ours: the full job (the same validation, seeded global shuffle, energon index, length index,
  manifest), starting its own private Ray (`--num-cpus`).

Figures:

- decode floor: the product's own decode check (`validation.check_image`: header parse plus the
  cheap decode checks of mmdata/preprocess/decode_check.py) run single-threaded in this process
  on every image of the records between N and 4N, reads excluded. The floor rate is those 3N
  records over the summed check time: what one core does if it does nothing but decode checks.
- full-decode floor: the same, with a full Pillow decode (`Image.open(...).load()`) of every
  image instead: what validating by decoding costs. The decode check gives the same verdicts
  (tests/test_decode_check_corpus.py) for a fraction of it; both CPU times are printed.
- ours per core: ours' marginal end-to-end rate (the slope of t = fixed + n / rate through N
  and 4N, so Ray's start and stop and every other fixed cost drop out) divided by `--num-cpus`.
  `BENCH preprocess_vs_decode_floor` is ours per core over the full-decode floor (issue 47: it
  may exceed 1, since the check is cheaper than a full decode): a wall-clock figure, so on a
  shared machine it also measures how much of each core the job got. `BENCH
  preprocess_vs_decode_floor_cpu` is the same comparison in the CPU account (below): the
  full-decode floor's CPU per record over ours' marginal CPU per record, which the machine's
  load leaves standing. The lines on the scan and the stage account compare with the check's
  floor (the decode checks' share of the job).
- `BENCH preprocess_vs_ray_data`: end to end (the subprocess's wall time) at 4N, Ray Data over
  ours (target >= 5).
- `BENCH preprocess` (end to end at the largest size) and `BENCH preprocess_throughput` (the
  marginal rates): ours against ShardWriter, references without a target.
- Ray's fixed cost, on a line of its own: start (as the job starts it), one empty task per CPU,
  stop, each timed; no Ray job can finish sooner. And the CPU Ray's processes use while idle,
  which a job pays per second: the CPU account charges it per record at ours' marginal wall time.
- Where the rest goes: ours' marginal wall time per 1,000 records by phase (from the manifests at
  N and 4N), with the MB/s the write phase reaches at the margin (it writes and fsyncs every
  shard byte, so a slow disk shows there) and the scan phase's own rate per core against the
  floor; and a CPU account that a loaded machine leaves standing: the CPU time of every process
  of ours' job (psutil, polled; benchmarks/scaling.py) fitted through N and 4N, per
  record, against the floor's CPU time per record, also split by process (Ray's workers, where
  the tasks run; the driver; Ray's own processes, which cost per second and per node, so a node
  with many cores approaches the floor over the workers' CPU alone), and the Ray tasks' own CPU
  per phase (the manifests' `run.task_cpu_s`) at the margin; and an in-process stage account:
  scan, sort and write run in this process (no Ray) on the first two parts of the margin, in CPU
  time per record, the scan against the decode checks of the same images.

Each measurement is the median of `--repeats` runs, taken in rounds that run every side once in
turn (Ray Data first, then ShardWriter and ours in alternating order, then the variants), so a
shared machine's load swings reach all sides alike; each round's ours/ShardWriter ratio is
printed too. The drivers' peak RSS (ours and Ray Data's; the baseline's whole process) is
printed for both sizes: ours must stay flat (within 20 %) because rows and media never pass
through its driver (tests/test_preprocess_scaling.py asserts it). At 4N ours also runs with
`--dedup phash` and with `--no-length-index`, giving their cost as a share of the job.

    .venv/bin/python -m benchmarks.bench_preprocess [--num-samples 12000] [--num-cpus 2]
        [--repeats 1] [--quick] [--synthetic] [--warm] [--scale-copies K] [--workdir DIR] [--floors-only]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.scaling import PROCESS_KINDS, NestedInputs, run_job, run_python, write_nested_inputs

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
PART_RECORDS = 1000  # records per generated part (tars of 250, one per subset); N is a multiple of it
QUICK_PART_RECORDS = 250

SHARDWRITER = r"""
import sys, tarfile, time
from pathlib import Path
import webdataset as wds

t0 = time.perf_counter()
raw, out, per_shard = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
n = 0
with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
    for tar_path in sorted(raw.rglob("*.tar")):
        with tarfile.open(tar_path) as tar:
            sample = {}
            for info in tar:
                if not info.isfile():
                    continue
                key, _, ext = info.name.partition(".")
                if sample and sample["__key__"] != f"{tar_path.stem}_{key}":
                    sink.write(sample)
                    n += 1
                    sample = {}
                sample["__key__"] = f"{tar_path.stem}_{key}"
                sample[ext] = tar.extractfile(info).read()
            if sample:
                sink.write(sample)
                n += 1
print(f"SAMPLES={n}\nT={time.perf_counter() - t0:.3f}")
from benchmarks.common import peak_rss_kb
print(f"PEAK_RSS_KB={peak_rss_kb()}", flush=True)
"""

RAY_DATA = r"""
import sys, tarfile, time
from pathlib import Path

t0 = time.perf_counter()
import ray

from mmdata.preprocess.adapters.base import MediaRef, MediaResolver, RawRecord
from mmdata.preprocess.validation import ValidationConfig, Valid, validate

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


class RowMembers(MediaResolver):
    # A row's members by name, for our validator (what the job's tar adapter does with offsets).
    def __init__(self, members):
        self.members = members

    def by_name(self, ref):
        data = self.members.get(ref)
        return None if data is None else MediaRef("", 0, len(data), ref)

    def read(self, media):
        return self.members[media.name]


def validated(row):
    # The job's own validation of the sample; an invalid one is dropped. Only bytes/str fields
    # are kept (members a sample lacks come back as NaN, which write_webdataset rejects).
    row = {k: v for k, v in row.items() if isinstance(v, (bytes, str))}
    key = row["__key__"]
    members = {f"{key}.{k}": v for k, v in row.items() if not k.startswith("__")}
    own = sorted((n for n in members if n.lower().endswith(IMAGE_SUFFIXES)), key=lambda n: (n.count("."), n))
    raw = RawRecord(rid=key, location=key, json_bytes=members.get(f"{key}.json"), provenance={},
                    locator=RowMembers(members), own_images=own)
    return [row] if isinstance(validate(raw, CFG), Valid) else []


CFG = ValidationConfig()
raw, out, num_cpus = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=True,
         logging_level="warning")
ray.data.DataContext.get_current().enable_progress_bars = False
paths = sorted(str(p) for p in raw.rglob("*.tar"))
ds = ray.data.read_webdataset(paths, decoder=None).flat_map(validated).random_shuffle(seed=0)
ds.write_webdataset(out, encoder=None)
ray.shutdown()
t = time.perf_counter() - t0
n = 0
for p in Path(out).glob("*.tar"):
    with tarfile.open(p) as tar:
        n += sum(1 for m in tar if m.name.endswith(".json"))
print(f"SAMPLES={n}\nT={t:.3f}")
from benchmarks.common import peak_rss_kb
print(f"PEAK_RSS_KB={peak_rss_kb()}", flush=True)
"""

# Ray's own fixed cost, with nothing to do: start (or join) as the job does, run one empty task
# per CPU (so every worker process starts), stop. No job can finish faster.
RAY_FIXED = r"""
import sys, time
import ray
from mmdata.ray_job import init_ray, shutdown_ray

t0 = time.perf_counter()  # like the job's wall_time_s: imports excluded
own = init_ray(sys.argv[2] or None, int(sys.argv[1]))
t1 = time.perf_counter()

@ray.remote(num_cpus=1)
def nothing():
    return None

ray.get([nothing.remote() for _ in range(int(ray.cluster_resources()["CPU"]))])
t2 = time.perf_counter()
# Ray's processes (raylet, GCS, helpers, idle workers) use CPU while they wait: a job pays it per
# second of wall time, so it enters the marginal CPU per record. Measured over a quiet interval.
import psutil

def tree_cpu():
    me, total = psutil.Process(), 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total

c0, w0 = tree_cpu(), time.perf_counter()
time.sleep(float(sys.argv[3]))
idle = (tree_cpu() - c0) / (time.perf_counter() - w0)
t3 = time.perf_counter()
shutdown_ray(own)  # the job's own stop
t4 = time.perf_counter()
print(f"START_S={t1 - t0:.3f}\nTASKS_S={t2 - t1:.3f}\nSTOP_S={t4 - t3:.3f}\nIDLE_CPU={idle:.4f}", flush=True)
"""
RAY_IDLE_S, QUICK_RAY_IDLE_S = 10, 2  # how long Ray's idle CPU is measured


def _run(script: str, *args: str) -> tuple[dict[str, float], float]:
    """Run a side's script in its own process; (its KEY=value lines, end-to-end seconds)."""
    try:
        return run_python(["-c", script, *args])
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def ray_fixed(num_cpus: int, idle_s: float) -> dict:
    """Ray alone: start as the job starts it, one empty task per CPU, stop (seconds each), and
    the CPU its processes use while idle for `idle_s` seconds (in cores)."""
    v, _ = _run(RAY_FIXED, str(num_cpus), "", str(idle_s))
    return {
        "start": v["START_S"],
        "tasks": v["TASKS_S"],
        "stop": v["STOP_S"],
        "idle_cpu": v["IDLE_CPU"],
        "e2e": v["START_S"] + v["TASKS_S"] + v["STOP_S"],
    }


def full_decode(data: bytes, name: str) -> None:
    """A full Pillow decode, as the product's policy runs Pillow (validation sets
    LOAD_TRUNCATED_IMAGES off and quiets the bomb warning at import): the full-decode floor."""
    import io

    from PIL import Image

    import mmdata.preprocess.validation  # noqa: F401  (Pillow's settings, as in the product)

    with Image.open(io.BytesIO(data)) as img:
        img.load()


def decode_floor(inputs: NestedInputs, first: int, last: int, full: bool = False) -> dict:
    """The decode checks alone: `validation.check_image` (`full`: a full Pillow decode,
    `full_decode`) on every image of the records [first, last) of the generated parts, one at a
    time in this process, reads excluded.
    {"records", "images", "e2e": the summed wall time of the checks, "cpu": their CPU time}."""
    from mmdata.preprocess.validation import ValidationConfig, check_image

    cfg = ValidationConfig()
    check = full_decode if full else functools.partial(check_image, cfg=cfg)
    records = images = 0
    wall = cpu = 0.0
    for part in inputs.part_dirs(first, last):
        for tar_path in sorted(part.rglob("*.tar")):
            with tarfile.open(tar_path) as tar:
                for info in tar:
                    if info.name.endswith(".json"):
                        records += 1
                    elif info.name.lower().endswith(IMAGE_SUFFIXES):
                        data = tar.extractfile(info).read()
                        t0, c0 = time.perf_counter(), time.thread_time()
                        check(data, info.name)
                        wall, cpu = wall + time.perf_counter() - t0, cpu + time.thread_time() - c0
                        images += 1
    return {"records": records, "images": images, "e2e": wall, "cpu": cpu}


def print_floors(floor: dict, full: dict) -> None:
    """The decode check's floor against the full decode's, on the same images."""
    print(
        f"decode check: {floor['images']:,} images of {floor['records']:,} records in {floor['cpu']:.1f} CPU-s "
        f"({floor['cpu'] / floor['records'] * 1e6:,.0f} CPU-us per record); full-decode floor: a full Pillow decode "
        f"of the same images took {full['e2e']:.1f}s ({full['cpu']:.1f} CPU-s; "
        f"{full['cpu'] / full['records'] * 1e6:,.0f} CPU-us per record): {full['records'] / full['e2e']:,.0f} "
        f"records/s; the decode check costs {floor['cpu'] / full['cpu']:.0%} of its CPU "
        f"({full['cpu'] / floor['cpu']:.2f}x cheaper, the same verdicts: tests/test_decode_check_corpus.py)"
    )


def stage_account(inputs: NestedInputs, first: int, last: int, work_root: Path) -> dict:
    """The job's stages run in this process on the records [first, last), one after the other,
    each timed in CPU seconds (`time.thread_time`): scan (validation included), sort, write;
    and the decode checks alone on the same images, so scan minus floor is the scan's work
    beyond decoding. No Ray: what each record costs the stages themselves."""
    from mmdata.preprocess import adapters
    from mmdata.preprocess.shuffle_plan import plan_shards
    from mmdata.preprocess.stages import JobSpec, scan_unit, sort_bucket, write_shard_task
    from mmdata.preprocess.validation import ValidationConfig

    work, out = work_root / "stages-work", work_root / "stages-out"
    for d in (work, out):
        shutil.rmtree(d, ignore_errors=True)
    for d in ("scan", "sorted", "shards"):
        (work / d).mkdir(parents=True)
    out.mkdir()
    units = adapters.list_units("infinity-mm", inputs.part_dirs(first, last))
    spec, buckets = JobSpec("infinity-mm", 0, 8, ValidationConfig(), str(work)), range(8)
    c0 = time.thread_time()
    records = sum(scan_unit(u, spec)["read"] for u in units)
    c1 = time.thread_time()
    counts = [sort_bucket(b, len(units), spec)["count"] for b in buckets]
    c2 = time.thread_time()
    for plan in plan_shards(counts, 1000):
        write_shard_task(plan, spec, str(out))
    c3 = time.thread_time()
    floor = decode_floor(inputs, first, last)
    shutil.rmtree(work)
    shutil.rmtree(out)
    us = 1e6 / records
    return {
        "records": records,
        "scan": (c1 - c0) * us,
        "floor": floor["cpu"] * us,
        "sort": (c2 - c1) * us,
        "write": (c3 - c2) * us,
    }


def _sha256_cpu_us_per_mb() -> float:
    """CPU-us hashlib's sha256 takes per MB here, on 4 MiB chunks as the shard writer hashes."""
    chunk, h = os.urandom(4 << 20), hashlib.sha256()
    c0 = time.thread_time()
    for _ in range(16):
        h.update(chunk)
    return (time.thread_time() - c0) * 1e6 / (16 * len(chunk) / 1e6)


def _scaled_input(root: Path, src: Path, copies: int) -> Path:
    """`copies` copies of an input folder under distinct paths: every record gets a new id in the
    job (ids are file path + member), so all of them are validated, shuffled and written again."""
    big = root / f"raw_x{copies}"
    for c in range(copies):
        shutil.copytree(src, big / f"copy{c:02d}", symlinks=False)
    return big


def _median_run(fn, repeats: int) -> dict:
    """The run with the median end-to-end time of `repeats` runs (machines here are shared)."""
    return _median(fn() for _ in range(repeats))


def _median(runs) -> dict:
    runs = sorted(runs, key=lambda r: r["e2e"])
    return runs[len(runs) // 2]


def _round_order(keys: list[str], r: int) -> list[str]:
    """The order of round r: Ray Data first, then ShardWriter and ours next to each other, which
    of the two comes first alternating by round, then the variants. So neither of the compared
    sides always runs right after Ray Data (which pushes every byte through the object store)."""
    pair = ["base", "ours"] if r % 2 == 0 else ["ours", "base"]
    return [k for k in keys if k == "rd"] + pair + [k for k in keys if k not in ("rd", "base", "ours")]


def _rounds(fns: dict, repeats: int) -> tuple[dict, list[dict]]:
    """({side: its median-time run}, [{side: run} per round]). A round runs every side once, in
    turn (`_round_order`), so a change in a shared machine's load reaches all sides of a round
    alike."""
    rounds = [{key: fns[key]() for key in _round_order(list(fns), r)} for r in range(repeats)]
    return {key: _median(r[key] for r in rounds) for key in fns}, rounds


def _fit(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """(marginal samples/s, fixed seconds) of t = fixed + n / rate through two sizes; NaN when the
    larger size took no longer (quick sizes on a busy machine: noise, not a rate)."""
    if t2 <= t1:
        return float("nan"), float("nan")
    rate = (n2 - n1) / (t2 - t1)
    return rate, t1 - n1 / rate


def _phases(m: dict) -> str:
    return ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in m["run"]["phases"].items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--num-samples", type=int, default=12000, help=f"N, a multiple of {PART_RECORDS} (the second size is 4N)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: N = {QUICK_PART_RECORDS} (in one part), one repeat, no warm runs",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per measurement; the median is reported")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic", action="store_true", help="gradient images (the tests' kind) instead of photo-like")
    p.add_argument("--warm", action="store_true", help="also run ours joining an already running Ray (--address)")
    p.add_argument(
        "--floors-only",
        action="store_true",
        help="only the decode check's and the full decode's floors on the records between N and 4N (no jobs)",
    )
    p.add_argument(
        "--scale-copies",
        type=int,
        default=0,
        help="also run ours and ShardWriter on K copies of the 4N input (K*4N records)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where to put data, the generated input kept for later runs (default: a temp dir, removed)",
    )
    args = p.parse_args(argv)
    n, part_records = (QUICK_PART_RECORDS, QUICK_PART_RECORDS) if args.quick else (args.num_samples, PART_RECORDS)
    reps = 1 if args.quick else args.repeats
    if n % part_records or n <= 0:
        p.error(f"--num-samples must be a positive multiple of {PART_RECORDS}")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_preprocess_"))
    root.mkdir(parents=True, exist_ok=True)
    spp = str(args.samples_per_shard)

    def base(raw: Path, size: int) -> dict:
        v, wall = _run(SHARDWRITER, str(raw), str(root / "base"), spp)
        shutil.rmtree(root / "base")
        assert v["SAMPLES"] == size, (v, size)
        return {"e2e": wall, "t": v["T"], "rss_mb": v["PEAK_RSS_KB"] / 1024}

    def ray_data(raw: Path, size: int) -> dict:
        v, wall = _run(RAY_DATA, str(raw), str(root / "rd"), str(args.num_cpus))
        shutil.rmtree(root / "rd")
        assert v["SAMPLES"] == size, (v, size)
        return {"e2e": wall, "t": v["T"], "rss_mb": v["PEAK_RSS_KB"] / 1024}

    def ours(raw: Path, size: int, *extra: str) -> dict:
        try:
            v, wall = run_job(
                [
                    "--dataset",
                    "infinity-mm",
                    "--input",
                    str(raw),
                    "--output",
                    str(root / "ours"),
                    "--seed",
                    "0",
                    "--samples-per-shard",
                    spp,
                    "--num-cpus",
                    str(args.num_cpus),
                    "--no-progress",
                    *extra,
                ]
            )
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        m = json.loads((root / "ours" / "manifest.json").read_text())
        shutil.rmtree(root / "ours")
        assert m["counts"]["read"] == size, m["counts"]
        return {
            "e2e": wall,
            "t": m["wall_time_s"],
            "rss_mb": v["PEAK_RSS_KB"] / 1024,
            "cpu": v["CPU_S"],
            "m": m,
            **{f"cpu_{k}": v[f"CPU_{k.upper()}_S"] for k in PROCESS_KINDS},
        }

    sides = {"base": ("ShardWriter", base), "rd": ("Ray Data", ray_data), "ours": ("ours", ours)}
    rows: list[dict] = []
    try:
        t0 = time.perf_counter()
        inputs = write_nested_inputs(
            root,
            [n, 4 * n],
            seed=args.seed,
            synthetic=args.synthetic,
            part_records=part_records,
            processes=args.num_cpus,
        )
        raws = inputs.by_size
        print(
            f"input: {4 * n:,} records generated or reused in {time.perf_counter() - t0:.0f}s "
            f"({'gradient' if args.synthetic else 'photo-like'} images)",
            flush=True,
        )
        if args.floors_only:
            print_floors(decode_floor(inputs, n, 4 * n), decode_floor(inputs, n, 4 * n, full=True))
            return 0
        idle_s = QUICK_RAY_IDLE_S if args.quick else RAY_IDLE_S
        fixed = _median_run(lambda: ray_fixed(args.num_cpus, idle_s), reps)
        for size, raw in raws.items():
            row = {"n": size, "mb": sum(f.stat().st_size for f in raw.rglob("*.tar")) / 1e6}
            fns = {key: functools.partial(fn, raw, size) for key, (_, fn) in sides.items()}
            if size == 4 * n:  # the decode floor, and the costs of dedup and of the length index, in the same rounds
                fns["floor"] = functools.partial(decode_floor, inputs, n, 4 * n)
                fns["full_floor"] = functools.partial(decode_floor, inputs, n, 4 * n, full=True)
                fns["dedup"] = functools.partial(ours, raw, size, "--dedup", "phash")
                fns["nolen"] = functools.partial(ours, raw, size, "--no-length-index")
            medians, rounds = _rounds(fns, reps)
            row.update(medians, paired=[r["base"]["e2e"] / r["ours"]["e2e"] for r in rounds])
            rows.append(row)
        big = rows[-1]
        st = stage_account(inputs, n, n + 2 * part_records, root)  # (the first two parts of the margin)
        sha_us_per_mb = _sha256_cpu_us_per_mb()
        if args.scale_copies:
            scaled = _scaled_input(root, raws[4 * n], args.scale_copies)
            size = 4 * n * args.scale_copies
            rows.append(
                {
                    "n": size,
                    "mb": sum(f.stat().st_size for f in scaled.rglob("*.tar")) / 1e6,
                    "base": _median_run(lambda: base(scaled, size), reps),
                    "ours": _median_run(lambda: ours(scaled, size), reps),
                }
            )
        if args.warm and not args.quick:
            import ray

            ray.init(
                address="local",
                num_cpus=args.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=True,
                logging_level="warning",
            )
            address = ray.get_runtime_context().gcs_address
            try:
                big["warm"] = _median_run(lambda: ours(raws[4 * n], 4 * n, "--address", address), reps)
            finally:
                ray.shutdown()
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            for d in [root / f"raw_{k}" for k in (n, 4 * n)] + [root / f"raw_x{args.scale_copies}"]:
                shutil.rmtree(d, ignore_errors=True)

    print(
        f"{'N':>7} {'input MB':>9} "
        + "".join(f"{label + ' e2e/s':>18} " for label, _ in sides.values())
        + f"{'ours job/s':>11} {'ours/SW':>8} {'ours/RD':>8} {'RSS MiB ours':>12} {'RSS MiB RD':>10} {'RSS MiB SW':>10}"
    )
    for r in rows:
        line = f"{r['n']:>7} {r['mb']:>9.1f} "
        for key in sides:
            line += f"{r['n'] / r[key]['e2e']:>18.0f} " if key in r else f"{'—':>18} "
        line += f"{r['n'] / r['ours']['t']:>11.0f} {r['base']['e2e'] / r['ours']['e2e']:>8.2f} "
        line += f"{r['rd']['e2e'] / r['ours']['e2e']:>8.2f} " if "rd" in r else f"{'—':>8} "
        line += f"{r['ours']['rss_mb']:>12.0f} " + (f"{r['rd']['rss_mb']:>10.0f} " if "rd" in r else f"{'—':>10} ")
        print(line + f"{r['base']['rss_mb']:>10.0f}")
    print(
        "e2e/s = records / wall time of the whole subprocess (interpreter start-up, imports, Ray start and "
        "stop included); ours job/s = records / the job's own wall_time_s (imports excluded)"
    )
    for r in rows:
        print(f"ours phases at N={r['n']}: {_phases(r['ours']['m'])}")
    for r in rows:
        if "paired" in r:
            print(
                f"ours/SW per round at N={r['n']} (both sides under the same load): "
                + ", ".join(f"{x:.2f}" for x in r["paired"])
                + f"; median {statistics.median(r['paired']):.2f}"
            )
    small, large = rows[0], rows[1]
    growth = large["ours"]["rss_mb"] / small["ours"]["rss_mb"] - 1
    rd_growth = large["rd"]["rss_mb"] / small["rd"]["rss_mb"] - 1
    print(
        f"driver peak RSS growth N -> 4N: ours {growth * 100:+.1f}% "
        f"({'flat' if abs(growth) <= 0.2 else 'NOT flat'}, limit 20%), Ray Data {rd_growth * 100:+.1f}%"
    )
    fits = {k: _fit(n, small[k]["e2e"], 4 * n, large[k]["e2e"]) for k in sides}
    for key, (label, _) in sides.items():
        rate, fixed_s = fits[key]
        print(f"{label}: marginal {rate:,.0f} samples/s, fixed {fixed_s:.1f}s (end to end, fit through N and 4N)")
    dedup_share = 1 - large["ours"]["t"] / large["dedup"]["t"]
    len_share = 1 - large["nolen"]["t"] / large["ours"]["t"]
    print(
        f"cost at N={4 * n} (job wall time): --dedup phash {large['dedup']['t']:.1f}s vs {large['ours']['t']:.1f}s "
        f"without ({dedup_share:+.1%} of the dedup job; hashes from the records' phash field: "
        f"{large['dedup']['m']['curation']['dedup']['phash_images']}); length index: "
        f"{large['ours']['t']:.1f}s vs {large['nolen']['t']:.1f}s without ({len_share:+.1%} of the job)"
    )
    if "warm" in large:
        print(
            f"ours joining a running Ray (--address) at N={4 * n}: {4 * n / large['warm']['e2e']:,.0f} samples/s "
            f"end to end, job {4 * n / large['warm']['t']:,.0f}/s"
        )
    floor = large["floor"]
    floor_rate = floor["records"] / floor["e2e"]
    per_core = fits["ours"][0] / args.num_cpus
    print(
        f"decode floor: {floor['images']:,} images of the {floor['records']:,} records between N and 4N checked "
        f"in {floor['e2e']:.1f}s on one core ({floor['cpu']:.1f} CPU-s; {floor['e2e'] / floor['images'] * 1e6:,.0f} us "
        f"per image): "
        f"{floor_rate:,.0f} records/s; ours {fits['ours'][0]:,.0f}/s marginal on {args.num_cpus} CPUs = "
        f"{per_core:,.0f}/s per core (load average {os.getloadavg()[0]:.1f})"
    )
    full = large["full_floor"]
    full_rate, full_cpu_us = full["records"] / full["e2e"], full["cpu"] / full["records"] * 1e6
    print_floors(floor, full)
    phases = {
        k: (large["ours"]["m"]["run"]["phases"][k] - small["ours"]["m"]["run"]["phases"][k]) / (3 * n) * 1e3
        for k in small["ours"]["m"]["run"]["phases"]
    }
    shard_mb = sum(s["bytes"] for s in large["ours"]["m"]["shards"]) / 1e6
    scan_per_core = 1e3 / max(phases["scan_s"], 1e-9) / args.num_cpus
    print(
        "ours' marginal wall time per 1,000 records by phase: "
        + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in phases.items())
        + f" (the write phase writes {shard_mb / (4 * n) * 1e3:,.0f} MB of shards per 1,000 records and fsyncs them: "
        f"{shard_mb / (4 * n) / max(phases['write_s'], 1e-9) * 1e3:,.0f} MB/s at the margin); the scan phase alone, "
        f"per "
        f"core: {scan_per_core:,.0f} records/s ({scan_per_core / floor_rate:.2f} "
        f"of the floor)"
    )
    cpu_rate = _fit(n, small["ours"]["cpu"], 4 * n, large["ours"]["cpu"])[0]
    floor_cpu_us, ours_cpu_us = floor["cpu"] / floor["records"] * 1e6, 1e6 / cpu_rate
    idle_us = fixed["idle_cpu"] * 1e6 / fits["ours"][0]  # Ray's idle cores x ours' marginal seconds per record
    print(
        f"CPU account: ours' marginal {ours_cpu_us:,.0f} CPU-us per record (all of the job's processes, through "
        f"N and 4N) against the floor's {floor_cpu_us:,.0f}: the decode checks are "
        f"{floor_cpu_us / ours_cpu_us:.0%} of ours' marginal CPU (ours took "
        f"{small['ours']['cpu']:.1f} and {large['ours']['cpu']:.1f} CPU-s in all); of the rest, about {idle_us:,.0f} "
        f"is Ray's processes idling ({fixed['idle_cpu'] * 100:.1f}% of a core while Ray waits, paid per second: "
        f"{1e6 / fits['ours'][0]:,.0f} us of ours' marginal wall time per record here)"
    )
    by_kind = {k: 1e6 / _fit(n, small["ours"][f"cpu_{k}"], 4 * n, large["ours"][f"cpu_{k}"])[0] for k in PROCESS_KINDS}
    print(
        f"ours' marginal CPU-us per record by process: Ray's workers (the tasks) {by_kind['workers']:,.0f}, the "
        f"driver {by_kind['driver']:,.0f}, Ray's own processes {by_kind['ray']:,.0f}; the floor over the workers' "
        f"alone: "
        f"{floor_cpu_us / by_kind['workers']:.3f} (what a node with many cores approaches: the driver and Ray's "
        "processes cost per second, spread over all of its cores)"
    )
    cpu_n, cpu_4n = (r["ours"]["m"]["run"]["task_cpu_s"] for r in (small, large))
    task_cpu = {k: (cpu_4n[k] - cpu_n[k]) / (3 * n) * 1e6 for k in cpu_4n}
    tasks_us = sum(task_cpu.values())
    tasks_ratio = floor_cpu_us / tasks_us if tasks_us > 0 else float("nan")
    print(
        "Ray tasks' own CPU at the margin (the manifests' run.task_cpu_s through N and 4N), CPU-us per record: "
        + ", ".join(f"{k[:-2]} {v:,.0f}" for k, v in task_cpu.items())
        + f" = {tasks_us:,.0f}; the floor over "
        f"the tasks' CPU: {tasks_ratio:.3f} (the decode checks' share of the work itself: Ray's start, its "
        "processes and the driver apart, and steadier than the whole job's account, whose fixed costs vary)"
    )
    print(
        f"in-process stage account ({st['records']:,} records of the margin, CPU-us per record, no Ray): scan "
        f"{st['scan']:,.0f} = decode checks {st['floor']:,.0f} + the rest {st['scan'] - st['floor']:,.0f}; sort "
        f"{st['sort']:,.0f}; write {st['write']:,.0f} (of which the shard's sha256 about "
        f"{shard_mb / (4 * n) * sha_us_per_mb:,.0f}); beyond decoding "
        f"{st['scan'] - st['floor'] + st['sort'] + st['write']:,.0f}"
    )
    print(
        f"Ray's fixed cost: start {fixed['start']:.1f}s + one empty task per CPU {fixed['tasks']:.1f}s + stop "
        f"{fixed['stop']:.1f}s = {fixed['e2e']:.1f}s per job, whatever its size"
    )
    last = rows[-1]
    print(
        f"BENCH preprocess_vs_decode_floor baseline={full_rate:.1f} ours={per_core:.1f} unit=samples/s/core "
        f"ratio={per_core / full_rate:.3f}"
    )
    print(
        f"BENCH preprocess_vs_decode_floor_cpu baseline={full_cpu_us:.1f} ours={ours_cpu_us:.1f} unit=cpu_us/record "
        f"ratio={full_cpu_us / ours_cpu_us:.3f}"
    )
    print(
        f"BENCH preprocess_vs_ray_data baseline={large['n'] / large['rd']['e2e']:.1f} "
        f"ours={large['n'] / large['ours']['e2e']:.1f} unit=samples/s "
        f"ratio={large['rd']['e2e'] / large['ours']['e2e']:.3f}"
    )
    print(
        f"BENCH preprocess baseline={last['n'] / last['base']['e2e']:.1f} ours={last['n'] / last['ours']['e2e']:.1f} "
        f"unit=samples/s ratio={last['base']['e2e'] / last['ours']['e2e']:.3f}"
    )
    print(
        f"BENCH preprocess_throughput baseline={fits['base'][0]:.1f} ours={fits['ours'][0]:.1f} unit=samples/s "
        f"ratio={fits['ours'][0] / fits['base'][0]:.3f}"
    )
    if "warm" in large:
        print(
            f"BENCH preprocess_warm baseline={large['n'] / large['base']['e2e']:.1f} "
            f"ours={large['n'] / large['warm']['e2e']:.1f} unit=samples/s "
            f"ratio={large['base']['e2e'] / large['warm']['e2e']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
