"""Periodic evaluation on held-out data: `train.eval_interval`, `train.eval_iters`, `data.val_paths`.

Every `eval_interval` steps (never at step 0) the trainer runs `eval_iters` global batches of
`data.val_paths` forward-only through megatron's schedule, with the training forward step and
per-token loss convention (mean over the real label tokens of all micro-batches and DP ranks; on
the last pipeline stage), and logs `val_loss` / `val_tokens` with that step.

An evaluation must not change training, and every evaluation must read the same batches:
- the validation loader is its own energon loader, rebuilt for each evaluation with the
  recipe's loader settings and seed (energon restores a loader state only before the first
  batch, and the `val` part our shards' `split.yaml` lists is empty), so the
  batches repeat exactly and the training loader never moves;
- the model runs in eval mode under `torch.no_grad()` and gets its previous mode back;
- every RNG stream a training step reads (python, numpy, torch, CUDA, megatron's tracker) is
  saved before and restored after: creating a DataLoader iterator alone draws from torch's RNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from mmtrain.runtime import rng
from mmtrain.runtime.distributed import ParallelContext
from mmtrain.runtime.train_data import TrainData

if TYPE_CHECKING:
    from mmtrain.config.schema import Recipe
    from mmtrain.spec import FamilySpec


@dataclass
class EvalResult:
    loss: Optional[float]  # None on ranks without the loss (not the last PP stage)
    tokens: Optional[int]  # label tokens the loss averages over, whole job; None as for `loss`
    time_s: float


def eval_due(step: int, interval: int) -> bool:
    """Whether step `step` (1-based, just finished) is followed by an evaluation."""
    return interval > 0 and step > 0 and step % interval == 0


def val_recipe(recipe: Recipe) -> Recipe:
    """The recipe with `data.paths` = `data.val_paths`: the family's loader factory reads
    `data.paths`, and every other loader setting (packing, tiles, seed) stays the training's,
    except that a packing plan, made for the training shards, gives way to online packing, and
    balancing takes one step at a time (evaluation's steps are summed: no window to wait for), and
    a global order's blend, which names the training sources, gives way to equal weights."""
    data = dataclasses.replace(recipe.data, paths=list(recipe.data.val_paths), balance_window=1, blend=None)
    if data.packing == "plan":
        data = dataclasses.replace(data, packing=True, packing_plan=None)
    return dataclasses.replace(recipe, data=data)


@contextlib.contextmanager
def val_data(spec: FamilySpec, recipe: Recipe, ctx: ParallelContext) -> Iterator[TrainData]:
    """A fresh validation stream, split over DP ranks like the training data, closed on exit
    (so each evaluation starts from the same first batch and leaves no loader workers behind)."""
    data = TrainData(spec, val_recipe(recipe), ctx)
    try:
        yield data
    finally:
        data.close()


@contextlib.contextmanager
def isolated_from_training(model_chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Eval mode, no autograd, and every RNG stream restored on exit."""
    state = rng.get_rng_state()
    modes = [chunk.training for chunk in model_chunks]
    try:
        for chunk in model_chunks:
            chunk.eval()
        with torch.no_grad():
            yield
    finally:
        for chunk, mode in zip(model_chunks, modes):
            chunk.train(mode)
        rng.set_rng_state(state)
