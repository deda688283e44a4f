"""Benchmark `mmdata preprocess` against what a user would otherwise write, on the same input.

Three sides, each run as its own subprocess on the same Infinity-MM tars (synthetic, realistic
layout):

- ShardWriter: one process reads every record of the tars in input order and writes it with
  `webdataset.ShardWriter` (no validation, no shuffle, no manifest).
- Ray Data: the pipeline Ray's docs suggest for a shuffled WebDataset copy:
  `ray.data.read_webdataset(paths, decoder=None)` -> `random_shuffle(seed=0)` ->
  `write_webdataset(out, encoder=None)`, no validation; plus the one `map` a real run needs:
  samples whose member sets differ (`{stem}.jpg` here, `{stem}.png` there, a second image) come
  back with NaN for the members they lack, which `write_webdataset` rejects, so the map keeps
  the bytes/str fields only.
- ours: the full job (full decode check of every image, seeded global shuffle, energon index,
  length index, manifest), starting its own private Ray (`--num-cpus`).

Timed end to end (the subprocess's wall time: interpreter start-up, imports, Ray start and stop
included: what a user waits for) and by the side itself (ours: the manifest's `wall_time_s`).
Sizes N and 4N (default N = 12,000, so 48,000 at the largest; `--quick`: 1,000 and 4,000, one
run each); each measurement is the median of `--repeats` runs, taken in rounds that run every
side once in turn (so a shared machine's load swings reach all sides alike), and each round's
ours/ShardWriter ratio is printed too (each round: Ray Data first, then ShardWriter and
ours next to each other in alternating order, then the variants). From N and 4N, t = fixed + n /
rate gives each side's marginal throughput and fixed cost. The drivers' peak RSS (ours and Ray
Data's; the baseline's whole process) is printed for both sizes: ours must stay flat (within
20 %) because rows and media never pass through its driver (tests/test_preprocess_scaling.py
asserts it). At 4N ours also runs with `--dedup phash` and with `--no-length-index`, giving the
cost of near-duplicate removal and of the length index as a share of the job. Ray alone (start,
one empty task per CPU, stop) is timed too: no Ray job can finish sooner.

    .venv/bin/python benchmarks/bench_preprocess.py [--num-samples 12000] [--num-cpus 2]
        [--repeats 1] [--quick] [--warm] [--scale-copies K] [--workdir DIR]

Ends with `BENCH <name> baseline=<x> ours=<y> unit=samples/s ratio=<ours/baseline>` lines:
`preprocess` (ours vs ShardWriter, end to end, largest size), `preprocess_vs_ray_data` (ours vs
Ray Data, end to end, largest size), `preprocess_throughput` (marginal end-to-end rates, ours vs
ShardWriter) and, with `--warm`, `preprocess_warm` (ours joining a running Ray, largest size).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmdata.preprocess.synth import generate_records, write_infinity_mm

CHUNK = 1000  # records per generated input part: the N input is a prefix of the 4N one

# The measured process's own peak RSS. Not getrusage's ru_maxrss: Linux carries the RSS of the
# process that forked it across exec (with vfork, the parent's whole footprint), so a driver
# started from a big pytest process would report the test session's memory. VmHWM belongs to the
# process's own address space.
PEAK_RSS = r"""
import resource


def _peak_rss_kb():
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))
    except (OSError, StopIteration):  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"""

OURS = PEAK_RSS + r"""
import resource, sys
from mmdata.preprocess.cli import main
rc = main(sys.argv[1:])
print("PEAK_RSS_KB=" + str(_peak_rss_kb()), flush=True)
sys.exit(rc)
"""

SHARDWRITER = PEAK_RSS + r"""
import resource, sys, tarfile, time
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
print("PEAK_RSS_KB=" + str(_peak_rss_kb()), flush=True)
"""

RAY_DATA = PEAK_RSS + r"""
import resource, sys, tarfile, time
from pathlib import Path

t0 = time.perf_counter()
import ray

raw, out, num_cpus = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=True,
         logging_level="warning")
