"""Packing that follows an offline plan (`mmdata pack-plan` / `mmtrain pack-plan`, `data.packing:
plan`): every row holds exactly one of the plan's sequences, so packing is reproducible and
independent of buffer sizes.

Contract (docs/preprocess.md, "Packing plan"): data-parallel rank `r` of `D` takes the plan's
sequences `r, r + D, r + 2D, ...`; its micro-batch `j` is its sequences `[j*B, (j+1)*B)`, produced
by loader worker `j mod W`, so batches come out of energon's savable loader (which takes one batch
from each worker in turn) in plan order. Epoch 0 follows the plan's order; epoch `e > 0` visits
the same sequences in the order of a permutation seeded with `(seed, e)`: sequences are
reordered, never regrouped. A rank's stream runs on from one epoch into the next.

A plan balanced for a step shape (`mmdata pack-plan --dp D --micro-batch-size B
--global-batch-size G`, its `balance` metadata; docs/loaders.md, "Vision-aware balancing") deals
steps instead: step `t` is the `G` sequences at positions `[t*G, (t+1)*G)` of the stream of all
epochs (epoch 0 in plan order, epoch `e > 0` the plan's tiers of `D` sequences shuffled whole,
seeded with `(seed, e)`), and `balance.assign_block` places them by cost: data-parallel rank `r`'s
micro-batch `m` of the step holds the sequences it assigns to `(r, m)`. Its micro-batches come out
of the loader step by step (micro-batch `j` of a rank is step `j // M`, `M = G / (D*B)`, made by
worker `j mod W`); a loader built without DP sharding (the trainer's `data.sharding: replicated`)
yields every rank's micro-batches of a step, rank after rank. The loader's micro-batch size and DP
size must be the plan's.

Under `data.sharding: global` the same plan is followed by the global order's loader instead
(plan_steps.py: step t the G sequences at positions [tG, (t+1)G) of `PlanStream`, placed by cost
at any layout; a plan balanced for another step shape is fine there).

Samples are read by global index with energon's random access (its tar index), encoded with the
family's task encoder (skips counted as online) and packed with its hooks. A sample whose
encoded length does not fit what its row has left (a plan made from estimated text lengths, or
another tokenizer: training refuses such a plan unless `data.plan_allow_estimated_lengths`) is
carried: it goes first into this worker's next row, in order, and trains there. The carry holds
at most PLAN_CARRY_LIMIT samples; one more is skipped and counted as `plan_overflow` (an
estimated plan, whose rows overflow by far more than a few tokens, reaches it: plan from exact
lengths, `mmdata preprocess --tokenizer`). A sample longer than the sequence on its own (the
encoder truncates text, so only a family that does not) is skipped as `plan_too_long`. A row
whose samples were all skipped is a row of padding (no sample, no loss token), so a rank yields
every micro-batch of its steps. A worker's whole state is the number of batches it has produced
and its carried samples (their global index, key and variant), saved and restored by energon's
savable loader, so a resumed run continues exactly.
A plan whose family drew per-sample choices that change lengths (Emu3's task and caption drop:
its `variant` column) hands each sample its choice as the subflavor PLAN_VARIANT; one whose keys
are not the global indices (token shards, which keep their input's keys) lists them (`key`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq
from megatron.energon import SavableDataset, WorkerConfig

from mmdata.energon_loaders.random_access import PLAN_CARRIED as PLAN_CARRIED  # re-exported (skip counters)
from mmdata.energon_loaders.random_access import PLAN_CARRY_LIMIT as PLAN_CARRY_LIMIT  # read at each row (tests set it)
from mmdata.energon_loaders.random_access import PLAN_OVERFLOW, PLAN_TOO_LONG, ShardReader, fill_row, with_variant
from mmdata.energon_loaders.random_access import PLAN_VARIANT as PLAN_VARIANT  # re-exported (the Emu3 encoder)
from mmdata.energon_loaders.task_encoding import PackingTaskEncoder
from mmdata.packing.balance import StepShape, assign_block, row_costs, shuffle_tiers
from mmdata.packing.emu3_geometry import Emu3PlanGeometry
from mmdata.packing.geometry import PlanGeometry, plan_geometry
from mmdata.packing.plan_file import PlanError, plan_path, read_plan_info
from mmdata.readiness import data_source_samples
from mmdata.shard_format import MANIFEST_NAME

#: what to do about a skip reason of plan packing (the run's closing summary)
PLAN_SKIP_HINTS = {
    PLAN_OVERFLOW: "preprocess with --tokenizer (exact lengths) and rerun pack-plan",
    PLAN_TOO_LONG: "rerun pack-plan at a longer --seq-length",
}


@dataclass(frozen=True)
class PlanSequences:
    """A plan's sequences: sequence `b` is `indices[starts[b]:starts[b + 1]]` (global indices)."""

    indices: np.ndarray  # global sample indices in plan order (int32 while they fit)
    starts: np.ndarray  # int64, len = sequences + 1
    info: dict
    keys: Any = None  # the samples' keys (a pyarrow string array) where they are not f"{index:010d}"
    variants: np.ndarray | None = None  # int8 per sample: the family's planned choice (PLAN_VARIANT)
    costs: np.ndarray | None = None  # a balanced plan's cost per sequence (balance.row_costs)
    tokens: np.ndarray | None = None  # with costs: each sequence's tokens (each sample at most seq_length) ...
    tiles: np.ndarray | None = None  # ... and vision tiles

    @property
    def num_sequences(self) -> int:
        return len(self.starts) - 1

    @property
    def step_shape(self) -> StepShape | None:
        """The step shape a balanced plan was made for; None for a plain plan."""
        return plan_step_shape(self.info)

    def sequence(self, b: int) -> np.ndarray:
        return self.indices[self.starts[b] : self.starts[b + 1]]

    def members(self, b: int) -> Iterator[tuple[int, str, int | None]]:
        """(global index, expected key, planned variant or None) of sequence `b`'s samples."""
        for pos in range(int(self.starts[b]), int(self.starts[b + 1])):
            index = int(self.indices[pos])
            key = self.keys[pos].as_py() if self.keys is not None else f"{index:010d}"
            yield index, key, None if self.variants is None else int(self.variants[pos])


