"""Loss reduction shared by the model families' forward steps.

megatron-core 0.16's schedules accept a loss function returning `(loss_sum, num_tokens, report)`;
with `config.calculate_per_token_loss` they sum `num_tokens` over micro-batches, all-reduce it
over DP in `finalize_model_grads` and divide the gradients by it. The loss is therefore averaged
over the real (unmasked) label tokens of the whole global batch, however it is split over
micro-batches and DP ranks - the same number a single process would compute.

`report` carries what the train loop logs: `lm loss` as `[sum, count]` (megatron's convention),
and per-sample `[sum, count]` rows aligned with the batch's flattened `sample_ids`, so a loss
spike can be traced to the samples that caused it.

Context parallelism: every CP rank of a data-parallel rank holds the same batch but computes the
loss of its own share of the positions (the model's per-token loss is zero elsewhere).
`loss_mask` restricts the mask to that share, so every count and sum is this rank's part and
adding them over the CP group (megatron does, for the gradient scale; the train loop does, for
the logs and the per-sample losses) counts each token exactly once.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterator

import torch

from mmdata.energon_loaders.batch import IGNORE_INDEX, host_to_device
from mmtrain.models.context_parallel import current_layout
from mmtrain.runtime import distributed

if TYPE_CHECKING:
    from mmdata.energon_loaders.batch import PackedBatch


def loss_mask(batch: PackedBatch) -> torch.Tensor:
    """[B, S] bool: the positions whose label takes a loss on this rank: label != IGNORE_INDEX
    and, under context parallelism, held by this CP rank. Every family's loss function masks
    with it."""
    mask = batch.labels != IGNORE_INDEX
    layout = current_layout(_host_cu_seqlens(batch))
    if layout.cp > 1:
        mask = mask & host_to_device(layout.held().view(mask.shape), mask.device)
    return mask


def per_sample_loss_sums(token_loss: torch.Tensor, loss_mask: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """[num_samples, 2] (loss sum, label count) per packed sample, in `sample_ids` order.

    Rows hold samples back to back, then padding; `cu_seqlens` segments the flattened stream,
    so the first `len(sample_ids[row])` segments starting in a row are that row's samples."""
    sample_ids = batch.sample_ids
    b, s = token_loss.shape
    flat_loss = (token_loss * loss_mask).reshape(-1).detach().float()
    flat_mask = loss_mask.reshape(-1).float()
    cu = _host_cu_seqlens(batch).to(torch.int64).tolist()  # host copy: no device sync
    starts_by_row: dict[int, list[tuple[int, int]]] = {}
    for start, end in zip(cu[:-1], cu[1:]):
        if end > start:
            starts_by_row.setdefault(start // s, []).append((start, end))
    rows = []
    for r, ids in enumerate(sample_ids):
        segments = starts_by_row.get(r, [])
        for k in range(len(ids)):
            if k < len(segments):
                start, end = segments[k]
                rows.append(torch.stack([flat_loss[start:end].sum(), flat_mask[start:end].sum()]))
            else:  # malformed batch: keep alignment, report nothing for the sample
                rows.append(flat_loss.new_zeros(2))
    if not rows:
        return flat_loss.new_zeros(0, 2)
    return torch.stack(rows)


def masked_loss_sum(
    token_loss: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})` over the positions where
    `loss_mask` is true; the one reduction every family's loss function returns.

    `token_loss` and `loss_mask` only need the same number of elements (a model may return the
    flattened `[B*S]` stream); sums are taken in fp32."""
    losses = token_loss.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def lm_loss_sums(reports: list[dict[str, Any]], device: torch.device | str) -> torch.Tensor:
    """`[sum of token losses, number of label tokens]` (float64) over a schedule's loss reports.

    Training and evaluation reduce the same way, so `train` and `val_loss` are the same kind of
    number: the mean over real tokens, not a mean of per-micro-batch means. A report without a
    count (a plain mean) counts as one token."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for report in reports:
        lm = report["lm loss"].detach().to(device=device, dtype=torch.float64)
        total += lm if lm.numel() == 2 else torch.stack([lm.sum(), lm.new_ones(())])
    return total


def packed_forward_step(data_iterator: Iterator[PackedBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """megatron forward step `(data_iterator, model) -> (output, loss_fn)` for a family whose
    model stage is called on its batch and returns the per-token loss `[B, S]` on the last stage:
    the loss is summed over the real (label != IGNORE_INDEX) tokens this rank holds (`loss_mask`:
    under context parallelism, its share of the positions) with their count (`masked_loss_sum`)."""
    # async from pinned memory; later pipeline stages leave the media inputs on the host
    batch = next(data_iterator).to(distributed.compute_device(), first_stage=_is_first_stage(model))
    output = model(batch)
    return output, functools.partial(masked_loss_sum, loss_mask=loss_mask(batch))


def _is_first_stage(model: torch.nn.Module) -> bool:
    """Whether this model chunk embeds the inputs (its `pre_process`), looking through the
    wrappers megatron puts around it (DDP, Float16Module: each keeps the wrapped one as
    `.module`). Unknown: True, so the batch moves whole, as before."""
    m: Any = model
    for _ in range(8):
        if hasattr(m, "pre_process"):
            return bool(m.pre_process)
        m = getattr(m, "module", None)
        if m is None:
            break
    return True


def _host_cu_seqlens(batch: Any) -> torch.Tensor:
    """`PackedBatch.host_cu_seqlens()` (no device read); any batch-like object with `cu_seqlens` too."""
    host = getattr(batch, "host_cu_seqlens", None)
    return host() if host is not None else batch.cu_seqlens.cpu()
