"""Benchmark `mmdata preprocess` against a plain single-process baseline on the same input.

Baseline: read every record of the Infinity-MM tars in input order and write it with
`webdataset.ShardWriter` (no validation, no shuffle, no manifest). Ours: the full Ray job
(full image decode check, seeded global shuffle, energon metadata, manifest), run as a
subprocess so its driver's peak RSS can be measured. Repeated at N and 4N: the driver's peak
RSS must stay flat (within 20%) because rows and media never pass through the driver.

    .venv/bin/python benchmarks/bench_preprocess.py [--num-samples 3000] [--num-cpus 2]

Ends with one line: `BENCH preprocess baseline=<x> ours=<y> unit=samples/s ratio=<ours/baseline>`
(at 4N).
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


def ours(raw: Path, out: Path, samples_per_shard: int, num_cpus: int) -> tuple[dict, float, int]:
    args = ["--dataset", "infinity-mm", "--input", str(raw), "--output", str(out), "--seed", "0",
            "--samples-per-shard", str(samples_per_shard), "--num-cpus", str(num_cpus), "--no-progress"]
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"mmdata preprocess failed:\n{proc.stdout}\n{proc.stderr}")
    rss_kb = int(next(l for l in proc.stdout.splitlines() if l.startswith("PEAK_RSS_KB=")).split("=")[1])
    manifest = json.loads((out / "manifest.json").read_text())
    return manifest, wall, rss_kb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-samples", type=int, default=3000, help="N (the second round uses 4N)")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--samples-per-shard", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="where to put data (default: a temp dir, removed)")
    args = p.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_preprocess_"))
    rows = []
    try:
        for n in (args.num_samples, 4 * args.num_samples):
            t0 = time.perf_counter()
            raw = make_input(root, n, args.seed)
            gen_s = time.perf_counter() - t0
            size_mb = sum(f.stat().st_size for f in raw.rglob("*.tar")) / 1e6
            nb, tb = baseline(raw, root / f"base_{n}", args.samples_per_shard)
            m, wall, rss_kb = ours(raw, root / f"ours_{n}", args.samples_per_shard, args.num_cpus)
            assert nb == n == m["counts"]["read"], (nb, n, m["counts"])
            job_s = m["wall_time_s"]
            rows.append(dict(n=n, mb=size_mb, gen_s=gen_s, base=n / tb, ours=n / job_s, ours_e2e=n / wall,
                             rss_mb=rss_kb / 1024, shards=len(m["shards"]), phases=m["run"]["phases"]))
            shutil.rmtree(raw)
            shutil.rmtree(root / f"base_{n}")
            shutil.rmtree(root / f"ours_{n}")
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'N':>7} {'input MB':>9} {'baseline/s':>11} {'ours/s':>9} {'ours e2e/s':>11} {'ratio':>6} "
          f"{'driver peak RSS MB':>19}")
    for r in rows:
        print(f"{r['n']:>7} {r['mb']:>9.1f} {r['base']:>11.0f} {r['ours']:>9.0f} {r['ours_e2e']:>11.0f} "
              f"{r['ours'] / r['base']:>6.2f} {r['rss_mb']:>19.1f}")
    for r in rows:
        print(f"ours phases at N={r['n']}: " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in r["phases"].items()))
    growth = rows[1]["rss_mb"] / rows[0]["rss_mb"] - 1
    print(f"driver peak RSS growth N -> 4N: {growth * 100:+.1f}% ({'flat' if abs(growth) <= 0.2 else 'NOT flat'}, "
          f"limit 20%); ours/s = records / job wall time (Ray start included), e2e adds interpreter start-up")
    last = rows[-1]
    print(f"BENCH preprocess baseline={last['base']:.1f} ours={last['ours']:.1f} unit=samples/s "
          f"ratio={last['ours'] / last['base']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
