"""The LM loss without the full-vocabulary logits: output projection + cross-entropy in blocks.

A plain LM head materialises `[tokens, vocab]` logits and, in backward, their gradient; at
12,288 tokens x 2 x 151,936 that is ~20 GB in fp32. `linear_cross_entropy` computes the same
per-token losses and gradients block by block over the vocabulary:

- forward: for each vocabulary block, `hidden @ W_block^T`, folded into a running max and sum of
  exponentials per token (online log-sum-exp) and the target logit; only `[tokens]` numbers
  survive the block;
- backward (a custom autograd Function): the block's logits are recomputed, turned into
  `softmax - onehot`, and multiplied straight into `grad_hidden` (fp32 accumulator, [tokens,
  hidden]) and the block's rows of `grad_weight` (one GEMM over all tokens per row block, so the
  weight gradient is rounded once, as a plain linear layer's is).

Peak extra memory: one `[tokens, block]` logit block (sized by `block_mb`) plus `[tokens,
hidden]` in fp32, instead of `[tokens, vocab]` twice.

Tensor parallelism: the output weight is vocab-parallel (megatron `ColumnParallelLinear`); each
TP rank reduces its slice, and three all-reduces over the TP group (max, sum of exponentials,
target logit) complete the softmax, as `vocab_parallel_cross_entropy` does. The caller feeds
`hidden` through megatron's TP mapping (copy / sequence-parallel gather), whose backward sums
the partial `grad_hidden` over TP.

Padded vocabulary rows (megatron pads the table to a multiple of 64 x tp) are excluded from the
softmax; labels < 0 (IGNORE_INDEX) get loss 0 and no gradient, and their rows are skipped.

On GPU, a fused kernel is used when one is installed and TP = 1 (`fused_kernel`):
cut-cross-entropy (Apple, `cut_cross_entropy.linear_cross_entropy`) or Liger-Kernel's fused
linear cross-entropy; each is checked once per process against this implementation on a small
problem before it is trusted.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

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
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                true_vocab: int, block_mb: int, group: Any) -> torch.Tensor:
        n, local_vocab = hidden.size(0), weight.size(0)
        valid = (labels >= 0).nonzero(as_tuple=True)[0]
        h = hidden.index_select(0, valid)
        local_labels = labels.index_select(0, valid) - vocab_start
        own = (local_labels >= 0) & (local_labels < local_vocab)
        usable = max(0, min(local_vocab, true_vocab - vocab_start))  # rows that are not padding
        block = vocab_block_size(h.size(0), max(usable, 1), block_mb)
        run_max = torch.full((h.size(0),), float("-inf"), device=h.device)
        run_sum = torch.zeros(h.size(0), device=h.device)
        target = torch.zeros(h.size(0), device=h.device)
        for start in range(0, usable, block):
            end = min(start + block, usable)
            logits = (h @ weight[start:end].t()).float()
            hit = own & (local_labels >= start) & (local_labels < end)
            rows = hit.nonzero(as_tuple=True)[0]
            target[rows] = logits[rows, local_labels[rows] - start]
            new_max = torch.maximum(run_max, logits.max(dim=1).values)
            run_sum = run_sum * torch.exp(run_max - new_max) + logits.sub_(new_max[:, None]).exp_().sum(dim=1)
            run_max = new_max
        # complete the softmax over the TP group (ranks whose slice is all padding hold -inf / 0)
        global_max = _tp_all_reduce(run_max.clone(), dist.ReduceOp.MAX, group)
        run_sum = torch.where(run_max > float("-inf"), run_sum * torch.exp(run_max - global_max),
                              torch.zeros_like(run_sum))
        run_sum = _tp_all_reduce(run_sum, dist.ReduceOp.SUM, group)
        target = _tp_all_reduce(target, dist.ReduceOp.SUM, group)
        lse = global_max + torch.log(run_sum)
        loss = torch.zeros(n, device=hidden.device, dtype=torch.float32)
        loss[valid] = lse - target
        ctx.save_for_backward(h, weight, valid, local_labels, own, lse)
        ctx.meta = (n, usable, block)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        h, weight, valid, local_labels, own, lse = ctx.saved_tensors
        n, usable, block = ctx.meta
        scale = grad_loss.index_select(0, valid).float()
        grad_h = torch.zeros(h.shape, device=h.device, dtype=torch.float32)
        grad_w = torch.zeros_like(weight)
        for start in range(0, usable, block):
            end = min(start + block, usable)
            w = weight[start:end]
            probs = (h @ w.t()).float().sub_(lse[:, None]).exp_()  # softmax of the block
            hit = own & (local_labels >= start) & (local_labels < end)
            rows = hit.nonzero(as_tuple=True)[0]
            probs[rows, local_labels[rows] - start] -= 1.0
            g = probs.mul_(scale[:, None]).to(h.dtype)
            grad_h += (g @ w).float()
            grad_w[start:end] = g.t() @ h
        grad_hidden = torch.zeros((n, h.size(1)), device=h.device, dtype=h.dtype)
        grad_hidden[valid] = grad_h.to(h.dtype)
        return grad_hidden, grad_w, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         vocab_start: int = 0, true_vocab: Optional[int] = None, block_mb: int = DEFAULT_BLOCK_MB,
                         group: Any = None) -> torch.Tensor:
    """Per-token cross entropy of `hidden [N, h] @ weight[V_local, h]^T` against `labels [N]`
    (global vocabulary ids; < 0: no loss): `[N]` fp32. `weight` is this TP rank's slice
    starting at `vocab_start`; `true_vocab` excludes the padding rows; `group` is the TP group
    (None: no TP)."""
    vocab = true_vocab if true_vocab is not None else vocab_start + weight.size(0)
    return _LinearCrossEntropy.apply(hidden, weight, labels, vocab_start, vocab, block_mb, group)


# ----------------------------------------------------------------------------- fused GPU kernels


def _cce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from cut_cross_entropy import linear_cross_entropy as cce

    return cce(hidden, weight, labels, ignore_index=-100, reduction="none")


def _liger(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=-100, reduction="none")
    return out[0] if isinstance(out, tuple) else out


_FUSED: dict[str, Callable[..., torch.Tensor]] = {"cut_cross_entropy": _cce, "liger_kernel": _liger}


@functools.lru_cache(maxsize=None)
def fused_kernel(dtype: torch.dtype) -> Optional[tuple[str, Callable[..., torch.Tensor]]]:
    """(name, fn) of the first installed fused linear-cross-entropy kernel that reproduces
    `linear_cross_entropy` on a small CUDA problem in `dtype` (values and input gradients), or
    None. `fn(hidden [N, h], weight [V, h], labels [N]) -> [N]` losses, labels -100 = none."""
    if not torch.cuda.is_available() or dtype not in (torch.float16, torch.bfloat16):
        return None
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(256, 128, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(1000, 128, device="cuda", generator=gen) * 0.05).to(dtype)
    labels = torch.randint(0, 1000, (256,), device="cuda", generator=gen)
    labels[::7] = -100
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = linear_cross_entropy(ref_h, ref_w, labels)
    ref.sum().backward()
    for name, fn in _FUSED.items():
        try:
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            out = fn(h, w, labels).float()
            out.sum().backward()
            ok = (out.shape == ref.shape and torch.allclose(out, ref, rtol=2e-2, atol=2e-2)
                  and torch.allclose(h.grad.float(), ref_h.grad.float(), rtol=5e-2, atol=5e-3))
        except ImportError:
            continue
        except Exception as err:  # an API this adapter does not know
            log.warning("fused loss kernel %s failed its self-check (%s); not used", name, err)
            continue
        if ok:
            log.info("LM loss: fused kernel %s (checked against the chunked loss)", name)
            return name, fn
        log.warning("fused loss kernel %s disagrees with the chunked loss on a test problem; not used", name)
    return None


def resolve_loss_impl(requested: str, *, tp: int, dtype: torch.dtype, on_cuda: bool) -> str:
    """The implementation a run uses: `auto` -> a fused kernel on GPU with TP = 1 when one is
    installed and passes its check, else `chunked`. `fused` refuses when none is usable."""
    if requested not in LOSS_IMPLS:
        raise ValueError(f"parallel.lm_loss must be one of {', '.join(LOSS_IMPLS)}, got {requested!r}")
    if requested in ("chunked", "plain"):
        return requested
    usable = on_cuda and tp == 1 and fused_kernel(dtype) is not None
    if requested == "fused" and not usable:
        why = ("not on GPU" if not on_cuda else "tensor parallelism (fused kernels are not vocab-parallel)"
               if tp > 1 else f"no fused kernel (cut-cross-entropy or liger-kernel) works here in {dtype}")
        raise ValueError(f"parallel.lm_loss=fused: {why}; use parallel.lm_loss=chunked")
    return "fused" if usable else "chunked"
