"""megatron's own DDP settings and optimizer on CPU (issue 29 item 2), and what the checkpoint
records about the optimizer (review A9, B2, C5).

In-process, one gloo rank: megatron DDP with overlapped grad reduction and megatron's optimizer
(`get_megatron_optimizer`: FP32Optimizer around torch AdamW here) step, clip and round-trip through
dist-checkpointing on CPU; the DDP/optimizer configs for the distributed optimizer (GPU) are
checked as data; a checkpoint of another optimizer kind, or without optimizer state, starts the
optimizer fresh and refreshes its weight copies (`reload_model_params`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmtrain.runtime import cpu_compat
from tests.fixtures_training import TINY_PARTS, dp_context, tiny_ddp_and_optimizer, tiny_megatron_module

# `unit` test by test: megatron's dist-checkpoint save starts writer processes
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def _ctx(device: str = "cpu", distributed_optimizer: bool = False, precision: str = "fp32"):
    return dp_context(device=device, precision=precision, distributed_optimizer=distributed_optimizer)


def _optimizer_cfg(**overrides):
    from mmtrain.config.schema import OptimizerConfig

    return OptimizerConfig(**{"lr": 1.0e-2, "min_lr": 1.0e-3, "clip_grad": 0.05, **overrides})


def _train_step(ddp, optimizer, seed: int) -> tuple[bool, float]:
    import contextlib

    torch.manual_seed(seed)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    for micro in range(2):  # grad accumulation: the overlapped reduce starts on the last one
        with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
            ddp(torch.randn(4, 8)).square().sum().backward()
    ddp.finish_grad_sync()
    updated, grad_norm, _ = optimizer.step()
    return updated, float(grad_norm)


# ----------------------------------------------------------------------------- C5 + item 2: configs


@pytest.mark.unit
def test_ddp_settings_are_megatrons_on_every_device():
    """Overlapped grad reduction on CPU as on GPU; the distributed optimizer (GPU) adds the
    overlapped, aligned param all-gather on the DDP config and megatron's OptimizerConfig."""
    from mmtrain.runtime.optimizer import ModelParts, ddp_config_kwargs, megatron_optimizer_config

    cpu, gpu = (
        ddp_config_kwargs(_ctx("cpu")),
        ddp_config_kwargs(_ctx("cuda", distributed_optimizer=True, precision="bf16")),
    )
    assert cpu["overlap_grad_reduce"] is True and gpu["overlap_grad_reduce"] is True
    assert cpu["use_distributed_optimizer"] is False
    assert not cpu["overlap_param_gather"] and not cpu["align_param_gather"]
    assert gpu["use_distributed_optimizer"] and gpu["overlap_param_gather"] and gpu["align_param_gather"]
    from megatron.core.distributed import DistributedDataParallelConfig

    DistributedDataParallelConfig(**gpu)  # megatron accepts the combination
    parts = ModelParts([tiny_megatron_module()], TINY_PARTS)
    config, _ = megatron_optimizer_config(
        parts, _optimizer_cfg(), _ctx("cuda", distributed_optimizer=True, precision="bf16")
    )
    assert config.use_distributed_optimizer and config.overlap_param_gather and config.bf16
    config, _ = megatron_optimizer_config(parts, _optimizer_cfg(), _ctx("cpu"))
    assert not config.use_distributed_optimizer and not config.overlap_param_gather


@pytest.mark.unit
def test_optimizer_kind_names_the_checkpoint_layout():
    from mmtrain.runtime.optimizer import optimizer_kind, optimizer_sharded_metadata

    cpu = optimizer_kind(_ctx("cpu"))
    gpu = optimizer_kind(_ctx("cuda", distributed_optimizer=True, precision="bf16"))
    assert cpu == {"name": "megatron.FP32Optimizer", "sharding_type": "model_space"}
    assert gpu == {"name": "megatron.DistributedOptimizer", "sharding_type": "fully_reshardable"}
    assert optimizer_sharded_metadata(_ctx("cpu")) is None
    # megatron's DistOpt format set explicitly (its default is deprecated), one of the formats it knows
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    md = optimizer_sharded_metadata(_ctx("cuda", distributed_optimizer=True, precision="bf16"))
    assert md == {"distrib_optim_sharding_type": "fully_reshardable"}
    assert md["distrib_optim_sharding_type"] in DistributedOptimizer.checkpoint_fully_reshardable_formats


