"""Shared fixtures.

`synth_raw_dir`: 120 synthetic Infinity-MM records (seed 0, no broken ones) in the real
on-disk layout (stageN/<subset>/*.tar). `shards_dir`: that dataset through `mmdata preprocess`
(seed 0, 32 samples per shard, local Ray with 2 CPUs) -> energon-ready shards + manifest.
Both are session-scoped and read-only for tests: copy before modifying.

`megatron_cpu`: megatron's model-parallel state (TP=1, PP=1) and the CPU adaptations
(`mmtrain.runtime.cpu_compat`) for one test. The adaptations patch torch and megatron process
wide, so they are undone after every test (`_no_leaked_patches`): a test that needs them asks for
this fixture (or calls `ensure_model_parallel`, which applies them).

Tiers: `-m unit` (pure functions and in-process models, no other processes: `make test-unit`),
the rest is integration (Ray jobs, torchrun workers, training subprocesses); `-m slow` marks the
heaviest of them (`make test-slow`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The CPU tiers hide CUDA before anything imports torch, so a GPU host runs them unchanged (every
# device decision keys on the run's device, and the run's device is then the CPU). The GPU tier
# (`make test-gpu`, tests/gpu/) sets MMTRAIN_GPU_TESTS=1 to keep the GPUs visible.
if os.environ.get("MMTRAIN_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402

SYNTH_NUM_SAMPLES = 120
SYNTH_SEED = 0
SHARDS_SAMPLES_PER_SHARD = 32


def run_preprocess_cli(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `mmdata preprocess` in a subprocess (its own Ray instance, nothing left in pytest)."""
    cmd = [sys.executable, "-m", "mmdata.preprocess.cli", "--no-progress", *args]
    full_env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(autouse=True)
def _no_leaked_patches():
    """Undo the CPU adaptations a test applied (only if the module was ever imported), and the
    environment variables it set: a leaked RANK/WORLD_SIZE/MASTER_ADDR (e.g. from code that maps
    a SLURM allocation onto the worker env) would make every later training subprocess wait for
    a rendezvous that never comes."""
    environ = dict(os.environ)
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    cpu_compat = sys.modules.get("mmtrain.runtime.cpu_compat")
    if cpu_compat is not None:
        cpu_compat.revert()


@pytest.fixture
def megatron_cpu():
    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1)


@pytest.fixture(scope="session")
def synth_raw_dir(tmp_path_factory) -> Path:
    from mmdata.dev.synth import generate_records, write_infinity_mm

    out = tmp_path_factory.mktemp("synth") / "raw"
    write_infinity_mm(generate_records(SYNTH_NUM_SAMPLES, seed=SYNTH_SEED, synthetic=True), out, samples_per_tar=20)
    return out


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory, synth_raw_dir) -> Path:
    out = tmp_path_factory.mktemp("shards") / "shards"
    run_preprocess_cli("--dataset", "infinity-mm", "--input", str(synth_raw_dir), "--output", str(out),
                       "--seed", str(SYNTH_SEED), "--samples-per-shard", str(SHARDS_SAMPLES_PER_SHARD),
                       "--num-cpus", "2")
    return out
