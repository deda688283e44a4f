"""Under a launcher that is not ours (`torchrun --nproc_per_node 2 mmtrain llava-ov ...`), the
world comes from its environment: the recipe need not say `parallel.nproc_per_node`. A real
training started that way (TP=2 by torchrun):
tests/test_train_runtime.py::test_tensor_parallel_checkpoint_resumes_at_tp1 (slow)."""

from __future__ import annotations

import pytest

from mmtrain.runtime.torchrun import launcher_world


@pytest.mark.unit
def test_torchrun_environment_gives_the_world():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3"}
    assert launcher_world(env) == ["parallel.nproc_per_node=4", "parallel.nnodes=2"]
    assert launcher_world({"RANK": "0", "WORLD_SIZE": "2"}) == ["parallel.nproc_per_node=2", "parallel.nnodes=1"]
    assert launcher_world({}) == []  # started by hand: the recipe decides
