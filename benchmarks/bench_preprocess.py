"""Benchmark `mmdata preprocess` against a plain single-process baseline on the same input.

Baseline: read every record of the Infinity-MM tars in input order and write it with
`webdataset.ShardWriter` (no validation, no shuffle, no manifest). Ours: the full Ray job
(full image decode check, seeded global shuffle, energon metadata, manifest), run as a
subprocess so its driver's peak RSS can be measured, in two settings:

- cold: the job starts (and stops) its own private local Ray instance, as `mmdata preprocess`
  does by default. This is the headline figure: it includes Ray start-up and shutdown.
- warm: a Ray instance (same CPU cap) is already running and the job joins it with
  `--address`, the normal production case on a cluster. Ray start-up is then not paid.

Both are timed by the job itself (`wall_time_s` in the manifest: from the start of
run_preprocess to the manifest, Ray start/connect, shutdown/disconnect and energon preparation
included) and end to end (`e2e`: the whole subprocess, interpreter start-up and imports
included). Repeated at N and 4N: the driver's peak RSS must stay flat (within 20%) because rows
and media never pass through the driver.

    .venv/bin/python benchmarks/bench_preprocess.py [--num-samples 4000] [--num-cpus 2]

Ends with one line (figures at 4N; the end-to-end and warm figures on the line before it):
`BENCH preprocess baseline=<x> ours=<cold job> unit=samples/s ratio=<ours/baseline>`
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import webdataset as wds

from mmdata.preprocess.synth import generate_records, write_infinity_mm

DRIVER = r"""
import json, resource, sys
from mmdata.preprocess.cli import main
rc = main(sys.argv[1:])
print("PEAK_RSS_KB=" + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), flush=True)
sys.exit(rc)
"""


def make_input(root: Path, n: int, seed: int) -> Path:
    raw = root / f"raw_{n}"
    # Generated in chunks so the generator itself never holds 4N images.
    chunk = 1000
    for start in range(0, n, chunk):
        recs = generate_records(min(chunk, n - start), seed=seed + start)
        write_infinity_mm(recs, raw / f"part{start // chunk:04d}", samples_per_tar=250)
    return raw


def baseline(raw: Path, out: Path, samples_per_shard: int) -> tuple[int, float]:
    """Plain single-process copy in input order with webdataset.ShardWriter."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n = 0
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=samples_per_shard, verbose=0) as sink:
        for tar_path in sorted(raw.rglob("*.tar")):
            with tarfile.open(tar_path) as tar:
                sample: dict = {}
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
    return n, time.perf_counter() - t0


