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
run_preprocess to the manifest, Ray start/connect, shutdown/disconnect and the energon index
included) and end to end (`e2e`: the whole subprocess, interpreter start-up and imports
included). Repeated at N and 4N: the driver's peak RSS must stay flat (within 20%) because rows
and media never pass through the driver. From the two sizes, t = fixed + n / rate gives each
side's marginal throughput and fixed start-up cost, and the size where the job overtakes the
baseline end to end; `--scale-copies K` measures that directly on K copies of the 4N input.
It also times Ray alone (start or connect, one empty task per CPU, stop): no Ray job can finish
sooner, so the baseline's time over that floor is the best ratio any Ray job could reach at N.

    .venv/bin/python benchmarks/bench_preprocess.py [--num-samples 4000] [--num-cpus 2]
        [--repeats 3] [--scale-copies 6]

Ends with BENCH lines `BENCH <name> baseline=<x> ours=<y> unit=samples/s ratio=<ours/baseline>`:
`preprocess` (cold job, largest size), `preprocess_warm` (warm job, largest size) and
`preprocess_throughput` (marginal rates, fixed start-up costs excluded).
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


# Ray's own fixed cost, with nothing to do: start (or join) as the job does, run one empty task
# per CPU (so every worker process starts), stop. No job can finish faster, so base_t / floor is
# the highest ratio any Ray job can reach at that size.
RAY_FLOOR = r"""
import sys, time
import ray
from mmdata.preprocess.job import PreprocessConfig, _init_ray

t0 = time.perf_counter()  # like the job's wall_time_s: imports excluded

cfg = PreprocessConfig(dataset="infinity-mm", inputs=[], output="", num_cpus=int(sys.argv[1]),
                       address=sys.argv[2] if len(sys.argv) > 2 else None)
own = _init_ray(cfg)

@ray.remote(num_cpus=1)
def nothing():
    return None

ray.get([nothing.remote() for _ in range(int(ray.cluster_resources()["CPU"]))])
if own:
    ray.shutdown()
print("FLOOR_S=%.3f" % (time.perf_counter() - t0), flush=True)
"""


def _ray_env() -> dict[str, str]:
    """The environment of a measured Ray process: no RAY_ADDRESS from the caller's shell (a cold
    run must start its own instance, never join another; warm runs pass --address)."""
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)
    return env


def ray_floor(num_cpus: int, address: str | None = None) -> float:
    """Seconds Ray alone takes (start or connect, one empty task per CPU, stop), imports excluded."""
    proc = subprocess.run([sys.executable, "-c", RAY_FLOOR, str(num_cpus), *([address] if address else [])],
                          capture_output=True, text=True, env=_ray_env())
    if proc.returncode != 0:
        raise SystemExit(f"Ray floor measurement failed:\n{proc.stdout}\n{proc.stderr}")
    return float(next(l for l in proc.stdout.splitlines() if l.startswith("FLOOR_S=")).split("=")[1])


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
    env = _ray_env()
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


