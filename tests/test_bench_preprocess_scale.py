"""The scale benchmark's arithmetic (benchmarks/bench_preprocess_scale.py): figures at the margin,
per stage and per driver thread, and the BENCH lines named for the job measured. (Its quick
run, Ray jobs included, is in tests/test_benchmarks_quick.py.)"""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_preprocess_scale import report

pytestmark = pytest.mark.unit


def _run(records: int, driver: float, tasks: dict[str, float], rss: float, main: float) -> dict:
    """One job's figures; its start-up costs the driver 1.5 s of its CPU (`driver_job_s`: the rest)."""
    return {
        "records": records,
        "wall_s": 1.0,
        "driver_s": driver,
        "driver_main_s": main,
        "driver_job_s": driver - 1.5,
        "threads": {"worker.io": driver - main},
        "ray_s": 1.0,
        "workers_s": sum(tasks.values()) + 0.5,
        "total_s": driver + 1.0 + sum(tasks.values()) + 0.5,
        "tasks_s": sum(tasks.values()),
        "task_cpu_s": tasks,
        "rss_mb": rss,
        "shards": 1,
        "units": "8 chunks",
        "phases": {},
    }


def _bench(lines: list[str]) -> dict[str, dict[str, float]]:
    found = {}
    for line in lines:
        if m := re.fullmatch(r"BENCH (\S+) baseline=(\S+) ours=(\S+) unit=\S+ ratio=(\S+)", line):
            found[m[1]] = {"baseline": float(m[2]), "ours": float(m[3]), "ratio": float(m[4])}
    return found


def test_bench_lines_are_named_for_the_job_and_taken_at_the_margin():
    small = _run(1000, 2.0, {"tokenize_s": 4.0, "write_s": 0.1}, 400.0, 1.5)
    large = _run(4000, 2.3, {"tokenize_s": 17.0, "write_s": 0.5}, 420.0, 1.6)
    lines = report(small, large, None, "tokenize_images")
    bench = _bench(lines)
    assert set(bench) == {"tokenize_images_cluster_bound", "tokenize_images_scale", "tokenize_images_driver_rss"}
    driver = (2.3 - 2.0) / 3000 * 1e6  # us per record at the margin
    job = (large["total_s"] - small["total_s"]) / 3000 * 1e6
    assert bench["tokenize_images_cluster_bound"]["baseline"] == pytest.approx(driver, abs=1e-3)
    assert bench["tokenize_images_cluster_bound"]["ratio"] == pytest.approx(job / driver, abs=0.1)
    assert bench["tokenize_images_scale"]["ratio"] == pytest.approx((17.5 / 4000) / (4.1 / 1000), abs=1e-3)
    assert bench["tokenize_images_driver_rss"]["ratio"] == pytest.approx(420 / 400, abs=1e-3)
    assert not any(line.startswith("reference: energon") for line in lines)  # no energon reference given
    per_stage = [line for line in lines if "by stage" in line]
    assert len(per_stage) == 2 and f"tokenize {4.0 / 1000 * 1e6:.2f}" in per_stage[0]
    (threads,) = [line for line in lines if "by thread" in line]
    assert f"main (the job's Python) {0.1 / 3000 * 1e6:.3f}" in threads


def test_a_driver_with_no_measurable_margin_is_floored_at_psutils_resolution():
    small = _run(10_000, 2.0, {"scan_s": 1.0}, 150.0, 1.9)
    large = _run(40_000, 1.99, {"scan_s": 4.0}, 150.0, 1.89)  # less CPU at 4N: noise
    bench = _bench(report(small, large, 1.0))
    floor = 0.01 / 30_000 * 1e6
    assert bench["preprocess_cluster_bound"]["baseline"] == pytest.approx(floor, abs=1e-4)


def test_the_drivers_margin_per_second_of_wall_time_gives_the_bound_per_core():
    small = {**_run(10_000, 2.0, {"scan_s": 1.0}, 150.0, 1.9), "wall_s": 10.0}
    large = {**_run(40_000, 2.06, {"scan_s": 4.0}, 150.0, 1.9), "wall_s": 30.0}  # 60 ms over 20 s more
    (line,) = [line for line in report(small, large, None) if "per second of wall time" in line]
    cores = (large["total_s"] - small["total_s"]) / 20.0
    assert "3.00 ms of CPU per s over 20 s" in line and f"{cores:.2f} cores busy" in line
    assert f"= {cores / 0.003:.0f} (on 256 cores, the per-second part alone: {256 / 0.003:,.0f})" in line