ray.data.DataContext.get_current().enable_progress_bars = False
paths = sorted(str(p) for p in raw.rglob("*.tar"))
ds = ray.data.read_webdataset(paths, decoder=None)
ds = ds.random_shuffle(seed=0)
# Samples with other member sets come back with NaN for the members they lack: keep the bytes.
ds = ds.map(lambda r: {k: v for k, v in r.items() if isinstance(v, (bytes, str))})
ds.write_webdataset(out, encoder=None)
ray.shutdown()
t = time.perf_counter() - t0
n = 0
for p in Path(out).glob("*.tar"):
    with tarfile.open(p) as tar:
        n += sum(1 for m in tar if m.name.endswith(".json"))
print(f"SAMPLES={n}\nT={t:.3f}")
print("PEAK_RSS_KB=" + str(_peak_rss_kb()), flush=True)
"""

# Ray's own fixed cost, with nothing to do: start (or join) as the job does, run one empty task
# per CPU (so every worker process starts), stop. No job can finish faster.
RAY_FLOOR = r"""
import sys, time
import ray
from mmdata.ray_job import init_ray, shutdown_ray

t0 = time.perf_counter()  # like the job's wall_time_s: imports excluded

own = init_ray(sys.argv[2] if len(sys.argv) > 2 else None, int(sys.argv[1]))

@ray.remote(num_cpus=1)
def nothing():
    return None

