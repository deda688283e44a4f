"""The LM loss without the full-vocabulary logits: output projection + cross-entropy in blocks.
Design notes: docs/training.md, "The LM loss in blocks"."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: `parallel.lm_loss` values
LOSS_IMPLS = ("auto", "fused", "chunked", "plain")
DEFAULT_BLOCK_MB = 256


def vocab_block_size(tokens: int, vocab: int, block_mb: int) -> int:
    """Vocabulary rows per block so that one `[tokens, block]` logit block (fp32, plus its
    low-precision twin: ~8 bytes an element) stays near `block_mb` MiB; a multiple of 128, at
    least 128."""
    rows = (block_mb * 2**20) // max(1, tokens * 8)
    return int(min(vocab, max(128, rows // 128 * 128)))


def _tp_all_reduce(x: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _LinearCrossEntropy(torch.autograd.Function):
    """Fixed-shape blocked loss: every row is computed and masked (`torch.where`, `gather`,
    `scatter_add_`) rather than gathered by `nonzero`, so nothing waits on the host: on GPU a
    `nonzero` is a device->host sync per call (~77-360 per micro-batch)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        vocab_start: int,
        true_vocab: int,
        block_mb: int,
        group: Any,
    ) -> torch.Tensor:
        n, local_vocab = hidden.size(0), weight.size(0)
        usable = max(0, min(local_vocab, true_vocab - vocab_start))  # rows that are not padding
        valid = labels >= 0
        local_labels = labels - vocab_start
        own = valid & (local_labels >= 0) & (local_labels < usable)
        block = vocab_block_size(n, max(usable, 1), block_mb)
        run_max = torch.full((n,), float("-inf"), device=hidden.device)
        run_sum = torch.zeros(n, device=hidden.device)
        target = torch.zeros(n, device=hidden.device)
        for start in range(0, usable, block):
            end = min(start + block, usable)
            logits = (hidden @ weight[start:end].t()).float()
            hit, col = _block_target(own, local_labels, start, end)
            target += torch.where(hit, logits.gather(1, col).squeeze(1), 0.0)
            new_max = torch.maximum(run_max, logits.max(dim=1).values)
            run_sum = run_sum * torch.exp(run_max - new_max) + logits.sub_(new_max[:, None]).exp_().sum(dim=1)
            run_max = new_max
            del logits  # before the next block's GEMM allocates: one [tokens, block] block at a time
        # complete the softmax over the TP group (ranks whose slice is all padding hold -inf / 0)
        global_max = _tp_all_reduce(run_max.clone(), dist.ReduceOp.MAX, group)
        run_sum = torch.where(
            run_max > float("-inf"), run_sum * torch.exp(run_max - global_max), torch.zeros_like(run_sum)
        )
        run_sum = _tp_all_reduce(run_sum, dist.ReduceOp.SUM, group)
        target = _tp_all_reduce(target, dist.ReduceOp.SUM, group)
        lse = global_max + torch.log(run_sum)
        loss = torch.where(valid, lse - target, 0.0)
        ctx.save_for_backward(hidden, weight, valid, local_labels, own, lse)
        ctx.meta = (usable, block)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        hidden, weight, valid, local_labels, own, lse = ctx.saved_tensors
        usable, block = ctx.meta
        scale = torch.where(valid, grad_loss.float(), 0.0)  # ignored rows: no gradient (even a NaN upstream)
        grad_h = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32)
        grad_w = torch.zeros_like(weight)
        for start in range(0, usable, block):
            end = min(start + block, usable)
            w = weight[start:end]
            probs = (hidden @ w.t()).float().sub_(lse[:, None]).exp_()  # softmax of the block
            hit, col = _block_target(own, local_labels, start, end)
            probs.scatter_add_(1, col, -hit.float()[:, None])  # softmax - onehot (adds -0.0 off target)
            g = probs.mul_(scale[:, None]).to(hidden.dtype)
            grad_h += (g @ w).float()
            grad_w[start:end] = g.t() @ hidden
            del probs, g  # (as in forward: the next block's GEMM must not find this one still alive)
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None, None