def plan_for_data(
    data: str | Path | Sequence[str | Path],
    plan: str | Path | None,
    seq_length: int,
    geometry: PlanGeometry | Emu3PlanGeometry | None = None,
    step_shape: StepShape | None = None,
) -> tuple[Path, Path, dict]:
    """(shard dir, plan file, plan metadata) for `packing="plan"`, checked: one shard folder
    written by `mmdata preprocess` or `mmdata tokenize-images`, and `plan` (default
    `<dir>/pack-plan-<seq_length>.parquet`)
    made from its length index for `seq_length` tokens per sequence and, when `geometry` is
    given (the recipe's), with that image token geometry: a plan counted with another one fills
    its sequences with the wrong number of image tokens, silently; and, when `step_shape` is given
    (the recipe's), a balanced plan made for that step shape."""
    paths = [data] if isinstance(data, (str, Path)) else list(data)
    if len(paths) != 1 or not Path(paths[0]).is_dir():
        raise PlanError(
            "packing 'plan' follows the plan of one shard folder (`mmdata preprocess` or "
            "`mmdata tokenize-images` output); got "
            f"{', '.join(str(p) for p in paths) or 'none'} (pack blends online: packing true)"
        )
    shards = Path(paths[0])
    data_source_samples(shards)  # a finished dataset only
    path = Path(plan) if plan is not None else plan_path(shards, seq_length)
    remedy = (
        geometry.remedy(shards, seq_length)
        if geometry is not None
        else f"run `mmdata pack-plan {shards} --seq-length {seq_length}` (or `mmtrain pack-plan RECIPE.yaml`)"
    )
    if not path.is_file():
        raise PlanError(f"packing plan {path} not found: {remedy}")
    info = read_plan_info(path)
    if info.get("seq_length") != seq_length:
        raise PlanError(
            f"packing plan {path} packs {info.get('seq_length')} tokens per sequence, the loader {seq_length}: {remedy}"
        )
    manifest = json.loads((shards / MANIFEST_NAME).read_text())
    if info.get("lengths_sha256") != (manifest.get("length_index") or {}).get("sha256"):
        raise PlanError(
            f"packing plan {path} was made from another length index than {shards}'s "
            f"(the shards were rewritten): {remedy}"
        )
    if geometry is not None:
        _check_geometry(path, info, geometry, remedy)
    if step_shape is not None and (problem := step_shape_problem(info, step_shape, path)) is not None:
        raise PlanError(problem)
    return shards, path, info


