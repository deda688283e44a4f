"""The loader of the global order (`data.sharding: global`, mmdata/global_order/): this DP rank's
micro-batches of the steps the planner fixes from the sources' length indexes, reading only the
samples of its own rows.

The rows come from one of two sources (`RowSource`): planned online from the length indexes
(`global_order.StepPlanner`, `packing` true or false), or an offline packing plan's sequences
(`plan_steps.PlanSteps`, `packing` "plan": step t is the plan's G sequences at stream positions
[tG, (t+1)G)). Everything below is the same for both.

Every worker (and the main process) plans the same steps from lengths alone. Step `t`'s `G` rows
are placed on ranks and micro-batches by `global_order.placement` (vision-aware balance), the only
part that depends on the layout. This rank's micro-batch `j` (counted from the step it started
at, `t0`) is step `t0 + j // M`, micro-batch `j % M` (`M = G / (dp * micro_batch_size)`), made by
worker `j mod W`: energon's savable loader takes one batch from each worker in turn, so they come
out in order. A row's samples are read by global index through energon's random access (one
reader per source), their keys checked, Emu3's planned variant handed over, encoded and packed
(random_access.py, as the offline plan's loader does); a sample whose encoded length does not fit
its planned row (estimated lengths) is carried into this worker's next row, never dropped
(counted as `plan_carried`): the carry holds its member (source, position), and the next row
reads and encodes it again (its bytes counted once, where it was first read). A row whose samples
were all skipped is a row of padding (no sample, no loss token), so every rank yields each step's
micro-batches, whatever it skipped.

Each batch says where it is in the order (`PackedBatch.global_order`, `GLOBAL_ORDER_FIELDS`): the
step, the micro-batch of this rank, the bytes this rank read for it (also summed in
`stats["global/bytes_read"]`) and the units each source gives the step (the same on every rank).

Resume does not use energon's per-worker state (tied to the worker count): the dataset saves
nothing, and `GlobalOrderLoader.save_state_json()` is the planner's layout-free document for the
steps the main process has taken whole. `restore_state_json` rebuilds the loader at that step, at
any DP size, micro-batch size and worker count. Samples carried at the moment of a save (only with
estimated lengths) are not in the document: they are read again only in a later epoch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from megatron.energon import SavableDataset, WorkerConfig

from mmdata.energon_loaders.plan_packing import load_plan, plan_for_data
from mmdata.energon_loaders.plan_steps import PlanSteps
from mmdata.energon_loaders.random_access import PLAN_CARRY_LIMIT, ShardReader, fill_row
from mmdata.energon_loaders.savable_loader import SavableLoader
from mmdata.errors import UserError
from mmdata.global_order import Blend, OrderSource, PlannedStep, StepPlanner, load_source, placement
from mmdata.packing.balance import DEFAULT_TILE_TOKENS, StepShape
from mmdata.packing.emu3_geometry import Emu3PlanGeometry
from mmdata.packing.geometry import PlanGeometry
from mmdata.readiness import data_source_samples

#: where a global order's rows come from: planned online from the length indexes, or a packing plan's sequences
RowSource = StepPlanner | PlanSteps

#: the batch counter of the bytes this rank read (LoaderStats sums it over the run)
BYTES_READ = "global/bytes_read"
#: what `PackedBatch.global_order` holds: the step, this rank's micro-batch of it and how many it
#: has, the bytes this rank read for the micro-batch, the units (samples or tokens, as the blend
#: counts) each source gives the whole step
GLOBAL_ORDER_FIELDS = ("step", "micro_batch", "micro_batches", "bytes_read", "units")


def order_sources(
    data: str | Path | Sequence[str | Path],
    geometry: PlanGeometry | Emu3PlanGeometry | None,
    tokenizer: str | Path | None,
    seed: int,
) -> list[OrderSource]:
    """The sources of `data` (one shard folder each, finished ones only); a metadataset YAML is
    refused: its weights are a blend the order cannot follow."""
    paths = [Path(data)] if isinstance(data, (str, Path)) else [Path(p) for p in data]
    if not paths:
        raise UserError("no data paths given: list the shard folders in data.paths")
    for p in paths:
        if p.is_file():
            raise UserError(
                f"{p}: data.sharding global reads shard folders, not a metadataset YAML: list its folders in "
                "data.paths and put their weights in data.blend"
            )
        data_source_samples(p)  # a finished dataset only
    return [load_source(p, geometry=geometry, tokenizer=tokenizer, seed=seed) for p in paths]


class SourceReads:
    """A worker's readers of the sources (one each, opened on first use) and the bytes of the
    samples they read (the sizes in the tars: energon's index). A sample carried into the next row
    is read again there (the carry holds members, not samples) but its bytes count once."""

    def __init__(self, planner: RowSource, worker_config: WorkerConfig, decoder: Any):
        self.planner = planner
        self.readers = [ShardReader(root, worker_config, decoder, "the length index") for root in planner.roots]
        self.bytes_read = 0
        self._counted: set[tuple[int, ...]] = set()  # carried members whose bytes are counted

    def __call__(self, member: Sequence[int]) -> Any:
        """The raw sample of a member of a planned row."""
        s, index, key, variant, size = self.planner.sample_at(member)
        if tuple(member) in self._counted:
            self._counted.discard(tuple(member))
        else:
            self.bytes_read += size
        return self.readers[s].read(index, key, variant)

    def carried(self, members: Sequence[Sequence[int]]) -> None:
        """`members` (read, counted) go into the next row: their next read is not counted again."""
        self._counted.update(tuple(m) for m in members)


class GlobalOrderDataset(SavableDataset):
    """This DP rank's micro-batches of the global order (see the module docstring)."""

    _savable_fields = ()

    def __init__(
        self,
        planner: RowSource,
        task_encoder: Any,
        *,
        start: dict[str, Any],
        micro_batch_size: int,
        balance: bool,
        worker_config: WorkerConfig,
    ):
        super().__init__(worker_config)
        self.planner, self.task_encoder, self.start, self.balance = planner, task_encoder, start, balance
        self.shape = step_shape(worker_config.world_size, micro_batch_size, planner.global_batch_size)

    def reset_state_own(self) -> None:
        pass  # resumed from the planner's document (GlobalOrderLoader), not from energon's state

    def worker_has_samples(self) -> bool:
        return True

    def len_worker(self, worker_idx: int | None = None) -> int:
        """Micro-batches of one epoch of every source per worker (approximate: epochs run on)."""
        per_rank = -(-self.planner.rows_per_epoch() // (self.shape.dp * self.shape.micro_batch_size))
        return -(-per_rank // max(1, self.worker_config.num_workers))

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "sources": [str(root) for root in self.planner.roots],
            "start": self.start,
            "shape": self.shape.as_dict(),
            "balance": self.balance,
            "worker_config": self.worker_config.config(),
        }

    def micro_batches(self, worker: int | None = None) -> Iterator[tuple[PlannedStep, int, list[int]]]:
        """This worker's micro-batches in order: (the step, this rank's micro-batch number in it,
        the step's row numbers it holds). `worker`: the one iterating when None."""
        workers = max(1, self.worker_config.num_workers)
        j = (self.worker_config.rank_worker_id() if worker is None else worker) % workers
        per_rank, t0 = self.shape.micro_batches, int(self.start["step"])
        for planned, _ in self.planner.resume(self.start):
            base = (planned.step - t0) * per_rank
            if j >= base + per_rank:
                continue
            mine = placement(planned, self.shape, self.balance)[self.worker_config.rank]
            while j < base + per_rank:
                yield planned, j - base, mine[j - base]
                j += workers

    def __iter__(self) -> Iterator[Any]:
        te, names = self.task_encoder, self.planner.names
        read = SourceReads(self.planner, self.worker_config, te.decoder)
        carry: list[list[Any]] = []
        for planned, micro, rows in self.micro_batches():
            before = read.bytes_read
            packed = []
            for r in rows:  # a row whose samples were all skipped (counted) stays, as padding
                members = [*carry, *(list(m) for m in planned.rows[r].members)]
                where = f"row {r} of step {planned.step}"
                row, carry = fill_row(te, members, read, where=where, carry_limit=PLAN_CARRY_LIMIT)
                read.carried(carry)
                packed.append(row)
            batch = te.batch_rows(packed)  # every micro-batch, so the trainer's steps keep their boundaries
            got = read.bytes_read - before
            batch.stats[BYTES_READ] = batch.stats.get(BYTES_READ, 0) + got
            batch.global_order = {
                "step": planned.step,
                "micro_batch": micro,
                "micro_batches": self.shape.micro_batches,
                "bytes_read": got,
                "units": dict(zip(names, planned.units)),
            }
            yield batch


def step_shape(dp: int, micro_batch_size: int, global_batch_size: int) -> StepShape:
    """The step shape, refused in one line where the global batch does not divide."""
    try:
        return StepShape(dp, micro_batch_size, global_batch_size)
    except ValueError as e:
        raise UserError(f"data.sharding global: {e}: change train.global_batch_size or the layout") from None


class GlobalOrderLoader(SavableLoader):
    """`SavableLoader`'s API over the global order: its state is the planner's layout-free
    document (`save_state_json` / `restore_state_json`, or as a dict `save_state_rank` /
    `restore_state_rank`), restored at any DP size, micro-batch size and worker count."""

    def __init__(self, build: Callable[[dict[str, Any]], Any], task_encoder: Any, planner: RowSource):
        self._build, self.planner = build, planner
        self.start = planner.document(planner.initial_state(), 0)
        super().__init__(build(self.start), task_encoder)
        self._next_step = 0  # the first step not taken whole by the main process
        self._walk: Iterator | None = None
        self._walked: tuple[int, Any] = (-1, None)
        self._iterated = False

    def __iter__(self) -> Iterator[Any]:
        self._iterated = True
        for batch in super().__iter__():
            at = batch.global_order
            self._next_step = at["step"] + (1 if at["micro_batch"] == at["micro_batches"] - 1 else 0)
            yield batch

    @property
    def next_step(self) -> int:
        """The step a loader restored from `save_state_rank()` starts at."""
        return self._next_step

    def save_state_rank(self) -> dict[str, Any]:
        """The layout-free document of the steps taken whole so far (a step taken in part is
        trained again from its start)."""
        step = self._next_step
        if self._walk is None or self._walked[0] > step:
            self._walk, self._walked = self.planner.resume(self.start), (-1, None)
        while self._walked[0] < step:
            planned, window_start = next(self._walk)
            self._walked = (planned.step, window_start)
        return self.planner.document(self._walked[1], step)

    def restore_state_rank(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s step; before the first iteration only."""
        if self._iterated:
            raise RuntimeError("restore the global order's loader state before iterating it")
        next(self.planner.resume(state))  # checks the document (and that it fits this planner)
        self.start, self._next_step, self._walk = state, int(state["step"]), None
        self.loader = self._build(state)

    def save_state_json(self) -> str:
        return json.dumps(self.save_state_rank(), sort_keys=True)

    def restore_state_json(self, text: str) -> None:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(
                f"the global order's loader state is not JSON ({e}): resume from another checkpoint"
            ) from None
        self.restore_state_rank(doc)


def build_global_loader(
    data: str | Path | Sequence[str | Path],
    task_encoder: Any,
    make_loader: Callable[[SavableDataset], Any],
    *,
    micro_batch_size: int,
    worker_config: WorkerConfig,
    seed: int,
    packing: bool | str,
    global_batch_size: int | None,
    blend: dict | None,
    window_steps: int | Literal["auto"],
    balance: bool,
    tile_tokens: float | None,
    geometry: PlanGeometry | Emu3PlanGeometry | None,
    packing_plan: str | Path | None = None,
) -> GlobalOrderLoader:
    """`build_loader(..., sharding="global")`: the planner over `data`'s sources (or, `packing`
    "plan", the steps of `packing_plan`'s sequences: plan_steps.py) and a loader of this rank's
    micro-batches (`make_loader` wraps a dataset in energon's savable loader)."""
    if packing not in (True, False, "plan"):
        raise UserError(f"data.sharding global takes packing true, false or plan, got {packing!r}")
    if global_batch_size is None:
        raise UserError("data.sharding global needs the global batch size (train.global_batch_size)")
    step_shape(worker_config.world_size, micro_batch_size, global_batch_size)
    tile_tokens = DEFAULT_TILE_TOKENS if tile_tokens is None else tile_tokens
    planner: RowSource
    if packing == "plan":
        if blend is not None:
            raise UserError(
                "data.blend mixes sources the global order plans online; a packing plan's sequences are fixed: "
                "drop data.blend, or pack online (data.packing: true)"
            )
        shards, path, info = plan_for_data(data, packing_plan, task_encoder.seq_length, geometry=geometry)
        plan = load_plan(path, info, tile_tokens=tile_tokens)
        planner = PlanSteps(shards, path, plan, global_batch_size, seed)
    else:
        sources = order_sources(data, geometry, getattr(task_encoder, "tokenizer_path", None), seed)
        planner = StepPlanner(
            sources,
            Blend.parse(blend, [s.name for s in sources]),
            task_encoder.seq_length,
            global_batch_size,
            seed=seed,
            tile_tokens=tile_tokens,
            window_steps=window_steps,
            packing=bool(packing),
        )

    def build(start: dict[str, Any]) -> Any:
        return make_loader(
            GlobalOrderDataset(
                planner,
                task_encoder,
                start=start,
                micro_batch_size=micro_batch_size,
                balance=balance,
                worker_config=worker_config,
            )
        )

    return GlobalOrderLoader(build, task_encoder, planner)