def _block_target(
    own: torch.Tensor, local_labels: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows whose target lies in vocab block [start, end), each row's column in the block
    clamped into range: [N, 1]), fixed shapes for `gather` / `scatter_add_`."""
    hit = own & (local_labels >= start) & (local_labels < end)
    col = (local_labels - start).clamp(0, end - start - 1)[:, None]
    return hit, col


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int = 0,
    true_vocab: Optional[int] = None,
    block_mb: int = DEFAULT_BLOCK_MB,
    group: Any = None,
) -> torch.Tensor:
    """Per-token cross entropy of `hidden [N, h] @ weight[V_local, h]^T` against `labels [N]`
    (global vocabulary ids; < 0: no loss): `[N]` fp32. `weight` is this TP rank's slice
    starting at `vocab_start`; `true_vocab` excludes the padding rows; `group` is the TP group
    (None: no TP)."""
    vocab = true_vocab if true_vocab is not None else vocab_start + weight.size(0)
    return _LinearCrossEntropy.apply(hidden, weight, labels, vocab_start, vocab, block_mb, group)


# ----------------------------------------------------------------------------- fused GPU kernels


#: a fused kernel's signature: fn(hidden [N, h], weight [V, h], labels [N]) -> [N] losses, labels -100 = none
FusedLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _cce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy as cce  # lazy: optional GPU kernel, used only when chosen

    # filter_eps=None: CCE's default ("auto") skips gradient blocks below eps, an approximation
    # of the weight/embedding gradient we do not want
    return cce(hidden, weight, labels, ignore_index=-100, reduction="none", filter_eps=None)


def _liger(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # lazy: optional GPU kernel

    out = liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=-100, reduction="none")
    return out[0] if isinstance(out, tuple) else out


_FUSED: dict[str, FusedLoss] = {"cut_cross_entropy": _cce, "liger_kernel": _liger}


@dataclass(frozen=True)
class KernelTolerance:
    """Self-check tolerances per quantity: (rtol, atol as a fraction of the reference's largest
    magnitude, relative Frobenius error). Scale-free, because the weight gradient (a sum over
    tokens) is ~30x larger than the hidden one; the candidate runs in bf16/fp16, the reference in
    fp32 (our bf16 chunked loss: ~2e-3 relative error)."""

    loss: tuple[float, float, float] = (2e-2, 2e-3, 1e-2)
    grad_hidden: tuple[float, float, float] = (5e-2, 1e-2, 1e-2)
    grad_weight: tuple[float, float, float] = (5e-2, 1e-2, 1e-2)


def _disagreement(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float, float]) -> Optional[str]:
    rtol, atol_frac, norm_tol = tol
    got = got.float()
    atol = atol_frac * float(want.abs().max())
    rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
    if torch.allclose(got, want, rtol=rtol, atol=atol) and rel <= norm_tol:
        return None
    return f"max abs error {float((got - want).abs().max()):.2e} (atol {atol:.1e}), relative norm error {rel:.1e}"


def check_fused_kernel(
    fn: FusedLoss, dtype: torch.dtype, device: torch.device | str, tol: KernelTolerance = KernelTolerance()
) -> Optional[str]:
    """None when `fn` reproduces `linear_cross_entropy` (computed in fp32 on the same rounded
    inputs) on a small problem on `device` in `dtype`, else what disagreed.

    WHY this shape: the losses, the hidden gradient AND the weight gradient are compared (the
    weight is the LM head, or the tied embedding), under a random per-token upstream gradient: a
    kernel that drops or approximates the weight gradient, or treats `grad_output` as a scalar
    (exact only for `loss.sum()`), would pass a loss + `h.grad` check under `out.sum().backward()`.
    The problem is seeded with its own generator: the global RNG is left untouched. Exceptions
    from `fn` propagate (the caller decides what an unknown API means)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(256, 128, device=device, generator=gen).to(dtype)
    weight = (torch.randn(1000, 128, device=device, generator=gen) * 0.05).to(dtype)
    labels = torch.randint(0, 1000, (256,), device=device, generator=gen)
    labels[::7] = -100
    grad_out = torch.rand(256, device=device, generator=gen) * 2  # per token, in [0, 2)
    ref_h, ref_w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    ref = linear_cross_entropy(ref_h, ref_w, labels)
    ref.backward(grad_out)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(h, w, labels)
    if out.shape != ref.shape:
        return f"loss shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out = out.float()
    out.backward(grad_out)
    for what, got, want, t in (
        ("loss", out.detach(), ref.detach(), tol.loss),
        ("grad of hidden", h.grad, ref_h.grad, tol.grad_hidden),
        ("grad of weight", w.grad, ref_w.grad, tol.grad_weight),
    ):
        if got is None:
            return f"no {what}"
        why = _disagreement(got, want, t)
        if why:
            return f"{what} differs: {why}"
    return None


