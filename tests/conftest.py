"""Shared fixtures: the fixture modules (`pytest_plugins` below; e.g. `synth_raw_dir` and
`shards_dir` in tests/fixtures_preprocess.py) and the CPU adaptations' clean-up.

`megatron_cpu`: megatron's model-parallel state (TP=1, PP=1) and the CPU adaptations
(`mmtrain.runtime.cpu_compat`) for one test. The adaptations patch torch and megatron process
wide, so they are undone after every test (`_no_leaked_patches`): a test that needs them asks for
this fixture (or calls `ensure_model_parallel`, which applies them).

Tiers: `-m unit` (pure functions and in-process models, no slow test and no other process,
enforced by tests/tier_guard.py: `make test-unit`), the rest is integration (Ray jobs, torchrun
workers, training subprocesses); `-m slow` marks the heaviest of them (`make test-slow`).
Test modules do not import each other: what several share lives in a fixture module.
"""

from __future__ import annotations

import os
import sys

# The CPU tiers hide CUDA before anything imports torch, so a GPU host runs them unchanged (every
# device decision keys on the run's device, and the run's device is then the CPU). The GPU tier
# (`make test-gpu`, tests/gpu/) sets MMTRAIN_GPU_TESTS=1 to keep the GPUs visible.
if os.environ.get("MMTRAIN_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402

# The tier guard and the fixture modules, registered once for the whole session (a fixture imported
# into several test modules instead is registered, and a session fixture built, once per module).
# They stay light at import (heavy imports inside the fixtures): every pytest run loads them.
pytest_plugins = [
    "tests.tier_guard",
    "tests.fixtures_preprocess",
    "tests.fixtures_training",
    "tests.fixtures_convert",
    "tests.emu3_tiny",
    "tests.inspect_fixtures",
]


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
