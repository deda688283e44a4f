"""The LM loss's guards: the fused-kernel self-check (review B3), the chunked loss's fixed
shapes (no host sync, review C3) and the device decisions around them, all on CPU.

The sync probe uses `torch.utils._python_dispatch.TorchDispatchMode` (torch's documented way to
see every aten op, though its module is underscored; an import failure fails this file loudly)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmtrain.models.lm_loss import (
    check_fused_kernel,
    fused_kernel,
    linear_cross_entropy,
    plain_loss_fusion,
    resolve_loss_impl,
    select_fused_kernel,
)
from mmtrain.models.encoder_parallel import scale_gradient as _wrong_grad  # a kernel approximating one gradient

BF16 = torch.bfloat16


# ----------------------------------------------------------------------------- B3: the self-check


class _ScalarGradOutput(torch.autograd.Function):
    """A kernel that computes its gradients in forward for `loss.sum()` and, in backward, scales
    them by one number (Liger's `reduction="none"` behaviour): exact only for a uniform upstream."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            loss = linear_cross_entropy(hh, ww, labels)
            gh, gw = torch.autograd.grad(loss.sum(), (hh, ww))
        ctx.save_for_backward(gh, gw)
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gh, gw = ctx.saved_tensors
        s = g.mean()
        return gh * s, gw * s, None


def _good(h, w, y):
    return linear_cross_entropy(h, w, y)


def _wgrad_scaled(h, w, y):
    return linear_cross_entropy(h, _wrong_grad(w, 0.9), y)


def _wgrad_zero(h, w, y):
    return linear_cross_entropy(h, _wrong_grad(w, 0.0), y)


def _wgrad_dropped(h, w, y):
    return linear_cross_entropy(h, w.detach(), y)


def _scalar_grad_output(h, w, y):
    return _ScalarGradOutput.apply(h, w, y)


@pytest.mark.unit
def test_self_check_accepts_the_chunked_loss_as_a_kernel():
    assert check_fused_kernel(_good, BF16, "cpu") is None


@pytest.mark.unit
@pytest.mark.parametrize(
    "bad,why",
    [
        (_wgrad_scaled, "grad of weight"),
        (_wgrad_zero, "grad of weight"),
        (_wgrad_dropped, "no grad of weight"),
        (_scalar_grad_output, "grad of"),
    ],
)
def test_self_check_refuses_a_wrong_weight_gradient_or_a_scalar_grad_output(bad, why):
    """B3: each of these passes a loss + h.grad check under `out.sum().backward()` (the check
    before the fix); the weight-gradient comparison and the per-token upstream refuse them."""
    assert why in (check_fused_kernel(bad, BF16, "cpu") or "")
    # the old check's view: a uniform upstream gradient, only loss and h.grad, would accept the scalar one
    if bad is _scalar_grad_output:
        g = torch.Generator().manual_seed(3)
        h = torch.randn(64, 32, generator=g).requires_grad_()
        w = (torch.randn(100, 32, generator=g) * 0.05).requires_grad_()
        y = torch.randint(0, 100, (64,), generator=g)
        h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        bad(h, w, y).sum().backward()
        _good(h2, w2, y).sum().backward()
        torch.testing.assert_close(h.grad, h2.grad)


@pytest.mark.unit
def test_self_check_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    check_fused_kernel(_good, BF16, "cpu")
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.unit
def test_select_fused_kernel_takes_the_first_that_passes():
    def missing(h, w, y):
        raise ImportError("not installed")

    def broken(h, w, y):
        raise TypeError("unexpected keyword argument")

    picked = select_fused_kernel(
        {"missing": missing, "broken": broken, "approx": _wgrad_scaled, "scalar": _scalar_grad_output, "good": _good},
        BF16,
        "cpu",
    )
    assert picked is not None and picked[0] == "good"
    assert select_fused_kernel({"approx": _wgrad_scaled}, BF16, "cpu") is None


@pytest.mark.unit
def test_fused_kernel_keys_on_the_runs_device_not_cuda_is_available(monkeypatch):
    """A CPU run never tries a fused kernel, even where CUDA exists (was: torch.cuda.is_available())."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fused_kernel(BF16, torch.device("cpu")) is None
    assert fused_kernel(BF16, "cpu") is None
    assert resolve_loss_impl("auto", tp=1, dtype=BF16, on_cuda=False) == "chunked"


# ----------------------------------------------------------------------------- C3: plain path fusion


@pytest.mark.unit
def test_plain_loss_uses_te_cross_entropy_fusion_only_on_cuda_with_te():
    from megatron.core.model_parallel_config import ModelParallelConfig

    on = plain_loss_fusion(on_cuda=True, te_available=True)
    assert on == {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}
    for on_cuda, te in ((True, False), (False, True), (False, False)):
        assert plain_loss_fusion(on_cuda=on_cuda, te_available=te)["cross_entropy_loss_fusion"] is False
    fields = ModelParallelConfig.__dataclass_fields__  # megatron-core 0.16 spells them so
    assert set(on) <= set(fields)


# ----------------------------------------------------------------------------- C3: no host sync


_SYNCING = {
    "nonzero",
    "_local_scalar_dense",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
    "bincount",
    "masked_scatter",
}


class _NoSync(TorchDispatchMode):
    """Records aten ops whose output shape depends on data, or that read a value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] or []) if t is not None
        )
        if name in _SYNCING or bool_index:
            self.bad.append(str(func))
        return func(*args, **(kwargs or {}))


