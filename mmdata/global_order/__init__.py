"""One global data order (issue 46): every training step's samples fixed by the sources' length
indexes, the blend and the seed, whatever the DP size, micro-batch or worker count; only the
placement of a step's rows on ranks depends on the layout.

  sources.py  `OrderSource` / `load_source`: a shard folder's lengths, tiles, indices, keys, bytes
  blend.py    `Blend`: shares per source over steps (stepwise or linear, samples or tokens) and the draw
  planner.py  `StepPlanner`: windows of steps packed from the pool, `OrderState`, `placement`, checkpoints

Pure numpy: below the loaders (energon_loaders/global_order.py reads the rows it plans).
"""

from mmdata.global_order.blend import Blend, BlendError, BlendPoint
from mmdata.global_order.planner import (
    OrderState,
    PlannedRow,
    PlannedStep,
    StepPlanner,
    checkpoint_doc,
    initial_state,
    placed_balance,
    placement,
    read_checkpoint_doc,
)
from mmdata.global_order.sources import OrderSource, check_names, load_source

__all__ = [
    "Blend",
    "BlendError",
    "BlendPoint",
    "OrderSource",
    "OrderState",
    "PlannedRow",
    "PlannedStep",
    "StepPlanner",
    "check_names",
    "checkpoint_doc",
    "initial_state",
    "load_source",
    "placed_balance",
    "placement",
    "read_checkpoint_doc",
]