def select_fused_kernel(
    candidates: Mapping[str, FusedLoss], dtype: torch.dtype, device: torch.device | str
) -> Optional[tuple[str, FusedLoss]]:
    """(name, fn) of the first candidate that is installed and passes `check_fused_kernel`, or None."""
    for name, fn in candidates.items():
        try:
            why = check_fused_kernel(fn, dtype, device)
        except ImportError:
            continue
        except Exception as err:  # an API this adapter does not know
            log.warning("fused loss kernel %s failed its self-check (%s); not used", name, err)
            continue
        if why is None:
            log.info("LM loss: fused kernel %s (checked against the chunked loss)", name)
            return name, fn
        log.warning("fused loss kernel %s disagrees with the chunked loss on a test problem (%s); not used", name, why)
    return None


@functools.lru_cache(maxsize=None)
def fused_kernel(dtype: torch.dtype, device: torch.device | str = "cuda") -> Optional[tuple[str, FusedLoss]]:
    """(name, fn) of the first installed fused linear-cross-entropy kernel that passes its
    self-check on the run's `device` in `dtype` (once per process), or None: off CUDA (the
    kernels are Triton/CUDA) and outside fp16/bf16. Keyed on the run's device, not on
    `torch.cuda.is_available()`."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    return select_fused_kernel(_FUSED, dtype, device)


def plain_loss_fusion(on_cuda: bool, te_available: bool) -> dict[str, Any]:
    """megatron TransformerConfig fields for `parallel.lm_loss=plain`: TE's fused vocab-parallel
    cross entropy (`cross_entropy_loss_fusion`, `cross_entropy_fusion_impl='te'`,
    mcore/model_parallel_config.py:241-246) on CUDA with Transformer Engine, else megatron's
    unfused `vocab_parallel_cross_entropy` (the fields' defaults)."""
    if on_cuda and te_available:
        return {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}
    return {"cross_entropy_loss_fusion": False, "cross_entropy_fusion_impl": "native"}


def resolve_loss_impl(requested: str, *, tp: int, dtype: torch.dtype, on_cuda: bool) -> str:
    """The implementation a run uses: `auto` -> a fused kernel on GPU with TP = 1 when one is
    installed and passes its check, else `chunked`. `fused` refuses when none is usable."""
    if requested not in LOSS_IMPLS:
        raise ValueError(f"parallel.lm_loss must be one of {', '.join(LOSS_IMPLS)}, got {requested!r}")
    if requested in ("chunked", "plain"):
        return requested
    usable = on_cuda and tp == 1 and fused_kernel(dtype, "cuda") is not None
    if requested == "fused" and not usable:
        why = (
            "not on GPU"
            if not on_cuda
            else "tensor parallelism (fused kernels are not vocab-parallel)"
            if tp > 1
            else f"no fused kernel (cut-cross-entropy or liger-kernel) works here in {dtype}"
        )
        raise ValueError(f"parallel.lm_loss=fused: {why}; use parallel.lm_loss=chunked")
    return "fused" if usable else "chunked"
