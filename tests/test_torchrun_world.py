"""Under a launcher that is not ours (`torchrun --nproc_per_node 2 mmtrain llava-ov ...`), the
world comes from its environment: the recipe need not say `parallel.nproc_per_node`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mmtrain.runtime.launch import launcher_world
from tests.test_train_runtime import REPO, TINY_RECIPE, free_port, metrics, tokenizer_dir  # noqa: F401


@pytest.mark.unit
def test_torchrun_environment_gives_the_world():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}
    assert launcher_world(env) == ["parallel.nproc_per_node=4", "parallel.nnodes=2"]
    assert launcher_world({"RANK": "0", "WORLD_SIZE": "2"}) == ["parallel.nproc_per_node=2", "parallel.nnodes=1"]
    assert launcher_world({}) == []  # started by hand: the recipe decides


@pytest.mark.slow  # two training processes (about a minute on 2 cores)
def test_torchrun_tp2_without_nproc_per_node(tmp_path, shards_dir, tokenizer_dir):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "mmtrain.cli", "llava-ov", str(TINY_RECIPE), f"run_dir={run}", f"data.paths=[{shards_dir}]",
           f"tokenizer.path={tokenizer_dir}", "data.num_workers=1", "train.seq_length=1024", "train.iters=2",
           "checkpoint.interval=2", "logging.tensorboard=false", "parallel.tp=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMTRAIN_CPU_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    state = json.loads((run / "checkpoints" / "iter_0000002" / "trainer_state.json").read_text())
    assert state["layout"] == {"tp": 2, "pp": 1, "cp": 1, "dp": 1, "world_size": 2}
    assert sorted(metrics(run)) == [1, 2]