def lengths_estimated(info: dict) -> bool:
    """Whether a plan was made from estimated text lengths (shards preprocessed without
    --tokenizer): its rows overflow when the samples are encoded."""
    return bool(info.get("lengths_estimated", info.get("text_tokens") == "estimate"))


def estimated_lengths_problem(info: dict, path: Path | str) -> str | None:
    """Why training should not follow a plan of estimated lengths (None for exact ones): its
    samples do not fit the rows they were planned into."""
    if not lengths_estimated(info):
        return None
    return (
        f"packing plan {path} was made from estimated text lengths (shards preprocessed without --tokenizer): "
        "its rows overflow and samples are carried or skipped; preprocess with `--tokenizer DIR` (the training "
        "tokenizer) and rerun pack-plan, or set data.plan_allow_estimated_lengths: true to train with it"
    )


def _check_geometry(path: Path, info: dict, geometry: PlanGeometry | Emu3PlanGeometry, remedy: str) -> None:
    """Refuse a plan counted with another geometry than the recipe's: the image token geometry
    (LLaVA-OV), or what an Emu3 plan's lengths and variants depend on."""
    have = plan_geometry(info)
    if type(have) is not type(geometry):
        raise PlanError(f"packing plan {path} counted {have.counts}, the recipe needs {geometry.counts}: {remedy}")
    if have != geometry:
        raise PlanError(
            f"packing plan {path} counted {have.counts} with other settings than the recipe's: "
            f"{', '.join(have.differences(geometry))}: {remedy}"
        )


def plan_step_shape(info: dict) -> StepShape | None:
    """The step shape a plan was balanced for (its `balance` metadata), None for a plain plan."""
    b = info.get("balance")
    return StepShape(int(b["dp"]), int(b["micro_batch_size"]), int(b["global_batch_size"])) if b else None


def step_shape_problem(info: dict, shape: StepShape, path: Path | str) -> str | None:
    """Why a balanced plan cannot be followed at `shape` (the recipe's DP size, micro-batch and
    global batch), None when it can or the plan is plain."""
    have = plan_step_shape(info)
    if have is None or have == shape:
        return None
    differ = ", ".join(
        f"{k} {v} (recipe: {getattr(shape, k)})" for k, v in have.as_dict().items() if v != getattr(shape, k)
    )
    return (
        f"packing plan {path} is balanced for another step shape: {differ}: run `mmtrain pack-plan "
        f"RECIPE.yaml` (or `mmdata pack-plan` with --dp {shape.dp} --micro-batch-size {shape.micro_batch_size} "
        f"--global-batch-size {shape.global_batch_size})"
    )


