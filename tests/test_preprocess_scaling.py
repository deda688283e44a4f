"""The job's driver memory does not grow with the data: peak RSS of `mmdata preprocess`'s
process at N and 4N records stays within 20 % (rows, hashes and media never pass through the
driver; it holds per-bucket, per-group and per-shard counts only). Measured as
benchmarks/bench_preprocess.py measures it (benchmarks/scaling.py: the driver process's
own VmHWM, N a prefix of 4N; gradient images here, photo-like there), with near-duplicate removal
and the length index on, so their stages are covered too. And an input several times the Ray
object store goes through with the driver's memory bounded (`MMDATA_OBJECT_STORE_MB`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scaling import run_job, write_nested_inputs
from mmdata.dev.synth import generate_records, write_infinity_mm
from tests.cli_runs import flags

N = 2000


def _job(raw: Path, out: Path, **options: object) -> tuple[dict[str, float], float]:
    """`mmdata preprocess` of infinity-mm on 2 CPUs as the benchmark runs and measures it."""
    return run_job(flags(dataset="infinity-mm", input=raw, output=out, num_cpus=2, no_progress=True, **options))


@pytest.mark.slow
def test_driver_rss_flat_from_n_to_4n(tmp_path):
    raws = write_nested_inputs(tmp_path, [N, 4 * N], seed=0, synthetic=True).by_size
    rss = {}
    for n, raw in raws.items():
        out = tmp_path / f"out{n}"
        values, _ = _job(raw, out, samples_per_shard=500, dedup="phash")
        assert json.loads((out / "manifest.json").read_text())["counts"]["read"] == n
        rss[n] = values["PEAK_RSS_KB"]
        # the benchmark's CPU split finds the job's Ray workers (it fails if Ray renames its worker script)
        assert values["CPU_WORKERS_S"] > 0 and values["CPU_DRIVER_S"] > 0, values
        assert sum(values[f"CPU_{k}_S"] for k in ("DRIVER", "WORKERS", "RAY")) == pytest.approx(values["CPU_S"])
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
    records = generate_records(40, seed=1, synthetic=True)
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
    values, _ = _job(raw, out, samples_per_shard=50, no_length_index=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["read"] == copies * len(records) and manifest["counts"]["quarantined"] == 0
    written = sum(s["bytes"] for s in manifest["shards"])
    assert written >= 16 * store
    rss = values["PEAK_RSS_KB"] * 1024
    print(
        f"input {total / 2**20:.0f} MiB, object store {MIN_OBJECT_STORE_MB} MiB, "
        f"shards {written / 2**20:.0f} MiB, driver peak RSS {rss / 2**20:.0f} MiB"
    )
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


def test_nested_inputs_are_prefixes_and_reuse_their_parts(tmp_path):
    """The N input is the first parts of the 4N one (the same files, hard-linked); a second call
    reuses the generated parts instead of generating them again."""
    import tarfile

    def tars(raw):
        return {str(p.relative_to(raw)): p.stat().st_ino for p in raw.rglob("*.tar")}

    inputs = write_nested_inputs(tmp_path, [8, 32], seed=3, synthetic=True, part_records=8)
    small, large = tars(inputs.by_size[8]), tars(inputs.by_size[32])
    assert small and small.items() <= large.items() and len(large) == 4 * len(small)
    assert (
        sum(name.endswith(".json") for t in inputs.by_size[32].rglob("*.tar") for name in tarfile.open(t).getnames())
        == 32
    )
    again = write_nested_inputs(tmp_path, [8, 32], seed=3, synthetic=True, part_records=8)
    assert tars(again.by_size[32]) == large
    with pytest.raises(ValueError, match="multiples of 8"):
        write_nested_inputs(tmp_path, [12], part_records=8)


def test_measured_process_counts_its_descendants_cpu():
    """run_python's CPU_S covers the whole process tree (a Ray job's work runs in grandchildren):
    here a grandchild burns 0.6 CPU-seconds while its parent only waits, then idles a few polls so
    its last CPU time is read before it ends; KEY=value lines come back."""
    from benchmarks.scaling import POLL_S, run_python

    burn = f"import time\nwhile time.process_time() < 0.6: pass\ntime.sleep({4 * POLL_S})"
    values, wall = run_python(
        ["-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}]); print('ANSWER=42')"]
    )
    assert values["ANSWER"] == 42 and wall > 0
    assert values["CPU_S"] >= 0.6, values
    # split by who spent it: the grandchild (nearly all of it) is no Ray worker, so it counts under "ray"
    assert values["CPU_RAY_S"] >= 0.5 and values["CPU_WORKERS_S"] == 0, values
    assert values["CPU_DRIVER_S"] + values["CPU_RAY_S"] == pytest.approx(values["CPU_S"]), values
