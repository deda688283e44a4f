"""What every loader of a family hands the trainer: its batches with their counters summed
(`LoaderStats`), and energon's save/restore (`SavableLoader`; the global order's loader keeps the
API with its own state: global_order.py)."""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

from mmdata.energon_loaders.batch import PackedBatch
from mmdata.energon_loaders.state_codec import state_from_json, state_to_json
from mmdata.private_api import stop_loader_workers


@dataclass
class LoaderStats:
    """Counters seen by this rank's main process (summed over its workers)."""

    batches: int = 0
    samples: int = 0
    real_tokens: int = 0
    slots: int = 0
    loss_tokens: int = 0
    counters: Counter = field(default_factory=Counter)  # "skipped/<reason>", "truncated"

    @property
    def packing_efficiency(self) -> float:
        return self.real_tokens / self.slots if self.slots else 0.0

    @property
    def skipped(self) -> dict[str, int]:
        return {k.split("/", 1)[1]: v for k, v in sorted(self.counters.items()) if k.startswith("skipped/")}

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "samples": self.samples,
            "real_tokens": self.real_tokens,
            "slots": self.slots,
            "loss_tokens": self.loss_tokens,
            "packing_efficiency": round(self.packing_efficiency, 6),
            "skipped": self.skipped,
            "truncated": int(self.counters.get("truncated", 0)),
        }


class SavableLoader:
    """Iterable over a family's batches with energon's save/restore and our stats."""

    def __init__(self, loader: Any, task_encoder: Any):
        self.loader = loader
        self.task_encoder = task_encoder
        self.stats = LoaderStats()

    def __iter__(self) -> Iterator[PackedBatch]:
        # Workers are forked at the first batch, and a forked worker inherits this process's
        # garbage: a reference cycle that still holds a torch.distributed process group (a run
        # that ended in this process, a notebook's or a test's) would be freed by the worker's own
        # collector, where ~ProcessGroupGloo joins threads the fork did not copy (SIGSEGV; energon's
        # gc_init_worker keeps Work and CUDA tensors alive in workers, not process groups).
        gc.collect()
        for batch in self.loader:
            s = self.stats
            s.batches += 1
            s.samples += sum(len(r) for r in batch.sample_ids)
            s.real_tokens += batch.num_real_tokens
            s.slots += int(batch.input_ids.numel())
            s.loss_tokens += batch.num_loss_tokens
            s.counters.update(batch.stats)
            yield batch

    def save_state_rank(self) -> Any:
        """This DP rank's loader state (all its workers); store it with the model checkpoint."""
        return self.loader.save_state_rank()

    def restore_state_rank(self, state: Any) -> None:
        """Restore before iterating, on a loader built with the same arguments."""
        self.loader.restore_state_rank(state)

    def save_state_json(self) -> str:
        """`save_state_rank()` as JSON text (no pickle), for checkpoint files."""
        return state_to_json(self.save_state_rank())

    def restore_state_json(self, text: str) -> None:
        self.restore_state_rank(state_from_json(text))

    def close(self) -> None:
        """Stop the worker processes now (idempotent; the loader is not iterated again): a dropped
        loader otherwise waits out torch's 5 s status interval per worker (mmdata/private_api.py)."""
        loader = getattr(self, "loader", None)
        if loader is not None:
            stop_loader_workers(loader)

    def __del__(self) -> None:
        self.close()
