"""Feeds each training step its micro-batches and owns the loader's resumable state.
Design notes: docs/training.md, "Feeding the steps: train_data"."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from megatron.core import parallel_state

from mmdata.packing.balance import auto_window
from mmdata.energon_loaders.batch import PackedBatch
from mmtrain.models.flops import tile_token_cost
from mmtrain.runtime.distributed import ParallelContext
from mmtrain.runtime.row_exchange import RowBalancer

if TYPE_CHECKING:
    from mmtrain.config.schema import Recipe
    from mmtrain.spec import FamilySpec

log = logging.getLogger(__name__)

#: the key of a loader state file written inside a balancing window
WINDOW_STATE_KEY = "mmtrain.balance_window"
#: the one loader state file of `data.sharding: global`: a position in the global order, no layout in it
GLOBAL_STATE_FILE = "loader_global.json"


@dataclass
class StepData:
    """This rank's micro-batches for one optimizer step, plus what the logs need about them."""

    micro_batches: list[PackedBatch]
    sample_ids: list[str] = field(default_factory=list)
    num_samples: int = 0  # original (unpacked) samples in this rank's micro-batches
    num_tokens: int = 0  # real (non-padding) token positions processed
    num_loss_tokens: int = 0
    #: samples the loader skipped making this step's micro-batches, per reason (this rank's share:
    #: with `sharding: replicated` rank 0 counts every rank's, the others none, so DP sums are right)
    skipped: dict[str, int] = field(default_factory=dict)
    #: `data.sharding: global`: bytes of the samples this rank read for the step (its tar members)
    bytes_read: int = 0
    #: `data.sharding: global`: the step's units (samples or tokens, the blend's) per source, the
    #: same on every rank
    source_units: dict[str, float] = field(default_factory=dict)


def batch_skips(batch: PackedBatch) -> dict[str, int]:
    """The skips a batch's workers counted since their previous batch, per reason."""
    return {k.split("/", 1)[1]: int(v) for k, v in batch.stats.items() if k.startswith("skipped/") and v}


def batch_sample_ids(batch: PackedBatch) -> list[str]:
    """The batch's samples as metrics name them: by sample key (`DATASET#SHARD_KEY`, unique across
    shards and blended datasets; `task_encoding.sample_key`), not by record id, which repeats
    across sources; in `sample_ids` order (the per-sample losses follow it)."""
    rows = batch.sample_keys or batch.sample_ids
    return [str(sid) for row in rows for sid in row]


def global_order_figures(micro_batches: list[PackedBatch]) -> tuple[int, dict[str, float]]:
    """(bytes this rank read, the step's units per source) of a step's micro-batches from the
    global-order loader (`PackedBatch.global_order`: mmdata/energon_loaders/global_order.py)."""
    where = [b.global_order for b in micro_batches if b.global_order is not None]
    units = {name: float(u) for name, u in where[0]["units"].items()} if where else {}
    return sum(int(w["bytes_read"]) for w in where), units


def check_one_step(micro_batches: list[PackedBatch]) -> None:
    """The micro-batches taken for a step (by count) are one step's 0..M-1 of the global order:
    a rank whose boundaries shifted would save another step than the others, so stop loudly."""
    at = [(b.global_order or {}).get("step") for b in micro_batches]
    micro = [(b.global_order or {}).get("micro_batch") for b in micro_batches]
    if len(set(at)) != 1 or micro != list(range(len(micro_batches))):
        raise RuntimeError(
            f"the global order's loader gave one step the micro-batches (step, micro-batch) {list(zip(at, micro))}, "
            "not one step's in order: the loader must yield every micro-batch of every step"
        )


