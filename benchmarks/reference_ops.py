"""Plain reference computations that the GPU checks and the tests compare our fast paths with."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Causal attention of packed THD `q, k, v` (tokens x heads x dim; GQA allowed), one SDPA call
    per sample of `lens` tokens: the (tokens x heads*dim) output varlen attention must match."""
    outs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(
                *(x[sl].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
            )[0]
            .transpose(0, 1)
            .reshape(n, -1)
        )
        start += n
    return torch.cat(outs)
