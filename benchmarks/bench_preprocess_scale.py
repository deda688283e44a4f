"""How far `mmdata preprocess` scales out: the driver's share of the job at N and 4N records.

Input: llava-json records with tiny media (a few hundred distinct 16 x 16 JPEGs, each record
naming one), so the per-record machinery dominates rather than decoding. Annotation files of
PART_RECORDS records each; the N-record input is the first N / PART_RECORDS files of the 4N one.
Full: N = 250,000 (and 1,000,000); --quick: 20,000 (and 80,000); --records N sets N.

Each job runs as a user runs it (`python -m benchmarks.scaling ...`, benchmarks/scaling.py), and
every process's own CPU is read with psutil: the driver, Ray's own processes (GCS, raylet,
agents, dashboard) and the workers; the tasks' CPU as the manifest records it (`run.task_cpu_s`,
each task measured in its worker). At the margin (4N minus N) start-up costs cancel out, but
only on average: the driver's interpreter start-up and imports (2 s for preprocess, 11 s for
tokenize-images' torch and transformers) vary by more than a loaded machine's whole margin, so
the driver's figure in the BENCH line is its CPU from its stages' start once Ray is up (the
manifest's `run.driver_cpu_s`: all its threads, Ray's included); the psutil figure is printed
beside it.

  BENCH preprocess_cluster_bound baseline=<driver us/record> ours=<job's us/record> unit=us/record ratio=<ours/baseline>
      the speed-up a cluster can reach before the driver is the bottleneck (target >= 500)
  BENCH preprocess_scale baseline=<task us/record at N> ours=<at 4N> unit=us/record ratio=<4N/N>   (<= 1.05)
  BENCH preprocess_driver_rss baseline=<MB at N> ours=<MB at 4N> unit=MB ratio=<4N/N>              (<= 1.10)

plus the tasks' CPU per record by stage at both sizes, the driver's CPU at the margin by thread
(its main thread runs the job's Python; the others are Ray's), and, as a reference, energon's
own `prepare_dataset` on the same (4N) shards.

--job tokenize-images measures `mmdata tokenize-images` the same way over the two preprocess
runs' shards, with a tiny random VQ on the 16 x 16 images at their own size (the per-record
machinery, not the VQ): BENCH tokenize_images_cluster_bound, tokenize_images_scale and
tokenize_images_driver_rss (its tasks' CPU includes the tokenize workers' chunks).

    python -m benchmarks.bench_preprocess_scale [--quick] [--records N] [--num-cpus 2] [--workdir DIR]
        [--job preprocess|tokenize-images]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import tokenize_images_args
from benchmarks.scaling import run_job, run_python

PART_RECORDS = 10_000  # records per annotation file (one scan task each)
IMAGES = 256  # distinct tiny JPEGs the records share
US = 1e6
TOKENIZE_IMAGE_AREA = 16 * 16  # the images' own size: a 2 x 2 grid from the tiny VQ

ENERGON_PREPARE = r"""
import contextlib, io, sys, time
from pathlib import Path
from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory
folder = Path(sys.argv[1])
names = sorted(p.name for p in folder.glob("shard-*.tar"))
t0 = time.process_time()
with contextlib.redirect_stdout(io.StringIO()):
    BaseWebdatasetFactory.prepare_dataset(
        folder, names, split_parts_ratio=[("train", 1.0), ("val", 0.0), ("test", 0.0)], shuffle_seed=None, workers=1
    )
print(f"PREPARE_CPU_S={time.process_time() - t0}")
"""


def write_inputs(root: Path, records: int) -> list[Path]:
    """`root/images/*.jpg` and annotation files of PART_RECORDS records (reused when present)."""
    from PIL import Image

    images = root / "images"
    if not (images / f"{IMAGES - 1}.jpg").exists():
        images.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for i in range(IMAGES):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buf, "JPEG", quality=80)
            (images / f"{i}.jpg").write_bytes(buf.getvalue())
    files = []
    for start in range(0, records, PART_RECORDS):
        path = root / f"part-{start // PART_RECORDS:05d}.jsonl"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w") as f:
                for i in range(start, start + PART_RECORDS):
                    rec = {
                        "id": f"r{i}",
                        "image": f"images/{i % IMAGES}.jpg",
                        "conversations": [
                            {"from": "human", "value": f"<image>\nWhat is in picture {i}?"},
                            {"from": "gpt", "value": f"A small square of noise, number {i % IMAGES}."},
                        ],
                    }
                    f.write(json.dumps(rec) + "\n")
            tmp.rename(path)
        files.append(path)
    return files


def measure(root: Path, files: list[Path], num_cpus: int) -> dict:
    """One job over `files`: the CPU of each kind of process, the manifest's task CPU, peak RSS."""
    out = root / f"out-{len(files)}"
    shutil.rmtree(out, ignore_errors=True)
    args = ["--dataset", "llava-json", "--image-root", str(root), "--output", str(out)]
    args += ["--seed", "0", "--num-cpus", str(num_cpus), "--no-progress", "--input", *map(str, files)]
    values, wall = run_job(args)
    return _figures(out, values, wall, "num_buckets", "buckets")