class TrainData:
    def __init__(self, spec: FamilySpec, recipe: Recipe, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.family = spec.name
        self.batch_type: type = spec.batch_type.resolve()
        self.sharding = recipe.data.sharding
        self.micro_per_rank = recipe.train.global_batch_size // (recipe.train.micro_batch_size * ctx.dp)
        if self.sharding == "replicated":
            self.loader_dp_rank, self.loader_dp_size = 0, 1
        else:
            self.loader_dp_rank, self.loader_dp_size = ctx.dp_rank, ctx.dp
        self.loader = spec.build_loader(recipe, dp_rank=self.loader_dp_rank, dp_size=self.loader_dp_size)
        self._iter: Iterator[PackedBatch] | None = None
        self._spec, self._recipe = spec, recipe
        self.balancer: RowBalancer | None = None
        self.window = 1  # steps drawn and placed together
        # the global order places each step's rows on the ranks itself (balanced by cost when
        # data.balance): nothing moves between ranks here
        if recipe.data.balance and recipe.data.packing != "plan" and self.sharding != "global":
            self.balancer = self._make_balancer()
            w = recipe.data.balance_window
            self.window = auto_window(recipe.train.global_batch_size // ctx.dp) if w == "auto" else int(w)
        self._placed: list[list[PackedBatch]] = []  # this rank's steps of the window not handed out yet
        self._window_steps = 0  # steps of the window being handed out
        self._window_start: str | None = None  # the loader's state before it (None: a fresh loader)
        self._restored: str | None = None  # the loader state restored into the fresh loader
        self._resume: tuple[int, int] | None = None  # (steps, trained) of a restored window
        self._skipped: Counter = Counter()  # skips of the batches drawn since the previous step
        self._counts_skips = self.sharding != "replicated" or ctx.dp_rank == 0

    def _make_balancer(self) -> RowBalancer:
        return RowBalancer(tile_token_cost(self._spec.model_shapes(self._recipe.model)), self._spec.encoder_inputs)

    # -- state -----------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        """File name of this rank's loader state inside a checkpoint."""
        if self.sharding == "replicated":
            return "loader_replicated.json"
        if self.sharding == "global":
            return GLOBAL_STATE_FILE
        return f"loader_dp{self.loader_dp_rank:05d}_of{self.loader_dp_size:05d}.json"

    def layout_figures(self) -> dict[str, int]:
        """What a global-order resume may change: DP size, micro-batch size and loader workers."""
        r = self._recipe
        return {"dp": self.ctx.dp, "micro_batch_size": r.train.micro_batch_size, "num_workers": r.data.num_workers}

    def save_state(self) -> str:
        """The loader's `save_state_rank()` as JSON text (no pickles in checkpoints); inside a
        balancing window, the state from before the window and how many of its steps trained."""
        if self._placed:
            trained = self._window_steps - len(self._placed)
            return json.dumps(
                {WINDOW_STATE_KEY: {"steps": self._window_steps, "trained": trained}, "loader": self._window_start}
            )
        return self.loader.save_state_json()

    def restore_state(self, text: str) -> None:
        """Restore `save_state`'s text. A window cut by the checkpoint is finished as it was begun:
        the same steps drawn and placed again (by balancing, even if the recipe turned it off since),
        those already trained skipped."""
        if self._iter is not None:
            raise RuntimeError("loader state must be restored before the first batch is drawn")
        doc = json.loads(text)
        if isinstance(doc, dict) and WINDOW_STATE_KEY in doc:
            window = doc[WINDOW_STATE_KEY]
            self._resume = (int(window["steps"]), int(window["trained"]))
            text = doc["loader"]
        if text is not None:
            self.loader.restore_state_json(text)
        self._restored = text

    # -- batches ---------------------------------------------------------------------------
    def _next_micro_batch(self) -> PackedBatch:
        if self._iter is None:
            self._iter = iter(self.loader)
        batch = next(self._iter)
        if not isinstance(batch, self.batch_type):
            raise TypeError(
                f"the {self.family} loader yielded {type(batch).__name__}, "
                f"not the family's batch type {self.batch_type.__name__}"
            )
        # (type checker: isinstance against the family's batch type just above)
        packed: PackedBatch = batch  # type: ignore[assignment]
        if self._counts_skips:
            self._skipped.update(batch_skips(packed))
        return packed

    def close(self) -> None:
        """Stop the loader's worker processes now (`SavableLoader.close`: dropping the loader
        alone leaves them to the cyclic garbage collector, about 5 s a worker)."""
        self._iter = None
        if self.loader is not None:
            self.loader.close()
        self.loader = None

    def next_step(self) -> StepData:
        if not self._placed:
            self._draw_window()
        mine = self._placed.pop(0)
        data = StepData(micro_batches=mine, skipped=dict(sorted(self._skipped.items())))
        self._skipped.clear()
        if self.sharding == "global":
            check_one_step(mine)
            data.bytes_read, data.source_units = global_order_figures(mine)
        for batch in mine:
            ids = batch_sample_ids(batch)
            data.sample_ids.extend(ids)
            data.num_samples += len(ids)
            data.num_tokens += batch.num_real_tokens
            data.num_loss_tokens += batch.num_loss_tokens
        return data

    def _draw_window(self) -> None:
        """Draw the next window's steps (one without balancing) and place their rows."""
        steps, skip, balancer = self.window, 0, self.balancer
        if self._resume is not None:
            (steps, skip), self._resume = self._resume, None
            balancer = balancer or self._make_balancer()
        if steps > 1:
            self._window_start = self._restored if self._iter is None else self.loader.save_state_json()
        m, dp = self.micro_per_rank, self.ctx.dp
        if self.sharding == "replicated":
            drawn = [[self._next_micro_batch() for _ in range(m * dp)] for _ in range(steps)]
            ranks = [[step[r * m : (r + 1) * m] for step in drawn] for r in range(dp)]
            placed = (
                ranks[self.ctx.dp_rank] if balancer is None else balancer.balance_window_local(ranks, self.ctx.dp_rank)
            )
        else:
            placed = [[self._next_micro_batch() for _ in range(m)] for _ in range(steps)]
            if balancer is not None and dp == 1:
                placed = balancer.balance_window_local([placed], 0)
            elif balancer is not None:
                placed = balancer.balance_window_exchange(
                    placed, parallel_state.get_data_parallel_group(), self.ctx.device
                )
        if balancer is not None and self.ctx.device.type == "cuda":  # joined rows: pinned again for `to()`
            placed = [[b.pin_memory() for b in step] for step in placed]
        self._window_steps, self._placed = steps, placed[skip:]
