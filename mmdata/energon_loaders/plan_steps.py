"""The global order's second row source (`data.sharding: global` with `data.packing: plan`): the
offline plan's sequences are the rows, so step `t`'s rows are fixed by the plan file alone.

Step `t` is the `G` sequences at stream positions `[p_t, p_t + G)` (`p_t = tG` for a run that
kept its `global_batch_size`), over the stream of all epochs as `plan_packing.PlanStream` orders
it (epoch 0 in plan order, a later epoch a seeded permutation moving a balanced plan's tiers
whole). The loader (`global_order.GlobalOrderDataset`) places them on ranks and micro-batches by
cost (`placement`) for the layout it runs at: a plan balanced for one step shape is followed at
any other, each step rebalanced. The state is layout-free: the next step, its stream position and
the plan's identity, so a resume at any DP size, micro-batch size or worker count continues
exactly, and one after a `global_batch_size` change continues from the same position.

It has what the loader asks of `global_order.StepPlanner` (`resume`, `document`, `sample_at`, ...).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np


from mmdata.energon_loaders.plan_packing import PlanError, PlanSequences, PlanStream
from mmdata.errors import UserError
from mmdata.global_order.planner import PlannedRow, PlannedStep
from mmdata.global_order.sources import sample_bytes, source_name

PLAN_DOC_VERSION = 1


class PlanSteps:
    """The plan's steps for one global batch size (see the module docstring). A row's members are
    (0, position in the plan's sample list): one source, the plan's folder."""

    packing = True

    def __init__(
        self,
        shards: Path,
        path: Path,
        plan: PlanSequences,
        global_batch_size: int,
        seed: int,
        sizes: np.ndarray | None = None,
    ) -> None:
        """`sizes`: each planned sample's bytes in its tar (aligned with `plan.indices`); None reads
        them from the folder's energon index."""
        if plan.num_sequences < global_batch_size:
            raise PlanError(
                f"packing plan {path} has {plan.num_sequences} sequences, fewer than one step's "
                f"{global_batch_size} (train.global_batch_size): pack more data or lower the batch"
            )
        if plan.costs is None:
            raise ValueError("load the plan with its costs (load_plan(..., tile_tokens=...))")
        self.plan, self.global_batch_size, self.seed = plan, global_batch_size, seed
        self.seq_length = int(plan.info["seq_length"])
        self.roots, self.names = [Path(shards)], [source_name(shards)]
        shape = plan.step_shape
        self.stream = PlanStream(plan.num_sequences, shape.dp if shape is not None else 1, seed)
        digest = hashlib.sha256(plan.indices.tobytes() + plan.starts.tobytes()).hexdigest()[:16]
        self.identity = {"file": Path(path).name, "sequences": plan.num_sequences, "sha256": digest}
        if sizes is None:
            sizes = sample_bytes(Path(shards), plan.indices)
        self.sample_bytes = np.asarray(sizes, dtype=np.int64)  # aligned with the plan's sample list

    def _key(self, pos: int) -> str:
        keys = self.plan.keys
        return keys[pos].as_py() if keys is not None else f"{int(self.plan.indices[pos]):010d}"

    def initial_state(self) -> int:
        """The stream position of a fresh run's step 0."""
        return 0

    def document(self, position: int, step: int) -> dict[str, Any]:
        """The layout-free checkpoint: the next step, its stream position, the plan's identity."""
        return {"version": PLAN_DOC_VERSION, "plan": self.identity, "step": int(step), "position": int(position)}

    def read_document(self, doc: dict[str, Any]) -> tuple[int, int]:
        """(stream position, step) of a checkpoint document, checked against this plan."""
        if not isinstance(doc, dict) or "plan" not in doc:
            raise UserError(
                "the loader checkpoint is a global order planned online (data.packing: true or false), this run "
                "follows a packing plan: resume with the same data.packing, or from another checkpoint"
            )
        if doc.get("version") != PLAN_DOC_VERSION or doc["plan"] != self.identity:
            raise UserError(
                f"the loader checkpoint follows another packing plan ({doc.get('plan')}, version "
                f"{doc.get('version')}) than this run's ({self.identity}): resume with the plan it trained, or "
                "from another checkpoint"
            )
        position, step = doc.get("position"), doc.get("step")
        if not all(isinstance(x, int) and x >= 0 for x in (position, step)):
            raise UserError(f"the loader checkpoint's step {step!r} or position {position!r} is damaged")
        return position, step

    def resume(self, doc: dict[str, Any]) -> Iterator[tuple[PlannedStep, int]]:
        """Every step from the document's on, each with its stream position."""
        position, step = self.read_document(doc)
        while True:
            yield self.step_at(step, position), position
            step, position = step + 1, position + self.global_batch_size

    def step_at(self, step: int, position: int) -> PlannedStep:
        """Step `step`: the plan's sequences at stream positions [position, position + G)."""
        p = self.plan
        rows = []
        for at in range(position, position + self.global_batch_size):
            b = self.stream.sequence(at)
            members = tuple((0, pos) for pos in range(int(p.starts[b]), int(p.starts[b + 1])))
            rows.append(
                PlannedRow(members, tuple(m[1] for m in members), int(p.tokens[b]), int(p.tiles[b]), float(p.costs[b]))
            )
        return PlannedStep(step, tuple(rows), (float(sum(len(r.members) for r in rows)),))

    def sample_at(self, member: Sequence[int]) -> tuple[int, int, str, int | None, int]:
        """(source 0, global index, key, planned variant, bytes) of the plan's sample at `member[1]`."""
        pos, variants = int(member[1]), self.plan.variants
        variant = None if variants is None else int(variants[pos])
        return 0, int(self.plan.indices[pos]), self._key(pos), variant, int(self.sample_bytes[pos])

    def rows_per_epoch(self) -> int:
        return self.plan.num_sequences
