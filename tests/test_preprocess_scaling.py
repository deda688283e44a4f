"""The job's driver memory does not grow with the data: peak RSS of `mmdata preprocess`'s
process at N and 4N records stays within 20 % (rows, hashes and media never pass through the
driver; it holds per-bucket, per-group and per-shard counts only). Measured exactly as
benchmarks/bench_preprocess.py measures it, with near-duplicate removal and the length index
on, so their stages are covered too."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_preprocess import OURS, _run, make_input

N = 2000


@pytest.mark.slow
def test_driver_rss_flat_from_n_to_4n(tmp_path):
    raws = make_input(tmp_path, 4 * N, [N, 4 * N], seed=0)
    rss = {}
    for n, raw in raws.items():
        out = tmp_path / f"out{n}"
        values, _, _ = _run(OURS, "--dataset", "infinity-mm", "--input", str(raw), "--output", str(out),
                            "--samples-per-shard", "500", "--num-cpus", "2", "--no-progress", "--dedup", "phash")
        assert json.loads((out / "manifest.json").read_text())["counts"]["read"] == n
        rss[n] = values["PEAK_RSS_KB"]
    growth = rss[4 * N] / rss[N] - 1
    assert abs(growth) <= 0.2, f"driver peak RSS {rss[N] / 1024:.0f} MB at {N} -> {rss[4 * N] / 1024:.0f} MB at {4 * N}"
