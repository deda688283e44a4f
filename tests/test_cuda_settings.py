"""The CUDA-only run settings (review A6, A8, B4, C5), decided by pure functions and checked on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from mmtrain.runtime import cuda_settings as cs


@pytest.mark.unit
@pytest.mark.parametrize(
    "comm,version,refused",
    [
        ("p2p", (2, 12, 0), False),
        ("a2a+p2p", (2, 12, 0), True),  # hierarchical CP has no THD in any release
        ("a2a+p2p", (2, 18, 0), True),
        ("all_gather", (2, 12, 0), True),  # THD with all_gather only from 2.18
        ("all_gather", (2, 18, 1), False),
        ("all_gather", (), True),  # unknown version: refused, not guessed
    ],
)
def test_cp_comm_type_refusals_follow_the_te_version(comm, version, refused):  # A6
    problem = cs.cp_comm_type_problem(comm, cp=2, tp=1, kv_groups=2, attention_heads=12, te_version=version)
    assert (problem is not None) == refused
    if refused:
        assert comm in problem
    assert cs.cp_comm_type_problem(comm, cp=1, tp=1, kv_groups=2, attention_heads=12, te_version=version) is None


@pytest.mark.unit
def test_a2a_needs_the_heads_of_each_tp_rank_to_divide_by_cp():  # A6: Qwen2.5-1.5B has 2 KV heads
    assert cs.cp_comm_type_problem("a2a", cp=2, tp=1, kv_groups=2, attention_heads=12, te_version=(2, 12)) is None
    problem = cs.cp_comm_type_problem("a2a", cp=2, tp=2, kv_groups=2, attention_heads=12, te_version=(2, 12))
    assert problem and "key/value heads" in problem
    assert cs.cp_comm_type_problem("a2a", cp=4, tp=1, kv_groups=2, attention_heads=12, te_version=(2, 12))


@pytest.mark.unit
def test_fp32_on_gpu_gets_tf32_and_is_refused_under_cp():  # A8
    assert cs.precision_problem("fp32", cp=2, on_cuda=True)
    assert cs.precision_problem("bf16", cp=2, on_cuda=True) is None
    assert cs.precision_problem("fp32", cp=2, on_cuda=False) is None  # CPU: our K/V all-gather attention
    assert cs.torch_flags(on_cuda=True, precision="fp32", deterministic=False).tf32
    assert not cs.torch_flags(on_cuda=False, precision="fp32", deterministic=False).tf32
    assert cs.fp32_on_cuda_note("fp32", True) and cs.fp32_on_cuda_note("bf16", True) is None


@pytest.mark.unit
def test_tp_over_one_sets_one_device_connection(monkeypatch, caplog):  # C5
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in cs.process_env(tp=1, deterministic=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with caplog.at_level(logging.WARNING):
        cs.apply_process_env(tp=2, deterministic=False)
    import os

    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in caplog.text


@pytest.mark.unit
def test_deterministic_switch_sets_every_knob(monkeypatch, megatron_cpu):  # B4
    from mmtrain.config.schema import TrainConfig
    from mmtrain.models.megatron_config import ParallelOptions, base_config_kwargs

    assert TrainConfig().deterministic is False
    env = cs.process_env(tp=1, deterministic=True)
    # megatron refuses deterministic_mode with TE unless this is 0 (extensions/transformer_engine.py)
    assert env == {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    for key in env:
        monkeypatch.delenv(key, raising=False)
    cs.apply_process_env(tp=1, deterministic=True)
    import os

    assert all(os.environ[k] == v for k, v in env.items())
    assert base_config_kwargs("float32", ParallelOptions(deterministic=True), sequence_parallel=False)[
        "deterministic_mode"
    ]
    assert not base_config_kwargs("float32", ParallelOptions(), sequence_parallel=False)["deterministic_mode"]
    was = torch.are_deterministic_algorithms_enabled()
    try:
        cs.apply_torch_flags(cs.torch_flags(on_cuda=False, precision="fp32", deterministic=True))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.unit
def test_the_trainer_passes_the_switches_to_the_model(tmp_path):
    """recipe -> ParallelOptions: the run's device, the decoder spec switch and determinism."""
    from types import SimpleNamespace

    from mmtrain import registry
    from mmtrain.config.load import load_recipe
    from mmtrain.runtime.trainer import Trainer

    recipe = load_recipe(
        "recipes/llava-ov-tiny.yaml", ["train.deterministic=true", f"run_dir={tmp_path}"], family="llava-ov"
    )
    trainer = Trainer.__new__(Trainer)
    trainer.recipe, trainer.spec = recipe, registry.get_family("llava-ov")
    trainer.pipeline_split = None  # one stage: megatron's own split
    trainer.ctx = SimpleNamespace(
        tp=1,
        cp=1,
        rank=1,
        on_cuda=False,
        params_dtype=torch.float32,
        sequence_parallel=False,
        recompute="none",
        params_dtype_name="float32",
    )
    opts = trainer._model_options()
    assert opts.deterministic and opts.transformer_impl == "local" and opts.on_cuda is False
