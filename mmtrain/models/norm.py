"""LayerNorm / RMSNorm from torch for the local layer specs.

megatron's `WrappedTorchNorm` refuses sequence parallelism. The math of a norm does not care,
megatron only needs the weights marked `sequence_parallel` so their gradients are all-reduced
across the TP group (`finalize_model_grads`). This class does exactly that and nothing else.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class TorchNorm:
    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm
