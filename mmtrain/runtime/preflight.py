"""Checks of what a training run will touch, before anything heavy (after the recipe validated, before the
model is built or anything is written into `run_dir`).
Design notes: docs/training.md, "preflight, module by module"."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from mmdata import shard_format as sf
from mmdata.energon_configs import config_sample_type
from mmdata.packing.balance import StepShape
from mmdata.energon_loaders.plan_packing import PlanError, estimated_lengths_problem, plan_for_data, plan_step_shape
from mmdata.errors import UserError
from mmdata.global_order.sources import estimated_lengths_problem as order_lengths_problem
from mmdata.local_tokenizer import load_local_tokenizer
from mmtrain.recipe_plan import recipe_geometry
from mmdata.readiness import DatasetNotReady, data_source_samples
from mmtrain.runtime.checkpoint.data_identity import resume_data_problems
from mmtrain.runtime.checkpoint.integrity import check_checkpoint
from mmtrain.runtime.checkpoint.layout import iteration_of, latest_checkpoint, resolve_checkpoint
from mmtrain.runtime.checkpoint.manager import check_layer_spec
from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError, check_architecture
from mmtrain.runtime.metrics import tensorboard_available
from mmtrain.spec import Ref

if TYPE_CHECKING:
    from mmtrain.config.schema import Recipe
    from mmtrain.spec import FamilySpec

#: every family, to name the one a data path's samples are for: the registry sits above the
#: runtime (its families build on it), so it is reached through its "module:function" boundary
ALL_FAMILIES = Ref("mmtrain.registry:FAMILIES")

log = logging.getLogger(__name__)


class PreflightError(UserError):
    """Every problem found, one per line, each naming its recipe key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"the run cannot start ({len(problems)} problem{'s' if len(problems) > 1 else ''}); "
            f"nothing was built or written:\n{lines}"
        )


def preflight(recipe: "Recipe", spec: "FamilySpec") -> None:
    """Raise PreflightError listing every problem; log warnings. For `action: run`."""
    problems: list[str] = []
    samples = _check_data(recipe, spec, problems)
    _check_tokenizer(recipe, spec, problems)
    _check_starting_point(recipe, spec, problems)
    if not problems:  # a damaged or foreign checkpoint is named already; its data is not checked then
        problems += resume_data_problems(recipe)
    if recipe.logging.tensorboard:
        if not tensorboard_available():
            problems.append(
                "logging.tensorboard: true, but the `tensorboard` package is not installed "
                "(pip install tensorboard, or set logging.tensorboard=false)"
            )
    if problems:
        raise PreflightError(problems)
    _warn_shuffle_buffer(recipe, samples)


def _check_data(recipe: "Recipe", spec: "FamilySpec", problems: list[str]) -> list[int]:
    """Samples of every training dataset (for the warnings); problems appended."""
    train_samples: list[int] = []
    wrong_kind = False
    for key, paths in (("data.paths", recipe.data.paths), ("data.val_paths", recipe.data.val_paths)):
        for i, path in enumerate(paths):
            try:
                found = data_source_samples(path)
            except DatasetNotReady as err:
                problems.append(f"{key}[{i}]: {err}")
                continue
            kind_problems = _sample_type_problems(f"{key}[{i}]", Path(path), spec)
            problems += kind_problems
            d = recipe.data
            # (a plan's own check below; without packing a row is one sample: nothing overflows)
            estimated = not d.plan_allow_estimated_lengths and d.packing not in (False, "plan")
            if d.sharding == "global" and estimated and (why := order_lengths_problem(path)):
                problems.append(f"{key}[{i}]: {why}")
            wrong_kind = wrong_kind or bool(kind_problems)
            if key == "data.paths":
                train_samples += found
    if recipe.data.packing == "plan" and train_samples and not wrong_kind:
        t = recipe.train
        shape = StepShape(recipe.parallel.dp, t.micro_batch_size, t.global_batch_size)
        # the global order places each step's sequences by cost at the run's layout: any plan fits it
        placed_per_step = recipe.data.sharding == "global"
        try:
            # (type checker: the plan's path replaces the recipe's string)
            _, path, info = plan_for_data(  # type: ignore[assignment]
                recipe.data.paths,
                recipe.data.packing_plan,
                t.seq_length,
                geometry=recipe_geometry(recipe),
                step_shape=None if placed_per_step else shape,
            )
            if getattr(recipe.data, "balance", False) and not placed_per_step and plan_step_shape(info) is None:
                problems.append(
                    f"data.balance: true: packing plan {path} is not balanced: run `mmtrain pack-plan "
                    f"RECIPE.yaml` (it balances for data.balance: true), or with --dp {shape.dp} "
                    f"--micro-batch-size {shape.micro_batch_size} --global-batch-size "
                    f"{shape.global_batch_size}"
                )
            if not recipe.data.plan_allow_estimated_lengths and (why := estimated_lengths_problem(info, path)):
                problems.append(f"data.packing: plan: {why}")
        except (PlanError, FileNotFoundError) as err:  # (FileNotFoundError: a tokenizer.path to fingerprint)
            problems.append(f"data.packing: plan: {err}")
    return train_samples