# ----------------------------------------------------------------------------- item 2: on CPU


@pytest.mark.unit
@cpu_only
def test_megatrons_optimizer_steps_and_clips_on_cpu_with_overlapped_reduce():
    """No stand-in optimizer: megatron's own, with its grad norm and clipping (clip_grad is small,
    so every step clips), after DDP's overlapped bucketed reduce."""
    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer

    ddp, optimizer = tiny_ddp_and_optimizer(_ctx("cpu"), _optimizer_cfg())
    assert ddp.ddp_config.overlap_grad_reduce is True
    assert isinstance(optimizer, ChainedOptimizer)
    assert all(isinstance(o, FP32Optimizer) for o in optimizer.chained_optimizers)
    assert not any("MainGradAdamW" in s or "overlap_grad_reduce off" in s for s in cpu_compat.SUBSTITUTIONS)
    before = [p.detach().clone() for p in ddp.parameters()]
    for step in range(3):
        updated, grad_norm = _train_step(ddp, optimizer, seed=step)
        grads_norm = torch.sqrt(sum(p.main_grad.double().pow(2).sum() for p in ddp.parameters()))
        assert updated and grad_norm > 0.05
        # clipped in place to clip_grad (megatron's coefficient: max_norm / (norm + 1e-6))
        assert float(grads_norm) == pytest.approx(0.05, rel=1e-4)
    assert all(not torch.equal(a, p) for a, p in zip(before, ddp.parameters()))


@cpu_only
def test_megatron_optimizer_state_round_trips_through_dist_checkpointing(tmp_path):
    """A part with its own LR (optimizer.lr_mult) keeps its own param group across a save/load:
    megatron matches saved groups to current ones by (wd_mult, lr_mult, ...), so the part's groups
    carry lr_mult; the moments and the step come back exactly, and training continues identically."""
    from mmtrain.runtime.checkpoint.manager import OptimizerState, TrainerState
    from mmtrain.runtime.optimizer import optimizer_kind

    ctx = _ctx("cpu")
    cfg = _optimizer_cfg(lr_mult={"head": 0.5})
    ddp, optimizer = tiny_ddp_and_optimizer(ctx, cfg)
    groups = optimizer.param_groups
    assert sorted((g["lr_mult"], g["wd_mult"], g["max_lr"]) for g in groups) == [
        (0.5, 0.0, 5.0e-3),
        (0.5, 1.0, 5.0e-3),
        (1.0, 0.0, 1.0e-2),
        (1.0, 1.0, 1.0e-2),
    ]
    for step in range(2):
        _train_step(ddp, optimizer, seed=step)
    (tmp_path / "optimizer").mkdir()
    part = OptimizerState(optimizer, [ddp], optimizer_kind(ctx))
    part.save(tmp_path, ctx)

    ddp2, optimizer2 = tiny_ddp_and_optimizer(ctx, cfg)
    ddp2.module.load_state_dict(ddp.module.state_dict())
    saved = TrainerState(step=2, optimizer=optimizer_kind(ctx))
    assert OptimizerState(optimizer2, [ddp2], optimizer_kind(ctx)).load(tmp_path, ctx, saved) is True
    a, b = optimizer.state_dict(), optimizer2.state_dict()
    for pid, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][pid][key])), (pid, key)
    assert [g["max_lr"] for g in a["param_groups"]] == [g["max_lr"] for g in b["param_groups"]]
    assert _train_step(ddp, optimizer, seed=5) == _train_step(ddp2, optimizer2, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(ddp.parameters(), ddp2.parameters()))


