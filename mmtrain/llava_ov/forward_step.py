"""megatron-style forward step for LLaVA-OV: `(data_iterator, model) -> (output, loss_fn)`, the
shared `packed_forward_step`: the loss is summed over real (label != IGNORE_INDEX) tokens and
returned with their count, so megatron's schedules (with `config.calculate_per_token_loss=True`)
average over all real tokens of all micro-batches and DP (x CP) ranks rather than averaging
per-micro-batch means.
"""

from __future__ import annotations

from mmtrain.runtime.loss import packed_forward_step as forward_step

__all__ = ["forward_step"]
