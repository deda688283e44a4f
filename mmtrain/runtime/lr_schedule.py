"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to `min_lr`.

A pure function of the step, so resuming needs no schedule state beyond the step counter
(the checkpoint still records the schedule's parameters). Each optimizer param group carries
its own peak and floor (`max_lr`, `min_lr`), which is how a family's part trains at its own
rate (`optimizer.lr_mult`, e.g. LLaVA-OV's vision tower in its later stages).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmtrain.config.schema import OptimizerConfig


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    decay: str = "cosine"  # cosine | linear | constant

    def __post_init__(self) -> None:
        if self.decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"optimizer.decay must be cosine|linear|constant, got {self.decay!r}")
        if self.min_lr > self.max_lr:
            raise ValueError(f"optimizer.min_lr ({self.min_lr}) > optimizer.lr ({self.max_lr})")

    @classmethod
    def from_recipe(cls, optimizer_cfg: OptimizerConfig, total_steps: int) -> "LRSchedule":
        warmup = int(round(optimizer_cfg.warmup_fraction * total_steps))
        return cls(
            max_lr=optimizer_cfg.lr,
            min_lr=optimizer_cfg.min_lr,
            warmup_steps=min(warmup, max(total_steps - 1, 0)),
            total_steps=max(total_steps, 1),
            decay=optimizer_cfg.decay,
        )

    def lr_at(self, step: int, peak: float, floor: float) -> float:
        """The lr of training step `step` for a group with this peak and floor (1-based: the
        first optimizer update is step 1, so warmup never spends a step at lr=0)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return peak * step / self.warmup_steps
        if self.decay == "constant":
            return peak
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
        if self.decay == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + coeff * (peak - floor)

    def apply(self, param_groups: list[dict[str, Any]], step: int, weight_decay: float = 0.0) -> float:
        """Set every group's lr (from its own `max_lr`/`min_lr`) and weight decay (x `wd_mult`)
        for `step`; returns the base lr (`optimizer.lr`'s schedule) for logging."""
        for group in param_groups:
            group["lr"] = self.lr_at(step, float(group["max_lr"]), float(group["min_lr"]))
            group["weight_decay"] = weight_decay * float(group["wd_mult"])
        return self.lr_at(step, self.max_lr, self.min_lr)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)
