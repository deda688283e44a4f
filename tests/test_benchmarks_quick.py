"""Every benchmark in benchmarks/ runs to its end in its `--quick` mode (issue 30: benchmarks
that cannot rot). A benchmark no test runs breaks silently when the code under it changes (the
train_llava sample check did, when metrics' sample ids became `DATASET#SHARD_KEY` keys), so each
`bench_*.py` runs here as a user runs it (`python -m benchmarks.NAME`), in a subprocess, and must exit 0 and print its
`BENCH <name> ... ratio=` line. The ratio's value is not checked: quick sizes measure nothing.

Benchmarks whose quick run still needs Ray jobs or many training processes are `slow`
(`pytest -m slow tests/test_benchmarks_quick.py`); the rest run in the default tier.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"

# script -> the BENCH line it must print; slow: why its quick run cannot take seconds
QUICK_RUNS: dict[str, tuple[str, str | None]] = {
    "bench_varlen_attention.py": ("varlen_attention", None),
    "bench_train_llava.py": ("train_llava", None),
    "bench_loader.py": ("loader", None),
    "bench_generate.py": ("generate_llava_ov", None),
    "bench_train_emu3.py": ("train_emu3", "its data needs two Ray jobs (preprocess, tokenize-images)"),
    "bench_auto_tune.py": ("auto_tune_trials", "each trial is a 2-process training run"),
    "bench_long_context.py": ("long_context", "a sweep of ~10 training processes at the Qwen2 vocabulary"),
    "bench_preprocess.py": ("preprocess_vs_decode_floor", "Ray jobs (ours and Ray Data) at 250 and 1,000 records"),
    "bench_preprocess_scale.py": ("preprocess_cluster_bound", "Ray jobs at 20,000 and 80,000 records"),
    "bench_tokenize_images.py": ("tokenize_images", "ours is a Ray job"),
    "bench_private_internals.py": ("direct_io", None),
    "bench_vision_layout.py": ("vision_layout", None),
    "bench_global_reads.py": ("global_order_bytes_per_rank", "its data needs a Ray job (preprocess: the length index)"),
    "bench_global_order.py": ("global_order_fill", None),
    "bench_global_throughput.py": ("global_order_loader", "its data needs a Ray job (preprocess: the length index)"),
}
# script -> the BENCH lines it prints besides its main one
MORE_LINES: dict[str, tuple[str, ...]] = {
    "bench_loader.py": ("loader_cores_per_gpu",),
    "bench_global_order.py": ("global_order_balance",),
    "bench_preprocess_scale.py": ("preprocess_scale", "preprocess_driver_rss"),
}


def _params() -> list:
    return [
        pytest.param(script, name, id=script.removesuffix(".py"), marks=[pytest.mark.slow] if why else [])
        for script, (name, why) in QUICK_RUNS.items()
    ]


def _env() -> dict[str, str]:
    """A user's shell: the repo importable, Ray jobs starting their own private instance."""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("RAY_ADDRESS", None)
    return env


def bench_line(stdout: str, name: str) -> str | None:
    """The `BENCH <name> baseline=.. ours=.. unit=.. ratio=..` line of a run's output, if any."""
    pattern = re.compile(rf"^BENCH {re.escape(name)} baseline=\S+ ours=\S+ unit=\S+ ratio=\S+$", re.M)
    match = pattern.search(stdout)
    return match.group(0) if match else None


def test_every_benchmark_has_a_quick_run() -> None:
    """A new bench_*.py must get a --quick mode and a row here; GPU checks (gpu_*.py) are not benchmarks."""
    scripts = {p.name for p in BENCHMARKS.glob("bench_*.py")}
    assert scripts == set(QUICK_RUNS), (
        f"not covered: {sorted(scripts - set(QUICK_RUNS))}, gone: {sorted(set(QUICK_RUNS) - scripts)}"
    )
    for script in scripts:
        assert '"--quick"' in (BENCHMARKS / script).read_text(), f"{script} has no --quick option"


def test_bench_line_pattern() -> None:
    """The check below can fail: a line without its ratio, or another benchmark's line, is no match."""
    assert bench_line("x\nBENCH loader baseline=1.0 ours=2.0 unit=samples/s ratio=2.00\n", "loader")
    assert bench_line("BENCH loader baseline=1.0 ours=2.0 unit=samples/s\n", "loader") is None
    assert bench_line("BENCH loader_x baseline=1 ours=2 unit=s ratio=2\n", "loader") is None


@pytest.mark.parametrize("script,name", _params())
def test_quick_run_ends_with_its_bench_line(script: str, name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script.removesuffix('.py')}", "--quick"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
    )
    tail = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{script} --quick exited {proc.returncode}\n{tail}"
    for line in (name, *MORE_LINES.get(script, ())):
        assert bench_line(proc.stdout, line), f"{script} --quick printed no 'BENCH {line} ... ratio=' line\n{tail}"
