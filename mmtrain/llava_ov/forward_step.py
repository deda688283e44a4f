"""megatron-style forward step for LLaVA-OV: `(data_iterator, model) -> (output, loss_fn)`.

The loss is summed over real (label != IGNORE_INDEX) tokens and returned with their count, so
megatron's schedules (with `config.calculate_per_token_loss=True`) average over all real tokens
of all micro-batches and DP (x CP) ranks rather than averaging per-micro-batch means.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch

from mmdata.energon_loaders.llava_ov.batch import LlavaOVBatch
from mmtrain.runtime.distributed import compute_device
from mmtrain.runtime.loss import loss_mask, masked_loss_sum


def loss_func(mask: torch.Tensor, output_tensor: torch.Tensor):
    """-> (loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]}) as megatron expects."""
    return masked_loss_sum(output_tensor, mask)


def forward_step(data_iterator: Iterator[LlavaOVBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator).to(compute_device())
    output = model(batch)
    return output, functools.partial(loss_func, loss_mask(batch))