def load_plan(path: Path, info: dict, tile_tokens: float | None = None) -> PlanSequences:
    """The sequences of a checked plan file (indices as int32 while they fit: 45M samples take
    180 MB, shared by the loader's forked workers); with their costs (balance.row_costs) for a
    balanced plan (its own `tile_tokens`) or when `tile_tokens` is given (the global order places
    any plan's sequences by cost)."""
    if tile_tokens is None and plan_step_shape(info) is not None:
        tile_tokens = info["balance"]["tile_tokens"]
    names = pq.read_schema(path).names
    costed = ["tokens"] + (["tiles"] if "tiles" in names else []) if tile_tokens is not None else []
    wanted = ["bin", "index", *costed] + [c for c in ("key", "variant") if c in names]
    table = pq.read_table(path, columns=wanted)
    indices = table.column("index").to_numpy()
    indices = indices.astype(np.int32 if len(indices) and indices.max() < 2**31 else np.int64)
    starts = np.searchsorted(table.column("bin").to_numpy(), np.arange(info["bins"] + 1)).astype(np.int64)
    keys = table.column("key").combine_chunks() if "key" in names else None
    variants = table.column("variant").to_numpy().astype(np.int8) if "variant" in names else None
    costs = tokens = tiles = None
    if tile_tokens is not None and info["bins"]:
        per_sample = np.minimum(table.column("tokens").to_numpy().astype(np.int64), info["seq_length"])
        tiles_of = table.column("tiles").to_numpy().astype(np.int64) if "tiles" in names else 0 * per_sample
        tokens, tiles = np.add.reduceat(per_sample, starts[:-1]), np.add.reduceat(tiles_of, starts[:-1])
        costs = row_costs(tokens, tiles, tile_tokens)
    return PlanSequences(indices, starts, info, keys, variants, costs, tokens, tiles)


class PlanStream:
    """A plan's sequences over all epochs, by stream position: epoch 0 in plan order, epoch e > 0
    a permutation seeded with (seed, e) that moves whole tiers of `tier` sequences (a balanced
    plan's DP size; 1: any permutation), so a later epoch of a balanced plan keeps its tiers."""

    def __init__(self, num_sequences: int, tier: int, seed: int) -> None:
        self.num_sequences, self.tier, self.seed = num_sequences, tier, seed
        self._epoch_order: tuple[int, np.ndarray | None] = (0, None)

    def sequence(self, position: int) -> int:
        epoch, k = divmod(position, self.num_sequences)
        if epoch == 0:
            return k
        if self._epoch_order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_order = (epoch, shuffle_tiers(self.num_sequences, self.tier, rng))
        return int(self._epoch_order[1][k])