# ----------------------------------------------------------------------------- A9 + B2: resume


class _RecordingOptimizer:
    """Records what the checkpoint manager asks of the optimizer."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reload_model_params(self) -> None:
        self.calls.append("reload_model_params")

    def sharded_state_dict(self, *args, **kwargs):
        self.calls.append("sharded_state_dict")
        raise AssertionError("a checkpoint of another optimizer kind must not be loaded")

    def load_state_dict(self, state) -> None:
        self.calls.append("load_state_dict")


def _restore(tmp_path: Path, trainer_state: dict, with_optimizer_state: bool, kind: dict):
    from mmtrain.runtime.checkpoint.manager import CheckpointManager, ModelState, OptimizerState, StartingPoint

    class ModelPart(ModelState):  # the weights "load" (the test is about the optimizer)
        def __init__(self) -> None:
            pass

        def load(self, ckpt, ctx, saved) -> bool:
            return True

    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000006"
    (ckpt / "optimizer").mkdir(parents=True)
    if with_optimizer_state:
        (ckpt / "optimizer" / "metadata.json").write_text("{}")
    (ckpt / "trainer_state.json").write_text(json.dumps(trainer_state))
    ctx = SimpleNamespace(rank=0, tp=1, pp=1, cp=1, dp=1, world_size=1)
    manager = CheckpointManager(tmp_path / "run", ctx, keep_last=0, resolved_yaml="")
    optimizer = _RecordingOptimizer()
    manager.track(ModelPart(), OptimizerState(optimizer, [], kind) if kind else OptimizerState(optimizer, []))
    result = manager.restore(StartingPoint("mmtrain", ckpt), load_hf=lambda path: None)
    return result, optimizer


@pytest.mark.unit
def test_checkpoint_of_another_optimizer_kind_resumes_with_a_fresh_optimizer(tmp_path, caplog):
    """A CPU-made checkpoint (FP32Optimizer) resumed with the distributed optimizer on GPU: a
    warning and a fresh optimizer (whose fp32 copies are refreshed from the loaded weights), not
    'the checkpoint is damaged'."""
    from mmtrain.runtime.optimizer import optimizer_kind

    cpu_kind = optimizer_kind(_ctx("cpu"))
    gpu_kind = optimizer_kind(_ctx("cuda", distributed_optimizer=True, precision="bf16"))
    with caplog.at_level(logging.WARNING, logger="mmtrain"):
        result, optimizer = _restore(tmp_path, {"step": 6, "optimizer": cpu_kind}, True, gpu_kind)
    assert result.restored == {"model": True, "optimizer": False}
    assert optimizer.calls == ["reload_model_params"]
    assert "holds the state of another optimizer" in caplog.text and "FP32Optimizer" in caplog.text


@pytest.mark.unit
def test_missing_optimizer_state_refreshes_the_weight_copies(tmp_path):
    """B2: an mmtrain resume without optimizer state calls reload_model_params (megatron's
    mixed-precision optimizers would otherwise write their construction-time fp32 copies back)."""
    result, optimizer = _restore(tmp_path, {"step": 6}, False, {})
    assert result.restored == {"model": True, "optimizer": False}
    assert optimizer.calls == ["reload_model_params"]


@pytest.mark.unit
def test_trainer_state_records_the_optimizer_kind():
    from dataclasses import asdict

    from mmtrain.runtime.checkpoint.manager import TrainerState

    state = TrainerState(step=3, optimizer={"name": "megatron.FP32Optimizer", "sharding_type": "model_space"})
    assert TrainerState.from_dict(json.loads(json.dumps(asdict(state)))) == state
    assert TrainerState.from_dict({"step": 3}).optimizer == {}  # older checkpoints: unrecorded
