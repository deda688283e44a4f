"""The gpu tier on one GPU skips its multi-GPU tests before building their fixtures (review 2, N5):
before, three of them took the `one_gpu` fixture (a full reference training) and only then skipped.

Run as the tier runs (pytest in a subprocess, MMTRAIN_GPU_TESTS=1) with a plugin that makes torch
report one CUDA device and records every training the tier's helpers start instead of running it.
The one-GPU balance test is selected too: its training is recorded, which shows the recorder sees
what the tests start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MULTI_GPU = (
    "test_vision_tower_own_layout_at_tp2",
    "test_virtual_pipeline_stages_at_pp2",
    "test_balance_exchanges_rows_over_nccl",
    "test_the_features_together_on_four_gpus",
    "test_balance_window_exchanges_steps_of_rows_over_nccl",
)
ONE_GPU = "test_balance_on_one_gpu"

PLUGIN = """
import json, os

import torch

torch.cuda.is_available = lambda: True  # one GPU, as the tier sees it on a one-GPU node
torch.cuda.device_count = lambda: 1


def pytest_configure(config):
    from tests.gpu import runs

    def train(family, run_dir, *args, **kwargs):
        with open(os.environ["GPU_TIER_TRAININGS"], "a") as f:
            f.write(json.dumps({"family": family, "run_dir": str(run_dir)}) + "\\n")
        raise RuntimeError("a training was started (recorded by the test plugin)")

    runs.train = train
"""


def test_one_gpu_trains_nothing_for_the_multi_gpu_tests(tmp_path):
    (tmp_path / "one_gpu_plugin.py").write_text(PLUGIN)
    log = tmp_path / "trainings.jsonl"
    env = {
        **os.environ,
        "MMTRAIN_GPU_TESTS": "1",
        "GPU_TIER_TRAININGS": str(log),
        "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "one_gpu_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
        "tests/gpu/test_gpu_parallel_features.py",
        "-k",
        " or ".join((*MULTI_GPU, ONE_GPU)),
        "--basetemp",
        str(tmp_path / "base"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    out = proc.stdout + proc.stderr
    trainings = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    assert len(trainings) == 1, (trainings, out[-3000:])  # the one-GPU test's, and nothing for the others
    assert re.search(r"\b1 failed\b", out) and re.search(rf"\b{len(MULTI_GPU)} skipped\b", out), out[-3000:]
    assert out.count("needs 2 GPUs (one rank per GPU), 1 visible") + out.count("needs 4 GPUs") >= 2, out[-3000:]
    assert "recorded by the test plugin" in out and ONE_GPU in out