class _NoToList(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "__bool__", "__int__", "__float__"):
            self.bad.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.unit
def test_probe_sees_the_syncs_it_looks_for():
    x = torch.tensor([1.0, -1.0, 2.0])
    with _NoSync() as probe, _NoToList() as lists:
        x.nonzero(), x[x > 0], x.sum().item(), x.tolist()
    assert any("nonzero" in b for b in probe.bad) and any("index" in b for b in probe.bad)
    assert any("_local_scalar_dense" in b for b in probe.bad) and "tolist" in lists.bad


@pytest.mark.unit
@pytest.mark.parametrize("true_vocab", [1000, 977])
def test_chunked_loss_forward_backward_never_syncs(true_vocab):
    """C3: forward + backward of the blocked loss (several vocab blocks, ignored labels) run no
    data-dependent-shape op and read nothing on the host; the result still equals full logits."""
    g = torch.Generator().manual_seed(0)
    n, h, vocab = 300, 16, 1000
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(vocab, h, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, true_vocab, (n,), generator=g)
    labels[::3] = -100
    scale = torch.rand(n, generator=g)
    with _NoSync() as probe, _NoToList() as lists:
        out = linear_cross_entropy(hidden, weight, labels, true_vocab=true_vocab, block_mb=1)
        out.backward(scale)
    assert probe.bad == [] and lists.bad == []
    ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = (ref_h @ ref_w.t()).masked_fill(torch.arange(vocab) >= true_vocab, float("-inf"))
    ref = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    ref.backward(scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_w.grad, rtol=1e-5, atol=1e-6)
    assert (out[::3] == 0).all() and (hidden.grad[::3] == 0).all()


@pytest.mark.unit
def test_chunked_loss_ignores_a_nan_upstream_gradient_at_ignored_tokens():
    """Masked (not gathered-away) rows must still give exactly zero gradient."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 8, generator=g).requires_grad_()
    weight = torch.randn(300, 8, generator=g).requires_grad_()
    labels = torch.randint(0, 300, (20,), generator=g)
    labels[:5] = -100
    up = torch.ones(20)
    up[:5] = float("nan")
    linear_cross_entropy(hidden, weight, labels, block_mb=1).backward(up)
    assert torch.isfinite(weight.grad).all() and (hidden.grad[:5] == 0).all()