def measure_tokenize(root: Path, shards: Path, vq: Path, num_cpus: int) -> dict:
    """`mmdata tokenize-images` over the shards of one preprocess run (the tiny VQ, the 16 x 16
    images at their own size: the per-record machinery, not the VQ, is what is measured)."""
    out = root / f"tokens-{shards.name}"
    shutil.rmtree(out, ignore_errors=True)
    args = tokenize_images_args(shards, vq, out, TOKENIZE_IMAGE_AREA, "--num-cpus", str(num_cpus), "--no-progress")
    values, wall = run_job(args, "tokenize-images")
    return _figures(out, values, wall, "chunks", "chunks")


def _figures(out: Path, values: dict[str, float], wall: float, units_key: str, units: str) -> dict:
    """One job's figures from its process's CPU (`values`, run_python) and its manifest; `units`:
    what its work is split into besides shards (the manifest's `run.<units_key>`)."""
    manifest = json.loads((out / "manifest.json").read_text())
    return {
        "records": manifest["counts"]["read"],
        "wall_s": wall,
        "driver_s": values["CPU_DRIVER_S"],
        "driver_main_s": values["CPU_DRIVER_MAIN_S"],
        "driver_job_s": manifest["run"]["driver_cpu_s"],
        "threads": {k.removeprefix("THREAD "): v for k, v in values.items() if k.startswith("THREAD ")},
        "ray_s": values["CPU_RAY_S"],
        "workers_s": values["CPU_WORKERS_S"],
        "total_s": values["CPU_S"],
        "tasks_s": sum(manifest["run"]["task_cpu_s"].values()),
        "task_cpu_s": manifest["run"]["task_cpu_s"],
        "rss_mb": values["PEAK_RSS_KB"] / 1024,
        "shards": len(manifest["shards"]),
        "units": f"{manifest['run'][units_key]} {units}",
        "phases": manifest["run"]["phases"],
        "out": out,
    }


def energon_prepare_s(shards: Path, root: Path) -> float:
    """energon's own `prepare_dataset` CPU seconds on a copy (hard links) of the shards."""
    ref = root / "energon-ref"
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir()
    for tar in shards.glob("shard-*.tar"):
        (ref / tar.name).hardlink_to(tar)
    values, _ = run_python(["-c", ENERGON_PREPARE, str(ref)])
    shutil.rmtree(ref)
    return values["PREPARE_CPU_S"]


