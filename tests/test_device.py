"""The CPU adaptation layer: idempotent, inert-by-design where CUDA exists, and it makes the
megatron calls our model path relies on work on a CPU-only torch."""

from __future__ import annotations

import pytest
import torch

from mmtrain import device


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_enable_cpu_compat_is_idempotent_and_redirects():
    assert device.enable_cpu_compat() is True
    n = len(device.SUBSTITUTIONS)
    assert device.enable_cpu_compat() is True
    assert len(device.SUBSTITUTIONS) == n  # second call substitutes nothing more
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.arange(3, device=torch.device("cuda")).device.type == "cpu"
    assert torch.empty(1, device=0).device.type == "cpu"
    t = torch.ones(2)
    assert t.cuda() is t
    torch.cuda.synchronize()
    assert device.default_device() == torch.device("cpu")
    assert not getattr(torch.zeros.__wrapped__, "__mmtrain_cpu_compat__", False)  # wrapped once


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_rng_tracker_forks_like_megatrons():
    from megatron.core.tensor_parallel import random as mrandom

    device.enable_cpu_compat()
    tracker = mrandom.get_cuda_rng_tracker()
    assert isinstance(tracker, device.CpuRNGStatesTracker)
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
    # megatron's own seeding entry point works on top of it
    from megatron.core import parallel_state

    from mmtrain.llava_ov.parallel_init import ensure_model_parallel

    ensure_model_parallel(1, 1)
    assert parallel_state.model_parallel_is_initialized()
    mrandom.model_parallel_cuda_manual_seed(7)
    with mrandom.get_cuda_rng_tracker().fork():
        torch.rand(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_meta_device_context_still_sees_wrapped_factories():
    """transformers builds models under `with torch.device("meta")`; wrapping torch.tensor must not
    hide it from torch's factory set (else buffers come out uninitialised after from_pretrained)."""
    device.enable_cpu_compat()
    with torch.device("meta"):
        assert torch.tensor([1.0]).device.type == "meta"
        assert torch.zeros(2).device.type == "meta"


def test_noop_when_cuda_present(monkeypatch):
    monkeypatch.setattr(device, "cuda_available", lambda: True)
    assert device.enable_cpu_compat() is False