def _sample_type_problems(key: str, path: Path, spec: "FamilySpec") -> list[str]:
    """One line per dataset under `path` whose energon sample type is not the family's: the
    loader would fail on every sample only after the model was built and run_dir written."""
    if spec.sample_type is None:
        return []

    want, what = spec.sample_type
    problems = []
    for leaf in leaf_datasets(path):
        found = dataset_sample_type(leaf)
        if found is None or found == want:
            continue
        where = str(path) if leaf == path else f"{path} (its dataset {leaf})"
        families: dict[str, FamilySpec] = ALL_FAMILIES.resolve()
        other = next((f for f in families.values() if f.sample_type and f.sample_type[0] == found), None)
        # (type checker: `other` has a sample_type by the filter above)
        held = (
            f"{_short(found)} samples, {other.sample_type[1]}"  # type: ignore[index]
            if other is not None
            else f"samples of energon type {found}, which no mmtrain family trains on"
        )
        fix = f"use `mmtrain {other.name}` for these shards, or " if other is not None else ""
        problems.append(
            f"{key}: {where} holds {held}; mmtrain {spec.name} trains on {_short(want)} samples, "
            f"{what}: {fix}give data paths of that kind"
        )
    return problems


def _short(sample_type: str) -> str:
    return sample_type.rsplit(".", 1)[-1]


def dataset_sample_type(folder: Path) -> str | None:
    """ "module.Class" of a shard folder's energon sample type, from the dataset config our
    loaders read (`.nv-meta/mmdata.yaml`, else `dataset.yaml`: mmdata/energon_configs.py), else
    our manifest's `energon.sample_type`; None when neither names one (nothing to check)."""
    if (found := config_sample_type(folder)) is not None:
        return found
    try:
        manifest = json.loads((folder / sf.MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    found = (manifest.get("energon") or {}).get("sample_type") if isinstance(manifest, dict) else None
    return found if isinstance(found, str) and found else None


def leaf_datasets(path: Path, depth: int = 0) -> list[Path]:
    """The shard folders a data path reads: itself, or every `path:` of a metadataset YAML
    (relative to the YAML's folder; nested metadatasets followed)."""
    if not (path.is_file() and path.suffix in (".yaml", ".yml")):
        return [path]
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []  # reported by the readiness check
    leaves: list[Path] = []
    for rel in _yaml_paths(doc):
        target = Path(rel) if Path(rel).is_absolute() else path.parent / rel
        if not target.is_file():
            leaves.append(target)
        elif depth < 8:
            leaves += leaf_datasets(target, depth + 1)
    return list(dict.fromkeys(leaves))


def _yaml_paths(node: object) -> list[str]:
    """Every string `path:` value in a parsed metadataset, in document order."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in ([v] if k == "path" and isinstance(v, str) else _yaml_paths(v))]
    if isinstance(node, list):
        return [p for item in node for p in _yaml_paths(item)]
    return []


def _check_tokenizer(recipe: "Recipe", spec: "FamilySpec", problems: list[str]) -> None:
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
            text = text.replace(
                "(fix the recipe or checkpoint.load)",
                "(a rerun resumes the run dir's checkpoints: keep the model, or use another run_dir)",
            )
        problems.append(f"{key}: {text}")


def _warn_shuffle_buffer(recipe: "Recipe", samples: list[int]) -> None:
    """Energon shuffles within each worker's share of every dataset; a buffer larger than the
    share holds the same samples again, so one step can draw a sample twice."""
    if not samples or recipe.data.sharding == "global":  # (the global order reads by index: no shuffle buffer)
        return
    d, p = recipe.data, recipe.parallel
    readers = max(1, d.num_workers) * (p.dp if d.sharding == "dp" else 1)
    share = min(samples) // readers
    if d.shuffle_buffer_size > share:
        log.warning(
            "data.shuffle_buffer_size %d exceeds the %d samples each of the %d loader workers reads from the smallest "
            "dataset (%d samples / (num_workers %d x dp %d)): a step may draw the same sample twice; set "
            "data.shuffle_buffer_size=%d or less",
            d.shuffle_buffer_size,
            share,
            readers,
            min(samples),
            max(1, d.num_workers),
            p.dp if d.sharding == "dp" else 1,
            max(1, share),
        )
