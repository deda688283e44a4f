"""The CPU adaptation layer (mmtrain/runtime/cpu_compat.py): idempotent, undone by `revert`,
inert by design where CUDA exists, and it makes the megatron calls our model path relies on work
on a CPU-only torch."""

from __future__ import annotations

import pytest
import torch

from mmtrain.runtime import cpu_compat

pytestmark = pytest.mark.unit
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


@cpu_only
def test_apply_is_idempotent_redirects_and_reverts():
    from mmtrain.runtime.distributed import compute_device

    originals = (torch.zeros, torch.cuda.current_device, torch.Tensor.cuda)
    assert cpu_compat.apply() is True
    n = len(cpu_compat.SUBSTITUTIONS)
    assert cpu_compat.apply() is True
    assert len(cpu_compat.SUBSTITUTIONS) == n  # second call substitutes nothing more
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.arange(3, device=torch.device("cuda")).device.type == "cpu"
    assert torch.empty(1, device=0).device.type == "cpu"
    t = torch.ones(2)
    assert t.cuda() is t
    torch.cuda.synchronize()
    assert compute_device() == torch.device("cpu")
    assert torch.zeros.__wrapped__ is originals[0]  # wrapped once
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    # megatron's clipping minus its torch.cuda.FloatTensor assertion; the original is put back
    assert moptimizer.clip_grad_by_total_norm_fp32 is cpu_compat._clip_grad_by_total_norm_fp32_cpu
    cpu_compat.revert()
    assert moptimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    assert not cpu_compat.active()
    assert (torch.zeros, torch.cuda.current_device, torch.Tensor.cuda) == originals


@cpu_only
def test_cpu_rng_tracker_forks_like_megatrons():
    from megatron.core.tensor_parallel import random as mrandom

    cpu_compat.apply()
    tracker = mrandom.get_cuda_rng_tracker()
    assert isinstance(tracker, cpu_compat.CpuRNGStatesTracker)
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advances
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork():
        assert torch.equal(torch.rand(3), a)  # same seed, same stream
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 1234)
    assert mrandom._get_cuda_rng_state().numel() == 0  # recompute's CUDA-state save: nothing to save
    # megatron's own seeding entry point works on top of it
    from megatron.core import parallel_state

    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1)
    assert parallel_state.model_parallel_is_initialized()
    mrandom.model_parallel_cuda_manual_seed(7)
    with mrandom.get_cuda_rng_tracker().fork():
        torch.rand(1)
    # the tracker and its seeded streams survive a revert + apply (tests that share a model)
    states = mrandom.get_cuda_rng_tracker().get_states()
    cpu_compat.revert()
    cpu_compat.apply()
    assert mrandom.get_cuda_rng_tracker().get_states().keys() == states.keys()


@cpu_only
def test_meta_device_context_still_sees_wrapped_factories():
    """transformers builds models under `with torch.device("meta")`; wrapping torch.tensor must not
    hide it from torch's factory set (else buffers come out uninitialised after from_pretrained)."""
    cpu_compat.apply()
    with torch.device("meta"):
        assert torch.tensor([1.0]).device.type == "meta"
        assert torch.zeros(2).device.type == "meta"


def test_run_settings_on_cpu_and_noop_with_cuda(monkeypatch):
    """What remains substituted: precision and the distributed optimizer. megatron's DDP settings
    and optimizer are its own on CPU (no DDP adaptation, no optimizer stand-in exists)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert cpu_compat.run_precision("bf16", cpu) == "fp32"
    assert cpu_compat.distributed_optimizer(True, cpu) is False
    assert not hasattr(cpu_compat, "adapt_ddp_config") and not hasattr(cpu_compat, "MainGradAdamW")
    n = len(cpu_compat.SUBSTITUTIONS)
    assert cpu_compat.run_precision("bf16", cuda) == "bf16"
    assert cpu_compat.distributed_optimizer(True, cuda) is True
    assert len(cpu_compat.SUBSTITUTIONS) == n  # nothing substituted (or logged) with CUDA
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    assert cpu_compat.apply() is False and not cpu_compat.active()


@cpu_only
def test_grad_clipping_patch_is_megatrons_arithmetic_and_version_gated(monkeypatch):
    """The CPU clipping scales like megatron's (max_norm / (norm + 1e-6), only when < 1), and a
    megatron-core outside the checked versions is refused loudly instead of patched blind."""
    from megatron.core import package_info

    grads = [torch.full((3,), 2.0), torch.full((2,), -1.0)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    cpu_compat._clip_grad_by_total_norm_fp32_cpu(params, max_norm=1.0, total_norm=4.0)
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g * (1.0 / (4.0 + 1.0e-6)))
    cpu_compat._clip_grad_by_total_norm_fp32_cpu(params, max_norm=100.0, total_norm=4.0)  # no-op
    assert torch.equal(params[0].grad, grads[0] * (1.0 / (4.0 + 1.0e-6)))
    cpu_compat.revert()
    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match="re-check clip_grads.py"):
        cpu_compat.apply()
    cpu_compat.revert()
