"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to `min_lr`.

A pure function of the step, so resuming needs no schedule state beyond the step counter
(the checkpoint still records the schedule's parameters, and resume checks them). Each
optimizer param group carries its own peak (`max_lr`), which is how the vision tower gets its
separate learning rate in LLaVA-OV's later stages.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


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
    def from_recipe(cls, optimizer_cfg: Any, total_steps: int) -> "LRSchedule":
        warmup = int(round(float(optimizer_cfg.warmup_fraction) * total_steps))
        return cls(
            max_lr=float(optimizer_cfg.lr),
            min_lr=float(optimizer_cfg.min_lr),
            warmup_steps=min(warmup, max(total_steps - 1, 0)),
            total_steps=max(total_steps, 1),
            decay=str(optimizer_cfg.decay),
        )

    def factor(self, step: int) -> float:
        """Multiplier in [min_lr/max_lr, 1] for training step `step` (1-based: the first
        optimizer update is step 1, so warmup never spends a step at lr=0)."""
        return self.lr_at(step, self.max_lr, self.min_lr) / self.max_lr if self.max_lr else 0.0

    def lr_at(self, step: int, peak: float, floor: float) -> float:
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

    def apply(
        self, param_groups: list[dict[str, Any]], step: int, weight_decay: float = 0.0
    ) -> float:
        """Set every group's lr (from its own `max_lr`/`min_lr`) and weight decay (x `wd_mult`)
        for `step`; returns the main (non-vision-tower) group's lr for logging."""
        main_lr = None
        for group in param_groups:
            peak = float(group.get("max_lr", self.max_lr))
            floor = float(group.get("min_lr", self.min_lr))
            group["lr"] = self.lr_at(step, peak, floor)
            group["weight_decay"] = weight_decay * float(group.get("wd_mult", 1.0))
            if main_lr is None and not group.get("is_vision_tower", False):
                main_lr = group["lr"]
        return float(main_lr if main_lr is not None else self.lr_at(step, self.max_lr, self.min_lr))

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)
