"""Choosing the next token: classifier-free guidance on log-probs, then greedy or seeded sampling
(temperature, top-k, top-p), in the order transformers' `generate` applies them.

Scores are log-probabilities throughout (every row is log-softmaxed first): a constant shift
per row changes neither the argmax nor the sampling distribution, and it is the space guidance
mixes in, so plain and guided rows go through the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """`temperature` 0 = greedy (argmax); `top_k` 0 and `top_p` 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def guided_logprobs(cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Classifier-free guidance on log-probs: `uncond + scale * (cond - uncond)` (transformers'
    and the reference implementations' formula). cond/uncond [n, V] log-probs; scale [n] or a float.
    Scale 1 gives `cond`, scale 0 gives `uncond`."""
    if isinstance(scale, torch.Tensor):
        scale = scale.to(cond.dtype).reshape(-1, 1)
    return uncond + scale * (cond - uncond)


def filter_top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Scores [n, V] with everything outside the top-k and outside the smallest set of tokens
    whose probability reaches top_p set to -inf (transformers' TopK / TopP warpers: the most
    likely token always survives)."""
    if top_k > 0 and top_k < scores.size(-1):
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_next(scores: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Next token of every row [n]; row i samples with `generators[i]` only, so a request's
    tokens do not depend on which other requests share its batch."""
    if params.greedy:
        return scores.argmax(dim=-1)
    scores = filter_top_k_top_p(scores.float() / params.temperature, params.top_k, params.top_p)
    probs = scores.softmax(dim=-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])
