"""Device decisions (review A2, A4/A5, A7), tested on CPU by faking CUDA."""

from __future__ import annotations

import pytest
import torch

from mmtrain.runtime import distributed as d


@pytest.mark.unit
def test_device_index_wraps_local_rank_over_visible_devices():  # A5: srun --gpus-per-task=1
    assert d.cuda_device_index(5, 1) == 0
    assert d.cuda_device_index(3, 8, 8) == 3


@pytest.mark.unit
def test_more_local_processes_than_gpus_is_refused():  # A4/A5
    with pytest.raises(d.UnsupportedLayout, match="only 1 CUDA device"):
        d.cuda_device_index(1, 1, 2)


@pytest.mark.unit
def test_gloo_with_cuda_visible_is_refused():  # A7
    with pytest.raises(d.UnsupportedLayout, match="CUDA_VISIBLE_DEVICES"):
        d.resolve_backend("gloo", cuda_visible=True)
    assert d.resolve_backend("auto", cuda_visible=True) == "nccl"


@pytest.mark.unit
def test_without_te_a_cuda_run_falls_back_and_refuses_cp(monkeypatch):  # A2
    from mmtrain.models import layer_specs
    from mmtrain.models.attention import SDPACoreAttention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert layer_specs.core_attention_module(False, on_cuda=True) is SDPACoreAttention
    with pytest.raises(RuntimeError, match="transformer_engine"):
        layer_specs.core_attention_module(True, on_cuda=True)
    with pytest.raises(d.UnsupportedLayout, match="import transformer_engine failed"):
        d.check_context_parallel_backend(2, on_cuda=True)