def _median_run(fn, repeats: int):
    """The run with the median wall time of `repeats` runs (machines here are shared and noisy)."""
    runs = sorted((fn() for _ in range(repeats)), key=lambda r: r["t"])
    return runs[len(runs) // 2]


def _scaled_input(root: Path, src: Path, copies: int) -> Path:
    """`copies` copies of an input folder under distinct paths: every record gets a new id in the
    job (ids are file path + member), so all of them are validated, shuffled and written again."""
    big = root / f"raw_x{copies}"
    for c in range(copies):
        shutil.copytree(src, big / f"copy{c:02d}")
    return big


def _fit(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """(marginal samples/s, fixed seconds) of t = fixed + n / rate through two sizes."""
    rate = (n2 - n1) / max(t2 - t1, 1e-9)
    return rate, t1 - n1 / rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-samples", type=int, default=4000, help="N (the second round uses 4N)")
    p.add_argument("--scale-copies", type=int, default=0,
                   help="also run on K copies of the 4N input (K*4N records) to check the end-to-end "
                        "ratio where Ray's fixed start-up cost is amortised (default 0: skip)")
    p.add_argument("--repeats", type=int, default=1, help="runs per measurement; the median is reported")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--samples-per-shard", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warm", action="store_true", help="skip the runs against an already started Ray")
    p.add_argument("--workdir", type=Path, default=None, help="where to put data (default: a temp dir, removed)")
    args = p.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_preprocess_"))
    n, reps = args.num_samples, args.repeats
    rows: list[dict] = []

    def run_base(raw: Path, size: int) -> dict:
        nb, tb = baseline(raw, root / "base", args.samples_per_shard)
        shutil.rmtree(root / "base")
        assert nb == size, (nb, size)
        return {"t": tb}

    def run_ours(raw: Path, size: int, address: str | None = None) -> dict:
        m, wall, rss_kb = ours(raw, root / "ours", args.samples_per_shard, args.num_cpus, address=address)
        shutil.rmtree(root / "ours")
        assert m["counts"]["read"] == size, m["counts"]
        return {"t": m["wall_time_s"], "e2e": wall, "rss_mb": rss_kb / 1024, "m": m}

    try:
        raws = {n: make_input(root, n, args.seed), 4 * n: make_input(root, 4 * n, args.seed)}
        if args.scale_copies:
            raws[4 * n * args.scale_copies] = _scaled_input(root, raws[4 * n], args.scale_copies)
        floors = {"cold": _median_run(lambda: {"t": ray_floor(args.num_cpus)}, reps)["t"]}
        for size, raw in raws.items():
            rows.append({"n": size, "mb": sum(f.stat().st_size for f in raw.rglob("*.tar")) / 1e6,
                         "base": _median_run(lambda: run_base(raw, size), reps),
                         "cold": _median_run(lambda: run_ours(raw, size), reps)})
        if not args.no_warm:
            import ray

            address = _start_warm_ray(args.num_cpus)
            try:
                floors["warm"] = _median_run(lambda: {"t": ray_floor(args.num_cpus, address)}, reps)["t"]
                for r in rows:
                    r["warm"] = _median_run(lambda: run_ours(raws[r["n"]], r["n"], address), reps)
                    assert r["warm"]["m"]["shards"] == r["cold"]["m"]["shards"]  # same bytes either way
            finally:
                ray.shutdown()
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    modes = ["cold"] + ([] if args.no_warm else ["warm"])
    print(f"{'N':>7} {'input MB':>9} {'baseline/s':>11} " + "".join(f"{m + '/s':>8} {m + ' e2e/s':>11} {'ratio':>6} " for m in modes)
          + f"{'driver peak RSS MB':>19}")
    for r in rows:
        line = f"{r['n']:>7} {r['mb']:>9.1f} {r['n'] / r['base']['t']:>11.0f} "
        for m in modes:
            line += f"{r['n'] / r[m]['t']:>8.0f} {r['n'] / r[m]['e2e']:>11.0f} {r['base']['t'] / r[m]['t']:>6.2f} "
        print(line + f"{r['cold']['rss_mb']:>19.1f}")
    for r in rows:
        for m in modes:
            print(f"{m} phases at N={r['n']}: {_phases(r[m]['m'])}")
    # The ceiling: a Ray job can't beat the time Ray alone takes with nothing to do.
    for m in modes:
        print(f"{m}: Ray alone (start or connect, one empty task per CPU, stop) takes "
              f"{floors[m]:.1f}s, so no {m} Ray job can exceed ratio "
              + ", ".join(f"{r['base']['t'] / floors[m]:.2f} at N={r['n']}" for r in rows))
    growth = rows[1]["cold"]["rss_mb"] / rows[0]["cold"]["rss_mb"] - 1
    print(f"driver peak RSS growth N -> 4N (cold): {growth * 100:+.1f}% "
          f"({'flat' if abs(growth) <= 0.2 else 'NOT flat'}, limit 20%)")
    print("cold/s, warm/s = records / job wall time (manifest wall_time_s: Ray start or connect, all stages, "
          "shutdown, energon index); e2e adds interpreter start-up and imports; cold starts a private Ray, "
          "warm joins one already running (--address)")
    # Throughput apart from fixed start-up costs: t = fixed + n / rate through N and 4N.
    fits = {k: _fit(n, rows[0][k]["t"], 4 * n, rows[1][k]["t"]) for k in ["base", *modes]}
    rb, fb = fits["base"]
    for m in modes:
        rate, fixed = fits[m]
        cross = (fixed - fb) / (1 / rb - 1 / rate) if rate > rb else float("inf")
        print(f"{m}: marginal {rate:.0f} samples/s vs baseline {rb:.0f} (ratio {rate / rb:.2f}); fixed cost "
              f"{fixed:.1f}s vs {fb:.1f}s; end-to-end break-even at ~{cross:,.0f} records")
    last = rows[-1]
    for m in modes:
        name = "preprocess" if m == "cold" else f"preprocess_{m}"
        print(f"BENCH {name} baseline={last['n'] / last['base']['t']:.1f} ours={last['n'] / last[m]['t']:.1f} "
              f"unit=samples/s ratio={last['base']['t'] / last[m]['t']:.3f}")
    print(f"BENCH preprocess_throughput baseline={rb:.1f} ours={fits[modes[-1]][0]:.1f} unit=samples/s "
          f"ratio={fits[modes[-1]][0] / rb:.3f}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
