"""Training-run helpers and fixtures shared by the training test modules (registered for the whole
session in tests/conftest.py, so each session fixture is built once): the `mmtrain llava-ov` CLI
on the tiny recipe in a subprocess, its metrics and checkpoints, the tiny tokenizer, a reference
run and a two-step base run that tests copy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.common import read_dist_ckpt  # noqa: F401 (the training tests' checkpoint reader)
from tests.fixtures_preprocess import free_port
from tests.session_fixtures import session_fixture

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "llava-ov-tiny.yaml"
MMTRAIN = [sys.executable, "-m", "mmtrain.cli", "llava-ov", str(TINY_RECIPE)]
#: the base run's overrides: two steps, a checkpoint after each
BASE_RUN = ("train.iters=2", "checkpoint.interval=1", "checkpoint.keep_last=0")
#: the parallel features together on 4 ranks: TP=2 x PP=2 x VPP=2 with an uneven split, the
#: vision tower's own layout (TP 1) and balancing (the CPU slow tier and the GPU tier run it)
FEATURES_TOGETHER = (
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.vpp=2",
    "parallel.pp_layers=[0,1,0,1]",
    "parallel.vision.tp=1",
    "data.balance=true",
    "data.balance_window=1",
)


def train_env(**extra: str) -> dict[str, str]:
    """The environment of a test's training process: one CPU thread (the tier runs many), `extra` on top."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MMTRAIN_CPU_THREADS": "1", **extra}


def train(
    run_dir: Path,
    shards: Path,
    tokenizer: Path,
    *overrides: str,
    nproc: int = 1,
    expect_rc: int = 0,
    command: list[str] = MMTRAIN,
) -> subprocess.CompletedProcess:
    args = run_overrides(run_dir, shards, tokenizer, *overrides, nproc=nproc)
    proc = subprocess.run(command + args, capture_output=True, text=True, env=train_env(), cwd=REPO)
    if proc.returncode != expect_rc:
        raise AssertionError(
            f"training exited {proc.returncode}, expected {expect_rc}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


@session_fixture
def tokenizer_dir(tmp_path_factory) -> Path:
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory, shards_dir, tokenizer_dir) -> Path:
    """One process, 6 steps, checkpoints every 2 (keep the last 2)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    proc = train(run_dir, shards_dir, tokenizer_dir, "train.iters=6", "checkpoint.interval=2", "checkpoint.keep_last=2")
    (run_dir.parent / "stderr.txt").write_text(proc.stderr)  # its step lines
    return run_dir


def interrupted_copy(ref: Path, dst: Path, at_step: int) -> Path:
    """The state a job killed right after step `at_step`'s checkpoint leaves behind."""
    shutil.copytree(ref, dst)
    ckpts = dst / "checkpoints"
    for d in ckpts.glob("iter_*"):
        if int(d.name[5:]) > at_step:
            shutil.rmtree(d)
    (ckpts / "latest").write_text(f"{at_step}\n")
    return dst


def assert_same_steps(got: dict[int, dict], ref: dict[int, dict], steps, any_order: bool = False) -> None:
    """Losses, grad norms and per-sample losses of `steps` agree (fp32 reduction-order noise);
    `any_order`: the same samples, in any order (rows that balancing moved between micro-batches)."""

    def by_id(record: dict) -> list:  # (id, loss) sorted: a sample drawn twice in a step appears twice
        return sorted(zip(record["sample_ids"], record["sample_losses"]))

    for step in steps:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5, abs=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
        if any_order:
            mine, theirs = by_id(got[step]), by_id(ref[step])
            assert [i for i, _ in mine] == [i for i, _ in theirs], step
            assert [x for _, x in mine] == pytest.approx([x for _, x in theirs], rel=1e-5, abs=1e-6), step
            continue
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], step
        assert got[step]["sample_losses"] == pytest.approx(ref[step]["sample_losses"], rel=1e-5, abs=1e-6), step


def assert_same_losses(got: dict[int, dict], ref: dict[int, dict], steps) -> None:
    """Losses and grad norms of `steps` agree (fp32 reduction-order noise), on the same samples in
    any order (another layout's micro-batches)."""
    for step in steps:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5, abs=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
        assert sorted(got[step]["sample_ids"]) == sorted(ref[step]["sample_ids"]), step


def continue_at_cp2(run_training, run: Path, data: Path, tokenizer: Path, ref_run: Path, *overrides: str):
    """`run_training` (a family's `train(run, data, tokenizer, *overrides, nproc=)`) at CP=2 in 2
    processes, continuing `ref_run` from its step-4 checkpoint to step 6: the CP attention ran, the
    loader state carried across the layout change, and steps 5-6 equal `ref_run`'s.
    -> (the process, the run's metrics)."""
    load = f"checkpoint.load={ref_run / 'checkpoints' / 'iter_0000004'}"
    proc = run_training(run, data, tokenizer, "train.iters=6", *overrides, "parallel.cp=2", load, nproc=2)
    assert "cp=2" in proc.stderr and "KVAllGatherCoreAttention" in proc.stderr
    assert "same layout: False, loader restored: True" in proc.stderr
    got = metrics(run)
    assert sorted(got) == [5, 6]
    assert_same_steps(got, metrics(ref_run), (5, 6))
    return proc, got