def ours(raw: Path, out: Path, samples_per_shard: int, num_cpus: int,
         address: str | None = None) -> tuple[dict, float, int]:
    args = ["--dataset", "infinity-mm", "--input", str(raw), "--output", str(out), "--seed", "0",
            "--samples-per-shard", str(samples_per_shard), "--num-cpus", str(num_cpus), "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)  # cold runs must start their own instance, never join another
    if address:
        args += ["--address", address]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mmdata preprocess failed:\n{proc.stdout}\n{proc.stderr}")
    rss_kb = int(next(l for l in proc.stdout.splitlines() if l.startswith("PEAK_RSS_KB=")).split("=")[1])
    manifest = json.loads((out / "manifest.json").read_text())
    return manifest, wall, rss_kb


def _start_warm_ray(num_cpus: int) -> str:
    """A private local Ray instance owned by this process (stopped by ray.shutdown(), which only
    ends the processes it started); jobs join it with --address."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=256 << 20,
             log_to_driver=False, configure_logging=True, logging_level="warning")
    return ray.get_runtime_context().gcs_address


def _phases(m: dict) -> str:
    return ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in m["run"]["phases"].items()) + \
        f" (input files scanned by the driver itself while Ray and its workers started: {m['run'].get('scanned_in_driver', 0)})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-samples", type=int, default=4000, help="N (the second round uses 4N)")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--samples-per-shard", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warm", action="store_true", help="skip the runs against an already started Ray")
    p.add_argument("--workdir", type=Path, default=None, help="where to put data (default: a temp dir, removed)")
    args = p.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_preprocess_"))
    sizes = (args.num_samples, 4 * args.num_samples)
    rows = []
    try:
        raws = {}
        for n in sizes:
            t0 = time.perf_counter()
            raws[n] = make_input(root, n, args.seed)
            gen_s = time.perf_counter() - t0
            size_mb = sum(f.stat().st_size for f in raws[n].rglob("*.tar")) / 1e6
            nb, tb = baseline(raws[n], root / f"base_{n}", args.samples_per_shard)
            shutil.rmtree(root / f"base_{n}")
            m, wall, rss_kb = ours(raws[n], root / f"ours_{n}", args.samples_per_shard, args.num_cpus)
            shutil.rmtree(root / f"ours_{n}")
            assert nb == n == m["counts"]["read"], (nb, n, m["counts"])
            rows.append(dict(n=n, mb=size_mb, gen_s=gen_s, base=n / tb, ours=n / m["wall_time_s"],
                             ours_e2e=n / wall, rss_mb=rss_kb / 1024, shards=len(m["shards"]), m=m))
        if not args.no_warm:
            import ray

            address = _start_warm_ray(args.num_cpus)
            try:
                for r in rows:
                    n = r["n"]
                    m, wall, rss_kb = ours(raws[n], root / f"warm_{n}", args.samples_per_shard, args.num_cpus,
                                           address=address)
                    shutil.rmtree(root / f"warm_{n}")
                    assert m["counts"] == r["m"]["counts"] and m["shards"] == r["m"]["shards"]  # same bytes
                    r.update(warm=n / m["wall_time_s"], warm_e2e=n / wall, warm_rss_mb=rss_kb / 1024, wm=m)
            finally:
                ray.shutdown()
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    warm = not args.no_warm
    print(f"{'N':>7} {'input MB':>9} {'baseline/s':>11} {'cold/s':>8} {'cold e2e/s':>11} {'ratio':>6} "
          + (f"{'warm/s':>8} {'warm e2e/s':>11} {'ratio':>6} " if warm else "") + f"{'driver peak RSS MB':>19}")
    for r in rows:
        print(f"{r['n']:>7} {r['mb']:>9.1f} {r['base']:>11.0f} {r['ours']:>8.0f} {r['ours_e2e']:>11.0f} "
              f"{r['ours'] / r['base']:>6.2f} "
              + (f"{r['warm']:>8.0f} {r['warm_e2e']:>11.0f} {r['warm'] / r['base']:>6.2f} " if warm else "")
              + f"{r['rss_mb']:>19.1f}")
    for r in rows:
        print(f"cold phases at N={r['n']}: {_phases(r['m'])}")
        if warm:
            print(f"warm phases at N={r['n']}: {_phases(r['wm'])}")
    growth = rows[1]["rss_mb"] / rows[0]["rss_mb"] - 1
    print(f"driver peak RSS growth N -> 4N (cold): {growth * 100:+.1f}% "
          f"({'flat' if abs(growth) <= 0.2 else 'NOT flat'}, limit 20%)")
    print("cold/s, warm/s = records / job wall time (manifest wall_time_s: Ray start or connect, all stages, "
          "shutdown, energon prepare); e2e adds interpreter start-up and imports; cold starts a private Ray, "
          "warm joins one already running (--address)")
    last = rows[-1]
    extra = f"ours_e2e={last['ours_e2e']:.1f}"
    if warm:
        extra += f" ours_warm={last['warm']:.1f} ratio_warm={last['warm'] / last['base']:.3f}"
    print(f"at N={last['n']}, {args.num_cpus} cpus: {extra}; ours includes validation + global shuffle + "
          "energon prepare + Ray start")
    print(f"BENCH preprocess baseline={last['base']:.1f} ours={last['ours']:.1f} unit=samples/s "
          f"ratio={last['ours'] / last['base']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
