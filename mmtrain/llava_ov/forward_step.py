"""megatron-style forward step for LLaVA-OV: `(data_iterator, model) -> (output, loss_fn)`.

The loss is summed over real (label != -100) tokens and returned with their count, so
megatron's schedules (with `config.calculate_per_token_loss=True`) average over all real tokens
of all micro-batches and DP ranks rather than averaging per-micro-batch means.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch

from mmdata.energon_loaders.batch import IGNORE_INDEX, LlavaOVBatch
from mmtrain.device import default_device


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """-> (loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]}) as megatron expects."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().view(1), num_tokens.detach().float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[LlavaOVBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    if not isinstance(batch, LlavaOVBatch):
        raise TypeError(f"forward_step expects LlavaOVBatch items, got {type(batch).__name__}")
    batch = batch.to(default_device())
    output = model(batch)
    return output, functools.partial(loss_func, batch.labels != IGNORE_INDEX)