def report(small: dict, large: dict, prepare_s: float | None, job: str = "preprocess") -> list[str]:
    """The printed figures and the BENCH lines (named `<job>_cluster_bound`, ...)."""
    n1, n2 = small["records"], large["records"]
    margin = n2 - n1
    kinds = ("driver_s", "driver_job_s", "ray_s", "workers_s", "total_s", "tasks_s")
    per = {k: (large[k] - small[k]) / margin * US for k in kinds}
    floor = 0.01 / margin * US  # psutil's resolution: 10 ms over the margin's records
    driver = max(per["driver_job_s"], floor)
    lines = []
    for r in (small, large):
        lines.append(
            f"{r['records']:>9,} records: wall {r['wall_s']:.1f}s | CPU driver {r['driver_s']:.2f}s "
            f"({r['driver_job_s']:.2f}s from its stages' start), Ray's own "
            f"{r['ray_s']:.2f}s, workers {r['workers_s']:.2f}s (tasks {r['tasks_s']:.2f}s) | driver peak RSS "
            f"{r['rss_mb']:.0f} MB | {r['shards']} shards, {r['units']} | phases {r['phases']}"
        )
    lines.append(
        f"at the margin ({n1:,} -> {n2:,}), us of CPU per record: driver {per['driver_s']:.3f} (from its stages' "
        f"start, without its start-up and imports: {per['driver_job_s']:.3f}), Ray's own "
        f"{per['ray_s']:.3f}, workers {per['workers_s']:.2f}, tasks {per['tasks_s']:.2f}, "
        f"whole job {per['total_s']:.2f}"
    )
    for r in (small, large):
        stages = ", ".join(f"{k.removesuffix('_s')} {v / r['records'] * US:.2f}" for k, v in r["task_cpu_s"].items())
        lines.append(f"{r['records']:>9,} records: tasks' us of CPU per record by stage: {stages}")
    threads = {k: (large["threads"].get(k, 0) - small["threads"].get(k, 0)) / margin * US for k in large["threads"]}
    top = sorted(threads.items(), key=lambda kv: -abs(kv[1]))[:6]
    lines.append(
        f"driver at the margin, us/record by thread: main (the job's Python) "
        f"{(large['driver_main_s'] - small['driver_main_s']) / margin * US:.3f}; "
        + ", ".join(f"{k} {v:.3f}" for k, v in top)
    )
    if prepare_s is not None:
        lines.append(
            f"reference: energon prepare_dataset on the same {large['shards']} shards ({n2:,} samples): "
            f"{prepare_s:.2f} CPU-s, {prepare_s / n2 * US:.2f} us/sample on one core"
        )
    lines += _per_second(small, large)
    lines.append(
        f"cluster bound counting Ray's own processes as serial too: "
        f"{per['total_s'] / max(per['driver_job_s'] + per['ray_s'], floor):.0f}"
    )
    t1, t2 = small["tasks_s"] / n1 * US, large["tasks_s"] / n2 * US
    lines += [
        f"BENCH {job}_cluster_bound baseline={driver:.4f} ours={per['total_s']:.3f} unit=us/record "
        f"ratio={per['total_s'] / driver:.1f}",
        f"BENCH {job}_scale baseline={t1:.3f} ours={t2:.3f} unit=us/record ratio={t2 / t1:.3f}",
        f"BENCH {job}_driver_rss baseline={small['rss_mb']:.1f} ours={large['rss_mb']:.1f} unit=MB "
        f"ratio={large['rss_mb'] / small['rss_mb']:.3f}",
    ]
    return lines


def _per_second(small: dict, large: dict) -> list[str]:
    """The driver's margin as CPU per second of wall time: Ray's threads in the driver tick per
    second (docs/preprocess.md, "at scale"), so the cluster bound is the cores the job keeps busy
    over that rate, and on a cluster of C cores about C over it."""
    wall = large["wall_s"] - small["wall_s"]
    if wall <= 0:
        return []
    rate = (large["driver_job_s"] - small["driver_job_s"]) / wall
    cores = (large["total_s"] - small["total_s"]) / wall
    bound = (
        f"{cores / rate:.0f} (on 256 cores, the per-second part alone: {256 / rate:,.0f})" if rate > 0 else "unbounded"
    )
    return [
        f"driver at the margin per second of wall time: {rate * 1e3:.2f} ms of CPU per s over {wall:.0f} s; "
        f"the job kept {cores:.2f} cores busy, so the bound is cores / rate = {bound}"
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N = 20,000 (and 80,000) instead of 250,000")
    p.add_argument("--records", type=int, help=f"N (a multiple of {PART_RECORDS:,}); the larger run is 4N")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument(
        "--job",
        choices=("preprocess", "tokenize-images"),
        default="preprocess",
        help="the job measured (tokenize-images: over the two preprocess runs' shards, with a tiny random VQ)",
    )
    p.add_argument("--workdir", type=Path, help="where the inputs and outputs go (kept; default: a temp dir)")
    args = p.parse_args(argv)
    n = args.records or (20_000 if args.quick else 250_000)
    if n <= 0 or n % PART_RECORDS:
        print(f"--records must be a positive multiple of {PART_RECORDS:,}, got {n}", file=sys.stderr)
        return 2
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-preprocess-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        files = write_inputs(root, 4 * n)
        print(f"input: {4 * n:,} llava-json records, tiny JPEGs, in {time.perf_counter() - t0:.0f}s", flush=True)
        small = measure(root, files[: len(files) // 4], args.num_cpus)
        large = measure(root, files, args.num_cpus)
        if args.job == "tokenize-images":
            from mmdata.dev.tiny_vq_model import build_tiny_vq  # CLI dispatch: torch, transformers

            vq = build_tiny_vq(root / "vq")
            small = measure_tokenize(root, small["out"], vq, args.num_cpus)
            large = measure_tokenize(root, large["out"], vq, args.num_cpus)
            print("\n".join(report(small, large, None, "tokenize_images")))
        else:
            print("\n".join(report(small, large, energon_prepare_s(large["out"], root))))
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
