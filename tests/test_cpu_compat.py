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
    from mmtrain.models.device import compute_device

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


def test_apply_does_nothing_with_cuda(monkeypatch):
    """No run setting is changed on CPU any more (bf16 and the distributed optimizer run there as
    on GPU); with CUDA present nothing is patched."""
    assert not hasattr(cpu_compat, "run_precision") and not hasattr(cpu_compat, "distributed_optimizer")
    assert not hasattr(cpu_compat, "adapt_ddp_config") and not hasattr(cpu_compat, "MainGradAdamW")
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    assert cpu_compat.apply() is False and not cpu_compat.active()


def test_optimizer_type_checks_answer_cpu_parameters_only_while_open():
    """megatron's optimizer constructors ask `param.type()`: inside the window a CPU fp32/bf16
    Parameter says its CUDA type string; a plain tensor, another dtype, a conversion
    (`type(dtype)`) and everything after the window keep torch's answer; a CUDA run opens no
    window (nothing is patched, whatever the host has)."""
    fp32, bf16 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    fp16 = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    plain = torch.zeros(2)
    with cpu_compat.optimizer_type_checks(torch.device("cpu")):
        assert fp32.type() == "torch.cuda.FloatTensor" and bf16.type() == "torch.cuda.BFloat16Tensor"
        assert fp16.type() == "torch.HalfTensor" and plain.type() == "torch.FloatTensor"
        assert fp32.type(torch.float64).dtype == torch.float64  # a conversion is still a conversion
        assert fp32.type("torch.DoubleTensor").dtype == torch.float64
        assert any("type() -> its torch.cuda type string" in s for s in cpu_compat.SUBSTITUTIONS)
    assert "type" not in torch.Tensor.__dict__
    assert fp32.type() == "torch.FloatTensor" and bf16.type() == "torch.BFloat16Tensor"
    with cpu_compat.optimizer_type_checks(torch.device("cuda", 0)):
        assert "type" not in torch.Tensor.__dict__ and fp32.type() == "torch.FloatTensor"
    with pytest.raises(RuntimeError, match="boom"), cpu_compat.optimizer_type_checks(torch.device("cpu")):
        raise RuntimeError("boom")
    assert "type" not in torch.Tensor.__dict__  # closed on an error too


def test_optimizer_type_checks_are_version_gated(monkeypatch):
    """Another megatron-core is refused loudly (its constructors must be re-read), not answered blind."""
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match="re-check optimizer.py and distrib_optimizer.py"):
        with cpu_compat.optimizer_type_checks(torch.device("cpu")):
            pass
    assert "type" not in torch.Tensor.__dict__
    with cpu_compat.optimizer_type_checks(torch.device("cuda", 0)):  # CUDA: no gate, nothing to answer
        pass


def test_the_answered_lines_are_megatrons():
    """The lines the window answers are where the docstring says, in the installed megatron-core."""
    import inspect

    from megatron.core.optimizer import distrib_optimizer, optimizer

    def line(module, n: int) -> str:
        return inspect.getsource(module).splitlines()[n - 1]

    assert "param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']" in line(optimizer, 671)
    assert "param.type() == 'torch.cuda.FloatTensor'" in line(optimizer, 690)
    assert "param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']" in line(distrib_optimizer, 582)
    assert "model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']" in line(
        distrib_optimizer, 361
    )
    assert "model_param.type() == 'torch.cuda.FloatTensor'" in line(distrib_optimizer, 420)


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
