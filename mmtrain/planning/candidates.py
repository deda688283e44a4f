"""An auto_tune candidate: one layout with the cost model's estimates, and what the search
decided about it (its status, and its trial's measurement)."""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.planning.cost_model import Layout, MemoryEstimate, StepTime
from mmtrain.planning.search_space import layout_key
from mmtrain.planning.trials import TrialResult

PRUNED_MEMORY, PRUNED_HISTORY, RAN, FAILED, NOT_RUN = "pruned_memory", "pruned_history", "ran", "failed", "not_run"


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate  # the analytical model, uncalibrated
    step: StepTime
    est_mem_gib: float  # calibrated: what pruning and ordering use
    est_step_s: float
    status: str = ""
    reason: str = ""
    trial: TrialResult | None = None
    reused: bool = False
    baseline: bool = False  # the recipe's own layout

    @property
    def key(self) -> str:
        return layout_key(self.layout)

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch_size * self.layout.seq_length

    @property
    def est_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.est_step_s

    @property
    def measured(self) -> bool:
        return self.status == RAN and self.trial is not None
