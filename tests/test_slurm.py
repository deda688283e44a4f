"""A SLURM allocation mapped onto the launcher's settings (mmtrain/runtime/slurm.py), from the
environment variables srun sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmtrain.runtime.slurm import expand_hostlist, slurm_allocation

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x-[009-011],y", ["x-009", "x-010", "x-011", "y"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def _srun_env(**extra: str) -> dict[str, str]:
    """What `srun -N 4 --ntasks-per-node=1` sets in the task on the third node."""
    return {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "gpu[07-10]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
        **extra,
    }


def _recipe(*overrides: str):
    from mmtrain.config import load_recipe

    return load_recipe(REPO / "recipes" / "llava-ov-tiny.yaml", list(overrides), family="llava-ov")


def test_one_task_per_node_sets_the_launcher(monkeypatch):
    from mmtrain.runtime.launcher import use_slurm_allocation

    for k, v in _srun_env().items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    recipe = _recipe("parallel.nproc_per_node=8", "parallel.tp=8")
    use_slurm_allocation(recipe)
    p = recipe.parallel
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port, p.nproc_per_node) == (
        4,
        2,
        "gpu07",
        20000 + 123456 % 20000,
        8,
    )
    assert p.world_size == 32
    import os

    assert "RANK" not in os.environ  # this task launches torchrun; it is no worker itself


def test_one_task_per_process_sets_the_worker_env(monkeypatch):
    from mmtrain.runtime.distributed import env_rank_world
    from mmtrain.runtime.launcher import use_slurm_allocation

    env = _srun_env(SLURM_NTASKS="32", SLURM_PROCID="21", SLURM_LOCALID="5", MASTER_PORT="29999")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    recipe = _recipe("parallel.nproc_per_node=8", "parallel.nnodes=4", "parallel.tp=8", "parallel.pp=2")
    use_slurm_allocation(recipe)
    assert env_rank_world() == (21, 32, 5)
    import os

    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu07", "29999")
    assert recipe.parallel.nnodes == 4  # untouched: the world comes from the allocation


def test_outside_srun_nothing_changes():
    assert slurm_allocation({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}) is None  # the batch script's shell
    assert slurm_allocation({}) is None
    one = slurm_allocation({"SLURM_PROCID": "0", "SLURM_NODELIST": "n[1-2]", "SLURM_NTASKS": "2"})
    assert one.one_task_per_process(nproc_per_node=1) and not one.one_task_per_process(nproc_per_node=4)
