"""Feeds each training step its micro-batches and owns the loader's resumable state.

Every rank of a TP/PP group builds the loader with the same DP rank, so all stages of one
model replica see the same micro-batches (the first stage needs the pixels and token ids, the
last the labels) without broadcasting variable-size media between ranks.

Two ways to split the stream over DP ranks (`data.sharding`):
- "dp": energon's `WorkerConfig(rank=dp_rank, world_size=dp)` sharding - each DP rank decodes
  only its own data. The loader state is per DP rank and energon refuses it at another DP size.
- "replicated": every rank reads the single-process stream (`dp_rank=0, dp_size=1`) and keeps
  micro-batches `[dp_rank*M, (dp_rank+1)*M)` of each step's `dp*M`. Any layout then trains on
  exactly the same global batches, and the (identical) loader state resumes at any DP size.

`data.balance: true` with online packing spreads each step's rows over the DP ranks and each
rank's micro-batches by cost, tokens plus vision tiles (runtime/row_exchange.py; replicated data
needs no exchange). A balanced packing plan is placed by its loader already.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from mmdata.energon_loaders.batch import PackedBatch
from mmtrain.runtime.distributed import ParallelContext

if TYPE_CHECKING:
    from mmtrain.config.schema import Recipe
    from mmtrain.spec import FamilySpec

log = logging.getLogger(__name__)


@dataclass
class StepData:
    """This rank's micro-batches for one optimizer step, plus what the logs need about them."""

    micro_batches: list[PackedBatch]
    sample_ids: list[str] = field(default_factory=list)
    num_samples: int = 0  # original (unpacked) samples in this rank's micro-batches
    num_tokens: int = 0  # real (non-padding) token positions processed
    num_loss_tokens: int = 0


def batch_sample_ids(batch: PackedBatch) -> list[str]:
    """The batch's samples as metrics name them: by sample key (`DATASET#SHARD_KEY`, unique across
    shards and blended datasets; `task_encoding.sample_key`), not by record id, which repeats
    across sources; in `sample_ids` order (the per-sample losses follow it)."""
    rows = batch.sample_keys or batch.sample_ids
    return [str(sid) for row in rows for sid in row]


class TrainData:
    def __init__(self, spec: FamilySpec, recipe: Recipe, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.family = spec.name
        self.batch_type = spec.batch_type
        self.sharding = recipe.data.sharding
        self.micro_per_rank = recipe.train.global_batch_size // (
            recipe.train.micro_batch_size * ctx.dp
        )
        if self.sharding == "replicated":
            self.loader_dp_rank, self.loader_dp_size = 0, 1
        else:
            self.loader_dp_rank, self.loader_dp_size = ctx.dp_rank, ctx.dp
        self.loader = spec.build_loader(
            recipe, dp_rank=self.loader_dp_rank, dp_size=self.loader_dp_size
        )
        self._iter: Iterator[PackedBatch] | None = None
        self.balancer = None
        if recipe.data.balance and recipe.data.packing != "plan":
            from mmtrain.planning.cost_model import tile_token_cost
            from mmtrain.runtime.row_exchange import RowBalancer

            self.balancer = RowBalancer(tile_token_cost(spec.model_shapes(recipe.model)), spec.encoder_inputs)

    # -- state -----------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        """File name of this rank's loader state inside a checkpoint."""
        if self.sharding == "replicated":
            return "loader_replicated.json"
        return f"loader_dp{self.loader_dp_rank:05d}_of{self.loader_dp_size:05d}.json"

    def save_state(self) -> str:
        """The loader's `save_state_rank()` as JSON text (no pickles in checkpoints)."""
        return self.loader.save_state_json()

    def restore_state(self, text: str) -> None:
        if self._iter is not None:
            raise RuntimeError("loader state must be restored before the first batch is drawn")
        self.loader.restore_state_json(text)

    # -- batches ---------------------------------------------------------------------------
    def _next_micro_batch(self) -> PackedBatch:
        if self._iter is None:
            self._iter = iter(self.loader)
        batch = next(self._iter)
        if not isinstance(batch, self.batch_type):
            raise TypeError(f"the {self.family} loader yielded {type(batch).__name__}, "
                            f"not the family's batch type {self.batch_type.__name__}")
        return batch

    def close(self) -> None:
        """Stop the loader's worker processes now. energon keeps persistent workers behind a
        reference cycle (loader <-> its epoch iterator), so dropping the loader alone would
        leave them running until the cyclic garbage collector happens to run."""
        self._iter = None
        self.loader = None
        gc.collect()

    def next_step(self) -> StepData:
        m = self.micro_per_rank
        if self.sharding == "replicated":
            drawn = [self._next_micro_batch() for _ in range(m * self.ctx.dp)]
            if self.balancer is not None:
                mine = self.balancer.balance_local([drawn[r * m:(r + 1) * m] for r in range(self.ctx.dp)],
                                                   self.ctx.dp_rank)
            else:
                mine = drawn[self.ctx.dp_rank * m:(self.ctx.dp_rank + 1) * m]
        else:
            mine = [self._next_micro_batch() for _ in range(m)]
            if self.balancer is not None and self.ctx.dp == 1:
                mine = self.balancer.balance_local([mine], 0)
            elif self.balancer is not None:
                from megatron.core import parallel_state

                mine = self.balancer.balance_exchange(mine, parallel_state.get_data_parallel_group(), self.ctx.device)
        if self.balancer is not None and self.ctx.device.type == "cuda":  # joined rows: pinned again for `to()`
            mine = [b.pin_memory() for b in mine]
        data = StepData(micro_batches=mine)
        for batch in mine:
            ids = batch_sample_ids(batch)
            data.sample_ids.extend(ids)
            data.num_samples += len(ids)
            data.num_tokens += batch.num_real_tokens
            data.num_loss_tokens += batch.num_loss_tokens
        return data
