"""The job's driver memory does not grow with the data: peak RSS of `mmdata preprocess`'s
process at N and 4N records stays within 20 % (rows, hashes and media never pass through the
driver; it holds per-bucket, per-group and per-shard counts only). Measured as
benchmarks/bench_preprocess.py measures it (the driver process's own VmHWM, input parts of 1,000
records with N a prefix of 4N), with near-duplicate removal and the length index on, so their
stages are covered too. And an input several times the Ray object store goes
through with the driver's memory bounded (`MMDATA_OBJECT_STORE_MB`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmdata.preprocess.synth import generate_records, write_infinity_mm

N = 2000
CHUNK = 1000  # records per generated input part

# The driver, reporting its own peak RSS: VmHWM, not getrusage's ru_maxrss (Linux carries the
# RSS of the forking process across exec, so a driver started from pytest would report pytest's).
DRIVER = r"""
import sys
from mmdata.preprocess.cli import main
rc = main(sys.argv[1:])
with open("/proc/self/status") as f:
    print("PEAK_RSS_KB=" + next(line.split()[1] for line in f if line.startswith("VmHWM:")), flush=True)
sys.exit(rc)
"""


def _run_driver(*args: str) -> dict[str, float]:
    """`mmdata preprocess ARGS` in its own process starting its own Ray; its KEY=value lines."""
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"mmdata preprocess {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return {k: float(v) for k, eq, v in (line.partition("=") for line in proc.stdout.splitlines()) if eq and k.isupper()}


def make_input(root: Path, n_max: int, sizes: list[int], seed: int) -> dict[int, Path]:
    """Inputs for each size: parts of CHUNK records generated once for the largest size; a
    smaller size hard-links the tars of its first parts (so N is a prefix of 4N)."""
    parts = root / "parts"
    for start in range(0, n_max, CHUNK):
        recs = generate_records(min(CHUNK, n_max - start), seed=seed + start)
        write_infinity_mm(recs, parts / f"part{start // CHUNK:04d}", samples_per_tar=250)
    out = {}
    for n in sizes:
        for k in range(n // CHUNK):
            for tar in (parts / f"part{k:04d}").rglob("*.tar"):
                link = root / f"raw_{n}" / tar.relative_to(parts)
                link.parent.mkdir(parents=True, exist_ok=True)
                os.link(tar, link)
        out[n] = root / f"raw_{n}"
    return out


@pytest.mark.slow
def test_driver_rss_flat_from_n_to_4n(tmp_path):
    raws = make_input(tmp_path, 4 * N, [N, 4 * N], seed=0)
    rss = {}
    for n, raw in raws.items():
        out = tmp_path / f"out{n}"
        values = _run_driver("--dataset", "infinity-mm", "--input", str(raw), "--output", str(out),
                             "--samples-per-shard", "500", "--num-cpus", "2", "--no-progress", "--dedup", "phash")
        assert json.loads((out / "manifest.json").read_text())["counts"]["read"] == n
        rss[n] = values["PEAK_RSS_KB"]
    growth = rss[4 * N] / rss[N] - 1
    assert abs(growth) <= 0.2, f"driver peak RSS {rss[N] / 1024:.0f} MB at {N} -> {rss[4 * N] / 1024:.0f} MB at {4 * N}"


@pytest.mark.slow
def test_input_several_times_the_object_store(tmp_path, monkeypatch):
    """An input 16x the object store (Ray's smallest, 75 MiB; 1 MiB noise JPEGs) goes through
    whole, and the driver's peak RSS stays below half the input: rows and media never pass
    through the object store or the driver (tasks read inputs and write shards themselves)."""
    import io
    import os

    import numpy as np
    from PIL import Image

    from mmdata.ray_job import MIN_OBJECT_STORE_MB, OBJECT_STORE_ENV

    buf = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, format="JPEG", quality=90)
    records = generate_records(40, seed=1)
    for r in records:
        for image in r.images:
            image.data = buf.getvalue()
    write_infinity_mm(records, tmp_path / "part", samples_per_tar=20)
    # the same tars under distinct paths (hard links: ids are path + member, so every copy is new)
    tars = sorted((tmp_path / "part").rglob("*.tar"))
    store = MIN_OBJECT_STORE_MB << 20
    copies = -(-16 * store // sum(t.stat().st_size for t in tars))
    raw = tmp_path / "raw"
    for c in range(copies):
        for tar in tars:
            link = raw / f"copy{c:02d}" / tar.relative_to(tmp_path / "part")
            link.parent.mkdir(parents=True, exist_ok=True)
            os.link(tar, link)
    total = sum(t.stat().st_size for t in raw.rglob("*.tar"))
    assert total >= 16 * store
    monkeypatch.setenv(OBJECT_STORE_ENV, str(MIN_OBJECT_STORE_MB))
    out = tmp_path / "out"
    values = _run_driver("--dataset", "infinity-mm", "--input", str(raw), "--output", str(out),
                         "--samples-per-shard", "50", "--num-cpus", "2", "--no-progress", "--no-length-index")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["read"] == copies * len(records) and manifest["counts"]["quarantined"] == 0
    written = sum(s["bytes"] for s in manifest["shards"])
    assert written >= 16 * store
    rss = values["PEAK_RSS_KB"] * 1024
    print(f"input {total / 2**20:.0f} MiB, object store {MIN_OBJECT_STORE_MB} MiB, "
          f"shards {written / 2**20:.0f} MiB, driver peak RSS {rss / 2**20:.0f} MiB")
    assert rss < total / 2, f"driver peak RSS {rss / 2**20:.0f} MiB for {total / 2**20:.0f} MiB of input"


def test_object_store_size_from_the_environment(monkeypatch):
    from mmdata.errors import UserError
    from mmdata.ray_job import OBJECT_STORE_ENV, object_store_bytes

    monkeypatch.delenv(OBJECT_STORE_ENV, raising=False)
    assert object_store_bytes() == 256 << 20
    monkeypatch.setenv(OBJECT_STORE_ENV, "100")
    assert object_store_bytes() == 100 << 20
    for bad in ("50", "1.5", "lots"):
        monkeypatch.setenv(OBJECT_STORE_ENV, bad)
        with pytest.raises(UserError, match=f"{OBJECT_STORE_ENV}='{bad}': give a whole number of MiB, at least 75"):
            object_store_bytes()