ray.get([nothing.remote() for _ in range(int(ray.cluster_resources()["CPU"]))])
shutdown_ray(own)  # the job's own stop
print("FLOOR_S=%.3f" % (time.perf_counter() - t0), flush=True)
"""


def _ray_env() -> dict[str, str]:
    """The environment of a measured Ray process: no RAY_ADDRESS from the caller's shell (a cold
    run must start its own instance, never join another; warm runs pass --address)."""
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)
    return env


def _run(script: str, *args: str) -> tuple[dict[str, float], float, str]:
    """Run a side's script; (its KEY=value lines, end-to-end seconds, stdout)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=_ray_env())
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{script.strip().splitlines()[0]} ... {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    values = {}
    for line in proc.stdout.splitlines():
        key, eq, value = line.partition("=")
        if eq and key.isupper():
            values[key] = float(value)
    return values, wall, proc.stdout


def ray_floor(num_cpus: int, address: str | None = None) -> float:
    """Seconds Ray alone takes (start or connect, one empty task per CPU, stop), imports excluded."""
    return _run(RAY_FLOOR, str(num_cpus), *([address] if address else []))[0]["FLOOR_S"]


def make_input(root: Path, n_max: int, sizes: list[int], seed: int) -> dict[int, Path]:
    """Inputs for each size: parts of CHUNK records generated once for the largest size; a
    smaller size hard-links the tars of its first parts (so N is a prefix of 4N)."""
    parts = root / "parts"
    for start in range(0, n_max, CHUNK):
        recs = generate_records(min(CHUNK, n_max - start), seed=seed + start)
        write_infinity_mm(recs, parts / f"part{start // CHUNK:04d}", samples_per_tar=250)
    out = {}
    for n in sizes:
        d = root / f"raw_{n}"
        d.mkdir()
        for k in range(n // CHUNK):
            for tar in (parts / f"part{k:04d}").rglob("*.tar"):
                link = d / tar.relative_to(parts)
                link.parent.mkdir(parents=True, exist_ok=True)
                os.link(tar, link)
        out[n] = d
    return out


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
    """(marginal samples/s, fixed seconds) of t = fixed + n / rate through two sizes."""
    rate = (n2 - n1) / max(t2 - t1, 1e-9)
    return rate, t1 - n1 / rate


def _phases(m: dict) -> str:
    return ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in m["run"]["phases"].items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-samples", type=int, default=12000, help=f"N, a multiple of {CHUNK} (the second size is 4N)")
    p.add_argument("--quick", action="store_true", help="smoke run: N = 1000, one repeat, no warm runs")
    p.add_argument("--repeats", type=int, default=1, help="runs per measurement; the median is reported")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm", action="store_true", help="also run ours joining an already running Ray (--address)")
    p.add_argument("--scale-copies", type=int, default=0,
                   help="also run ours and ShardWriter on K copies of the 4N input (K*4N records)")
    p.add_argument("--workdir", type=Path, default=None, help="where to put data (default: a temp dir, removed)")
    args = p.parse_args(argv)
    n = 1000 if args.quick else args.num_samples
    reps = 1 if args.quick else args.repeats
    if n % CHUNK or n <= 0:
        p.error(f"--num-samples must be a positive multiple of {CHUNK}")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench_preprocess_"))
    root.mkdir(parents=True, exist_ok=True)
    spp = str(args.samples_per_shard)

    def base(raw: Path, size: int) -> dict:
        v, wall, _ = _run(SHARDWRITER, str(raw), str(root / "base"), spp)
        shutil.rmtree(root / "base")
        assert v["SAMPLES"] == size, (v, size)
        return {"e2e": wall, "t": v["T"], "rss_mb": v["PEAK_RSS_KB"] / 1024}

    def ray_data(raw: Path, size: int) -> dict:
        v, wall, _ = _run(RAY_DATA, str(raw), str(root / "rd"), str(args.num_cpus))
        shutil.rmtree(root / "rd")
        assert v["SAMPLES"] == size, (v, size)
        return {"e2e": wall, "t": v["T"], "rss_mb": v["PEAK_RSS_KB"] / 1024}

    def ours(raw: Path, size: int, *extra: str) -> dict:
        v, wall, _ = _run(OURS, "--dataset", "infinity-mm", "--input", str(raw), "--output", str(root / "ours"),
                          "--seed", "0", "--samples-per-shard", spp, "--num-cpus", str(args.num_cpus), "--no-progress",
                          *extra)
        m = json.loads((root / "ours" / "manifest.json").read_text())
        shutil.rmtree(root / "ours")
        assert m["counts"]["read"] == size, m["counts"]
        return {"e2e": wall, "t": m["wall_time_s"], "rss_mb": v["PEAK_RSS_KB"] / 1024, "m": m}

    sides = {"base": ("ShardWriter", base), "rd": ("Ray Data", ray_data), "ours": ("ours", ours)}
    rows: list[dict] = []
    try:
        raws = make_input(root, 4 * n, [n, 4 * n], args.seed)
        floor = _median_run(lambda: {"e2e": ray_floor(args.num_cpus)}, reps)["e2e"]
        for size, raw in raws.items():
            row = {"n": size, "mb": sum(f.stat().st_size for f in raw.rglob("*.tar")) / 1e6}
            fns = {key: functools.partial(fn, raw, size) for key, (_, fn) in sides.items()}
            if size == 4 * n:  # the costs of dedup and of the length index, in the same rounds
                fns["dedup"] = functools.partial(ours, raw, size, "--dedup", "phash")
                fns["nolen"] = functools.partial(ours, raw, size, "--no-length-index")
            medians, rounds = _rounds(fns, reps)
            row.update(medians, paired=[r["base"]["e2e"] / r["ours"]["e2e"] for r in rounds])
            rows.append(row)
        big = rows[-1]
        if args.scale_copies:
            scaled = _scaled_input(root, raws[4 * n], args.scale_copies)
            size = 4 * n * args.scale_copies
            rows.append({"n": size, "mb": sum(f.stat().st_size for f in scaled.rglob("*.tar")) / 1e6,
                         "base": _median_run(lambda: base(scaled, size), reps),
                         "ours": _median_run(lambda: ours(scaled, size), reps)})
        if args.warm and not args.quick:
            import ray

            ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=True, logging_level="warning")
            address = ray.get_runtime_context().gcs_address
            try:
                big["warm"] = _median_run(lambda: ours(raws[4 * n], 4 * n, "--address", address), reps)
            finally:
                ray.shutdown()
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"{'N':>7} {'input MB':>9} " + "".join(f"{label + ' e2e/s':>18} " for label, _ in sides.values())
          + f"{'ours job/s':>11} {'ours/SW':>8} {'ours/RD':>8} {'RSS MiB ours':>12} {'RSS MiB RD':>10} {'RSS MiB SW':>10}")
    for r in rows:
        line = f"{r['n']:>7} {r['mb']:>9.1f} "
        for key in sides:
            line += f"{r['n'] / r[key]['e2e']:>18.0f} " if key in r else f"{'—':>18} "
        line += f"{r['n'] / r['ours']['t']:>11.0f} {r['base']['e2e'] / r['ours']['e2e']:>8.2f} "
        line += f"{r['rd']['e2e'] / r['ours']['e2e']:>8.2f} " if "rd" in r else f"{'—':>8} "
        line += f"{r['ours']['rss_mb']:>12.0f} " + (f"{r['rd']['rss_mb']:>10.0f} " if "rd" in r else f"{'—':>10} ")
        print(line + f"{r['base']['rss_mb']:>10.0f}")
    print("e2e/s = records / wall time of the whole subprocess (interpreter start-up, imports, Ray start and "
          "stop included); ours job/s = records / the job's own wall_time_s (imports excluded)")
    for r in rows:
        print(f"ours phases at N={r['n']}: {_phases(r['ours']['m'])}")
    for r in rows:
        if "paired" in r:
            print(f"ours/SW per round at N={r['n']} (both sides under the same load): "
                  + ", ".join(f"{x:.2f}" for x in r["paired"]) + f"; median {statistics.median(r['paired']):.2f}")
    print(f"Ray alone (start, one empty task per CPU, stop) takes {floor:.1f}s, so no cold Ray job can exceed "
          + ", ".join(f"{r['n'] / floor:,.0f} samples/s at N={r['n']}" for r in rows[:2]))
    small, large = rows[0], rows[1]
    growth = large["ours"]["rss_mb"] / small["ours"]["rss_mb"] - 1
    rd_growth = large["rd"]["rss_mb"] / small["rd"]["rss_mb"] - 1
    print(f"driver peak RSS growth N -> 4N: ours {growth * 100:+.1f}% "
          f"({'flat' if abs(growth) <= 0.2 else 'NOT flat'}, limit 20%), Ray Data {rd_growth * 100:+.1f}%")
    fits = {k: _fit(n, small[k]["e2e"], 4 * n, large[k]["e2e"]) for k in sides}
    for key, (label, _) in sides.items():
        rate, fixed = fits[key]
        print(f"{label}: marginal {rate:,.0f} samples/s, fixed {fixed:.1f}s (end to end, fit through N and 4N)")
    dedup_share = 1 - large["ours"]["t"] / large["dedup"]["t"]
    len_share = 1 - large["nolen"]["t"] / large["ours"]["t"]
    print(f"cost at N={4 * n} (job wall time): --dedup phash {large['dedup']['t']:.1f}s vs {large['ours']['t']:.1f}s "
          f"without ({dedup_share:+.1%} of the dedup job; hashes from the records' phash field: "
          f"{large['dedup']['m']['curation']['dedup']['phash_images']}); length index: "
          f"{large['ours']['t']:.1f}s vs {large['nolen']['t']:.1f}s without ({len_share:+.1%} of the job)")
    if "warm" in large:
        print(f"ours joining a running Ray (--address) at N={4 * n}: {4 * n / large['warm']['e2e']:,.0f} samples/s "
              f"end to end, job {4 * n / large['warm']['t']:,.0f}/s")
    last = rows[-1]
    print(f"BENCH preprocess baseline={last['n'] / last['base']['e2e']:.1f} ours={last['n'] / last['ours']['e2e']:.1f} "
          f"unit=samples/s ratio={last['base']['e2e'] / last['ours']['e2e']:.3f}")
    print(f"BENCH preprocess_vs_ray_data baseline={large['n'] / large['rd']['e2e']:.1f} "
          f"ours={large['n'] / large['ours']['e2e']:.1f} unit=samples/s ratio={large['rd']['e2e'] / large['ours']['e2e']:.3f}")
    print(f"BENCH preprocess_throughput baseline={fits['base'][0]:.1f} ours={fits['ours'][0]:.1f} unit=samples/s "
          f"ratio={fits['ours'][0] / fits['base'][0]:.3f}")
    if "warm" in large:
        print(f"BENCH preprocess_warm baseline={large['n'] / large['base']['e2e']:.1f} "
              f"ours={large['n'] / large['warm']['e2e']:.1f} unit=samples/s "
              f"ratio={large['base']['e2e'] / large['warm']['e2e']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