class PlanPackedDataset(SavableDataset):
    """This worker's micro-batches of plan sequences (see the module docstring)."""

    _savable_fields = ("_batches", "_carry")

    def __init__(
        self,
        shards: Path,
        plan: PlanSequences,
        task_encoder: PackingTaskEncoder,
        *,
        micro_batch_size: int,
        seed: int,
        worker_config: WorkerConfig,
    ):
        super().__init__(worker_config)
        if plan.num_sequences < worker_config.world_size:
            raise PlanError(
                f"the plan has {plan.num_sequences} sequences, fewer than the {worker_config.world_size} "
                "data-parallel ranks"
            )
        self.shards, self.plan, self.task_encoder = shards, plan, task_encoder
        self.micro_batch_size, self.seed = micro_batch_size, seed
        # sequences of this rank per epoch (rank r takes r, r + D, ...)
        self.rank_sequences = len(range(worker_config.rank, plan.num_sequences, worker_config.world_size))
        self.shape = plan.step_shape
        if self.shape is not None and (micro_batch_size, worker_config.world_size) not in (
            (self.shape.micro_batch_size, self.shape.dp),
            (self.shape.micro_batch_size, 1),
        ):
            raise PlanError(
                f"the packing plan is balanced for {self.shape.describe()}; this loader has micro-batch "
                f"{micro_batch_size} and {worker_config.world_size} data-parallel ranks"
            )
        self._reader: Any = None
        self._epoch_order: tuple[int, np.ndarray | None] = (0, None)
        self._stream: PlanStream | None = None
        self._step: tuple[int, Any] = (-1, None)
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self._batches = 0  # micro-batches this worker has produced
        #: samples that did not fit their row, for this worker's next rows: [global index, key, variant]
        self._carry: list[list[Any]] = []

    def restore_state(self, state: Any) -> None:
        if state is not None and "_carry" not in state:  # a loader state saved before carrying
            state["_carry"] = []
        super().restore_state(state)

    def worker_has_samples(self) -> bool:
        return True

    def len_worker(self, worker_idx: int | None = None) -> int:
        """Micro-batches per epoch of a worker (approximate: epochs run into each other)."""
        workers = max(1, self.worker_config.num_workers)
        rows = self.rank_sequences
        if self.shape is not None and self.worker_config.world_size == 1:  # every rank's micro-batches
            rows = self.plan.num_sequences
        return -(-rows // (self.micro_batch_size * workers))

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "plan": self.plan.info,
            "micro_batch_size": self.micro_batch_size,
            "seed": self.seed,
            "worker_config": self.worker_config.config(),
        }

    # -- plan positions --------------------------------------------------------------------------

    def sequence_at(self, position: int) -> int:
        """The plan sequence at `position` of this rank's endless stream."""
        epoch, k = divmod(position, self.rank_sequences)
        slot = self.worker_config.rank + k * self.worker_config.world_size
        if epoch == 0:
            return slot
        if self._epoch_order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_order = (epoch, rng.permutation(self.plan.num_sequences))
        return int(self._epoch_order[1][slot])

    def sequences_of_batch(self, batch: int) -> list[int]:
        """The plan sequences of micro-batch `batch` of this loader's stream."""
        if self.shape is None:
            return [
                self.sequence_at(p) for p in range(batch * self.micro_batch_size, (batch + 1) * self.micro_batch_size)
            ]
        per_rank = self.shape.micro_batches
        if self.worker_config.world_size == 1:  # every rank's micro-batches of a step, rank after rank
            step, rest = divmod(batch, self.shape.dp * per_rank)
            rank, micro = divmod(rest, per_rank)
        else:
            (step, micro), rank = divmod(batch, per_rank), self.worker_config.rank
        if self._step[0] != step:
            g = self.shape.global_batch_size
            sequences = [self.stream_sequence(p) for p in range(step * g, (step + 1) * g)]
            self._step = (step, (sequences, assign_block(self.plan.costs[sequences].tolist(), self.shape)))
        sequences, placed = self._step[1]
        return [sequences[j] for j in placed[rank][micro]]

    def stream_sequence(self, position: int) -> int:
        """A balanced plan's sequence at `position` of the stream of all epochs (`PlanStream`:
        epoch 0 in plan order, epoch e > 0 with the plan's tiers shuffled whole)."""
        if self._stream is None:
            self._stream = PlanStream(self.plan.num_sequences, self.shape.dp, self.seed)
        return self._stream.sequence(position)

    # -- reading ---------------------------------------------------------------------------------

    def _read(self, index: int, key: str) -> Any:
        if self._reader is None:
            self._reader = ShardReader(self.shards, self.worker_config, self.task_encoder.decoder)
        return self._reader.read(index, key)

    def _row(self, sequence: int) -> list[Any]:
        """The encoded samples of one plan row: the carried samples first (those that fit, in
        order), then the plan sequence's; one that does not fit what is left is carried to the
        next row (random_access.fill_row: skips counted, `plan_overflow` when the carry is full)."""
        members = [*self._carry, *(list(m) for m in self.plan.members(sequence))]
        row, self._carry = fill_row(
            self.task_encoder,
            members,
            lambda m: with_variant(self._read(m[0], m[1]), m[2]),
            where=f"plan sequence {sequence}",
            carry_limit=PLAN_CARRY_LIMIT,
        )
        return row

    def __iter__(self) -> Iterator[Any]:
        workers = max(1, self.worker_config.num_workers)
        worker = self.worker_config.rank_worker_id() % workers
        while True:
            batch = self._batches * workers + worker
            rows = [self._row(s) for s in self.sequences_of_batch(batch)]
            self._batches += 1
            # a row whose samples were all skipped (counted) stays, as padding: every micro-batch
            # comes out, so the trainer's steps keep their boundaries (as in the global order)
            yield self.task_encoder.batch_rows(rows)
