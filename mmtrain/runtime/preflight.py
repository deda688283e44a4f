"""Checks of what a training run will touch, before anything heavy: run by `mmtrain FAMILY
RECIPE` (action: run) after the recipe validated and before the model is built, workers are
spawned or anything is written into `run_dir`. A bad data path, tokenizer or run_dir costs one
message listing every problem (exit 2) instead of a `[rank0]` traceback minutes later, and the
run dir's `config.yaml` keeps describing its checkpoints.

- `data.paths` / `data.val_paths`: each a finished energon shard folder with samples, or a
  metadataset YAML whose datasets all are (mmdata/readiness.py: an unfinished preprocess job's
  folder is refused);
- `tokenizer.path`: a local HF tokenizer folder (never sent to the hub) whose ids fit the
  recipe (the family's `check_tokenizer`, e.g. llava-ov's media token ids);
- the starting checkpoint (the run dir's own latest, else `checkpoint.load`): it exists and was
  made for the recipe's architecture (the family's `architecture_keys`);
- `logging.tensorboard: true` needs the `tensorboard` package.

It also warns when `data.shuffle_buffer_size` exceeds what one loader worker reads per pass.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from mmdata.errors import UserError

if TYPE_CHECKING:
    from mmtrain.config.schema import Recipe
    from mmtrain.spec import FamilySpec

log = logging.getLogger(__name__)


class PreflightError(UserError):
    """Every problem found, one per line, each naming its recipe key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"the run cannot start ({len(problems)} problem{'s' if len(problems) > 1 else ''}); "
                         f"nothing was built or written:\n{lines}")


def preflight(recipe: "Recipe", spec: "FamilySpec") -> None:
    """Raise PreflightError listing every problem; log warnings. For `action: run`."""
    problems: list[str] = []
    samples = _check_data(recipe, problems)
    _check_tokenizer(recipe, spec, problems)
    _check_starting_point(recipe, spec, problems)
    if recipe.logging.tensorboard:
        from mmtrain.runtime.metrics import tensorboard_available

        if not tensorboard_available():
            problems.append("logging.tensorboard: true, but the `tensorboard` package is not installed "
                            "(pip install tensorboard, or set logging.tensorboard=false)")
    if problems:
        raise PreflightError(problems)
    _warn_shuffle_buffer(recipe, samples)


def _check_data(recipe: "Recipe", problems: list[str]) -> list[int]:
    """Samples of every training dataset (for the warnings); problems appended."""
    from mmdata.readiness import DatasetNotReady, data_source_samples

    train_samples: list[int] = []
    for key, paths in (("data.paths", recipe.data.paths), ("data.val_paths", recipe.data.val_paths)):
        for i, path in enumerate(paths):
            try:
                found = data_source_samples(path)
            except DatasetNotReady as err:
                problems.append(f"{key}[{i}]: {err}")
                continue
            if key == "data.paths":
                train_samples += found
    if recipe.data.packing == "plan" and train_samples:
        from mmdata.energon_loaders.plan_packing import PlanError, plan_for_data

        try:
            plan_for_data(recipe.data.paths, recipe.data.packing_plan, recipe.train.seq_length)
        except PlanError as err:
            problems.append(f"data.packing: plan: {err}")
    return train_samples


def _check_tokenizer(recipe: "Recipe", spec: "FamilySpec", problems: list[str]) -> None:
    from mmdata.local_tokenizer import load_local_tokenizer

    if not recipe.tokenizer.path:
        return  # the recipe validation requires it for action: run
    try:
        tokenizer = load_local_tokenizer(recipe.tokenizer.path, "tokenizer.path:")
    except UserError as err:
        problems.append(str(err))
        return
    if spec.check_tokenizer is not None:
        problems += spec.check_tokenizer(recipe, tokenizer)


def _check_starting_point(recipe: "Recipe", spec: "FamilySpec", problems: list[str]) -> None:
    """The run dir's own latest checkpoint (what a rerun resumes), else `checkpoint.load`."""
    from mmtrain.runtime.checkpoint.layout import iteration_of, latest_checkpoint, resolve_checkpoint
    from mmtrain.runtime.checkpoint.integrity import check_checkpoint
    from mmtrain.runtime.checkpoint.manager import check_layer_spec
    from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError, check_architecture

    run_dir = Path(recipe.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        problems.append(f"run_dir: {run_dir} is a file; give a folder for checkpoints, logs and metrics")
        return
    own = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    key = "run_dir"
    if own is not None:
        point = own
    elif recipe.checkpoint.load:
        key = "checkpoint.load"
        try:
            kind, point = resolve_checkpoint(recipe.checkpoint.load)
        except FileNotFoundError as err:
            problems.append(str(err))
            return
        if kind == "hf":
            return  # the family's HF loader checks the HF config against the recipe
    else:
        return
    try:
        check_checkpoint(point, spec.name)
        check_architecture(point.parent, recipe.model, spec.architecture_keys, iteration_of(point))
        check_layer_spec(point, recipe.parallel.transformer_impl)
    except CheckpointMismatchError as err:
        text = str(err)
        if key == "run_dir":  # its checkpoints are resumed whatever checkpoint.load says
            text = text.replace("(fix the recipe or checkpoint.load)",
                                "(a rerun resumes the run dir's checkpoints: keep the model, or use another run_dir)")
        problems.append(f"{key}: {text}")


def _warn_shuffle_buffer(recipe: "Recipe", samples: list[int]) -> None:
    """Energon shuffles within each worker's share of every dataset; a buffer larger than the
    share holds the same samples again, so one step can draw a sample twice."""
    if not samples:
        return
    d, p = recipe.data, recipe.parallel
    readers = max(1, d.num_workers) * (p.dp if d.sharding == "dp" else 1)
    share = min(samples) // readers
    if d.shuffle_buffer_size > share:
        log.warning(
            "data.shuffle_buffer_size %d exceeds the %d samples each of the %d loader workers reads from the smallest "
            "dataset (%d samples / (num_workers %d x dp %d)): a step may draw the same sample twice; set "
            "data.shuffle_buffer_size=%d or less", d.shuffle_buffer_size, share, readers, min(samples),
            max(1, d.num_workers), p.dp if d.sharding == "dp" else 1, max(1, share))