@session_fixture
def base_run(tmp_path_factory, shards_dir, tokenizer_dir) -> Path:
    """Two steps at seq_length 1024, a checkpoint after each; tests work on copies."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    train(run_dir, shards_dir, tokenizer_dir, *BASE_RUN)
    return run_dir


def copy_run(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def run_killed(args: list[str], log: Path, **extra_env: str) -> tuple[int, str]:
    """Run a training that dies by SIGKILL; (its exit status, its stderr). Its process group
    goes with it, as a scheduler takes a job's processes (what a bare `kill -9` of the process
    alone leaves: test_a_sigkilled_run_leaves_no_process_behind)."""
    with log.open("w") as f:
        env = train_env(**extra_env)
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=REPO, start_new_session=True)
        rc = p.wait()
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left
        pass
    return rc, log.read_text()


def train_args(run_dir: Path, shards: Path, tokenizer: Path, *overrides: str, nproc: int = 1) -> list[str]:
    """The `mmtrain llava-ov` command line of `train` (for a run the test starts, signals or kills itself)."""
    return MMTRAIN + run_overrides(run_dir, shards, tokenizer, *overrides, nproc=nproc)


def run_overrides(run_dir: Path, shards: Path, tokenizer: Path, *overrides: str, nproc: int = 1) -> list[str]:
    """The recipe overrides of `train` and `train_args`: a small, quiet CPU run on `shards`."""
    return [
        f"run_dir={run_dir}",
        f"data.paths=[{shards}]",
        f"tokenizer.path={tokenizer}",
        "data.num_workers=1",
        "train.seq_length=1024",
        "logging.tensorboard=false",
        f"parallel.nproc_per_node={nproc}",
        f"parallel.master_port={free_port()}",
        *overrides,
    ]


def train_family(family: str, recipe: Path, run_dir: Path, data: Path, tok: Path) -> subprocess.CompletedProcess:
    """One step of `mmtrain FAMILY RECIPE` on `data` with `tok` (the preflight tests' run)."""
    args = [
        f"run_dir={run_dir}",
        f"data.paths=[{data}]",
        f"tokenizer.path={tok}",
        "data.num_workers=1",
        "train.seq_length=512",
        "train.iters=1",
        "logging.tensorboard=false",
    ]
    return subprocess.run(
        [sys.executable, "-m", "mmtrain.cli", family, str(recipe), *args],
        capture_output=True,
        text=True,
        env=train_env(),
        cwd=REPO,
    )


def the_one_refusal(proc: subprocess.CompletedProcess) -> str:
    """The single problem line of a run preflight refused (exit 2, one line per problem)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- in-process building blocks


def dp_context(rank: int = 0, dp: int = 1, device: str = "cpu", **knobs):
    """Rank `rank` of a one-node world of `dp` data-parallel ranks, no TP/PP/CP (gloo on CPU, nccl
    on CUDA); `knobs`: the context's optional fields (precision, distributed_optimizer, ...)."""
    import torch

    from mmtrain.runtime.distributed import ParallelContext

    return ParallelContext(
        rank=rank,
        world_size=dp,
        local_rank=rank,
        tp=1,
        pp=1,
        dp=dp,
        tp_rank=0,
        pp_rank=0,
        dp_rank=rank,
        backend="gloo" if device == "cpu" else "nccl",
        device=torch.device(device),
        **knobs,
    )


#: the declared parts of `tiny_megatron_module`
TINY_PARTS = {"body": ("body",), "head": ("head",)}


def tiny_megatron_module(ctx=None):
    """A megatron module with two declared parts (TINY_PARTS), in `ctx`'s precision (fp32 without one)."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    bf16 = ctx is not None and ctx.precision == "bf16"
    dtype = torch.float32 if ctx is None else ctx.params_dtype
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True, bf16=bf16, params_dtype=dtype
    )

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.body = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.body(x)))

    return Tiny().to(dtype)


def tiny_ddp_and_optimizer(ctx, optimizer_cfg):
    """`tiny_megatron_module` (seed 0) in megatron DDP with our settings for `ctx`, and the
    optimizer `runtime.optimizer.build_optimizer` builds for it."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mmtrain.runtime.distributed import ensure_model_parallel
    from mmtrain.runtime.optimizer import ModelParts, build_optimizer, ddp_config_kwargs

    ensure_model_parallel(1, 1)
    torch.manual_seed(0)
    module = tiny_megatron_module(ctx)
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(**ddp_config_kwargs(ctx)), module)
    return ddp, build_optimizer([ddp], ModelParts([module], TINY_PARTS), optimizer_cfg, ctx)


def step_result(**fields):
    """A trainer `StepResult` of one updated step; `fields` override the defaults."""
    from mmtrain.runtime.step_metrics import StepResult

    defaults = dict(step=1, loss=1.0, grad_norm=1.0, lr=1e-4, updated=True, step_time_s=2.0, data_wait_s=0.0)
    counts = dict(tokens=4096, samples=1, loss_tokens=10, sample_ids=[], sample_losses=[])
    return StepResult(**{**defaults, **counts, **fields})


def logging_trainer(world_size: int, interval: int, peak_flops: float | None) -> tuple[Any, list[dict]]:
    """A `Trainer` with just what its `_log` reads (the logging rank of `world_size` CPU ranks),
    and the list its metrics records go to."""
    import torch

    from mmtrain.runtime.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.ctx = SimpleNamespace(is_logging_rank=True, world_size=world_size, device=torch.device("cpu"))
    t.recipe = SimpleNamespace(logging=SimpleNamespace(interval=interval), train=SimpleNamespace(iters=10))
    t.peak_flops = peak_flops
    records: list[dict] = []
    t.metrics = SimpleNamespace(write=records.append)
    return t, records


def bf16_layout(**dims):
    """A cost-model `Layout` of one TP and DP rank, micro-batch 1, bf16, no recompute, sequence
    parallelism or distributed optimizer; `dims`: pp, global_batch_size, seq_length, ..."""
    from mmtrain.planning.cost_model import Layout

    plain = dict(tp=1, pp=1, dp=1, micro_batch_size=1, recompute="none", sequence_parallel=False)
    return Layout(**{**plain, "distributed_optimizer": False, "precision": "bf16", **dims})
