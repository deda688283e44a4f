"""What a checkpoint's loader state was made for, and what a resume changes.
Design notes: docs/training.md, "The loader state's data identity"."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mmtrain.config.load import recipe_to_dict
from mmtrain.runtime.checkpoint.layout import TRAINER_STATE, latest_checkpoint, resolve_checkpoint
from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError

if TYPE_CHECKING:
    from mmtrain.config.schema import Recipe

log = logging.getLogger(__name__)

RESET_SWITCH = "checkpoint.reset_data=true"
#: data keys the loader state does not depend on (see the module docstring)
NOT_IN_LOADER_STATE = ("val_paths", "sharding", "balance", "balance_window", "order_window")
#: keys of the layout a global-order loader state does not depend on: a resume may change them
GLOBAL_ORDER_LAYOUT_KEYS = ("train.micro_batch_size", "data.num_workers")
#: data keys only the global order reads (left out of other modes' identity: older checkpoints lack
#: them). Its window (`order_window`) is in no identity: the order continues across a change of it
GLOBAL_ORDER_KEYS = ("blend",)
#: data keys the global order never reads (the other loaders' buffers, a preflight switch): out of
#: its identity, and not compared with an older checkpoint that recorded them
NOT_READ_BY_GLOBAL_ORDER = ("packing_buffer_size", "shuffle_buffer_size", "plan_allow_estimated_lengths")
#: in a global-order identity: its loader document records the blend its window was planned with,
#: so a resume continues across a changed `data.blend` (announced). An older checkpoint lacks the
#: mark (and its document the blend): a changed blend is refused there, as before
BLEND_IN_DOCUMENT = "data.order_document_has_blend"
#: energon's per-shard sample counts and index id: both rewritten when a shard folder is prepared again
ENERGON_META_FILES = (Path(".nv-meta") / ".info.json", Path(".nv-meta") / "index.uuid")

#: recipe keys announced (not refused) when a resume changes them, with what follows
ANNOUNCED: dict[str, str] = {
    "train.iters": "the LR schedule is recomputed",
    "optimizer.lr": "the LR schedule is recomputed",
    "optimizer.min_lr": "the LR schedule is recomputed",
    "optimizer.lr_mult": "the LR schedule is recomputed",
    "optimizer.warmup_fraction": "the LR schedule is recomputed",
    "optimizer.decay": "the LR schedule is recomputed",
    "train.global_batch_size": "steps from now on take the new batch (consumed samples keep counting)",
    "optimizer.weight_decay": "applies from the next step",
    "optimizer.adam_beta1": "applies from the next step",
    "optimizer.adam_beta2": "applies from the next step",
    "optimizer.adam_eps": "applies from the next step",
    "optimizer.clip_grad": "applies from the next step",
    "freeze": "the trained parts change from the next step",
    "train.eval_interval": "applies from the next step",
    "data.blend": "the global order continues from the same position under the new blend "
    "(the untrained samples of the window it was in go back to the pool)",
}


class DataChangedError(CheckpointMismatchError):
    """The recipe's data differs from what the checkpoint's loader state was made for."""


# ----------------------------------------------------------------------------- the identity


def data_identity(recipe: Recipe) -> dict[str, Any]:
    """The recipe's keys the loader state depends on, JSON-plain, paths resolved, plus a
    fingerprint of each data source (its energon shard counts and index id, or a metadataset's text)."""
    data = recipe_to_dict(recipe)["data"]
    globally = recipe.data.sharding == "global"
    skip = NOT_IN_LOADER_STATE + (NOT_READ_BY_GLOBAL_ORDER if globally else GLOBAL_ORDER_KEYS)
    ident: dict[str, Any] = {f"data.{k}": v for k, v in data.items() if k not in skip}
    if globally:
        ident[BLEND_IN_DOCUMENT] = True
    ident["data.paths"] = [str(Path(p).resolve()) for p in recipe.data.paths]
    ident["data.sources"] = {p: _fingerprint(Path(p)) for p in ident["data.paths"]}
    ident["train.seq_length"] = recipe.train.seq_length
    ident["train.micro_batch_size"] = recipe.train.micro_batch_size
    ident["seed"] = recipe.seed
    return json.loads(json.dumps(ident))


def comparable(saved: dict[str, Any], current: dict[str, Any], sharding: str) -> tuple[dict, dict]:
    """The identities to compare: with `sharding: global` the layout keys, the keys it never
    reads and (where the checkpoint's document records the blend) `data.blend` are left out of
    both (the global order's position holds at any micro-batch and worker count, and across a
    changed blend: a resume there is logged, not refused)."""
    if sharding != "global":
        return saved, current
    drop = GLOBAL_ORDER_LAYOUT_KEYS + tuple(f"data.{k}" for k in NOT_READ_BY_GLOBAL_ORDER) + (BLEND_IN_DOCUMENT,)
    if saved.get(BLEND_IN_DOCUMENT):
        drop += ("data.blend",)
    return {k: v for k, v in saved.items() if k not in drop}, {k: v for k, v in current.items() if k not in drop}


def _fingerprint(source: Path) -> str:
    """A short digest of what a data source holds: a metadataset YAML's text (its blend weights
    and paths), or a shard folder's energon sample counts and index id (missing files hash as
    empty: preflight names an unready folder)."""
    digest = hashlib.sha256()
    for target in [source] if source.is_file() else [source / f for f in ENERGON_META_FILES]:
        try:
            digest.update(target.read_bytes())
        except OSError:
            pass
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def blend_weights(source: Path) -> list[float] | None:
    """A metadataset YAML's train blend weights (for the message), None for a shard folder."""
    if not source.is_file():
        return None
    try:
        doc = yaml.safe_load(source.read_text())
        return [float(entry.get("weight", 1.0)) for entry in doc["splits"]["train"]["blend"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError, ValueError):
        return None


def identity_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key old -> new` for each key whose value differs (a key only one side has counts)."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old == new:
            continue
        if key == "data.sources":
            changes += _source_changes(old or {}, new or {}, current.get("data.paths") or [])
        else:
            changes.append(f"{key} {_show(old)} -> {_show(new)}")
    return changes


def _source_changes(old: dict[str, str], new: dict[str, str], paths: list[str]) -> list[str]:
    """Sources at the same path whose contents changed (a changed path is data.paths' line)."""
    lines = []
    for i, path in enumerate(paths):
        if path in old and old[path] != new.get(path):
            weights = blend_weights(Path(path))
            what = f"blend rewritten (weights now {weights})" if weights is not None else "shards rewritten"
            lines.append(f"data.paths[{i}] {path}: {what}")
    return lines


def _show(value: Any) -> str:
    return "(unset)" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def refusal(ckpt: Path, changes: list[str]) -> str:
    """The one-line refusal naming each change and the switch."""
    return (
        f"{ckpt}: its loader state was saved for other data ({'; '.join(changes)}); resuming it would "
        f"feed the old loader position into the new data. Restore those keys to resume exactly, or set "
        f"{RESET_SWITCH} to keep the weights, optimizer and step and start the data fresh, or use another "
        "run_dir"
    )


# ----------------------------------------------------------------------------- the decision


def saved_record(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's trainer_state.json ({} when unreadable: other checks name that)."""
    try:
        return json.loads((ckpt / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return {}


def resume_decision(ckpt: Path, recipe: Recipe) -> str:
    """How the loader state of the training checkpoint `ckpt` is treated on resume:
    'restore' (the data is the same) or 'reset' (checkpoint.reset_data applies). Raises
    DataChangedError when the data differs and the switch is off (every checkpoint of this format
    records it: `layout.CHECKPOINT_FORMAT`)."""
    record = saved_record(ckpt)
    saved = record.get("data") or {}
    reset = recipe.checkpoint.reset_data
    changes = identity_changes(*comparable(saved, data_identity(recipe), recipe.data.sharding))
    if not changes:
        # a rerun of a reset run continues its data; a checkpoint written without the switch resets
        return "reset" if reset and not record.get("data_reset", False) else "restore"
    if reset:
        return "reset"
    raise DataChangedError(refusal(ckpt, changes))


def explain(decision: str, ckpt: Path, recipe: Recipe) -> str | None:
    """The log line of a decision, None when there is nothing to say."""
    if decision == "reset":
        return (
            f"checkpoint.reset_data: the loader starts fresh from its seed (data.paths "
            f"{recipe.data.paths}); weights, optimizer and step come from {ckpt}"
        )
    if recipe.checkpoint.reset_data:
        return "checkpoint.reset_data: the data is unchanged since this run's reset, so its data position resumes"
    return None


def resume_point(recipe: Recipe) -> Path | None:
    """The training checkpoint whose loader state a run would restore (its own latest, else a
    full `checkpoint.load`), or None (fresh start, weights only, HF, nothing valid)."""
    run_dir = Path(recipe.run_dir)
    own = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if own is not None:
        return own
    if not recipe.checkpoint.load or recipe.checkpoint.weights_only:
        return None
    try:
        kind, path = resolve_checkpoint(recipe.checkpoint.load)
    except FileNotFoundError:
        return None  # preflight's own check names it
    return path if kind == "mmtrain" else None


def resume_data_problems(recipe: Recipe) -> list[str]:
    """For preflight: the refusal line (key `run_dir` or `checkpoint.load`) when resuming would
    restore a loader state made for other data; [] otherwise."""
    point = resume_point(recipe)
    if point is None:
        return []
    try:
        resume_decision(point, recipe)
    except DataChangedError as err:
        key = "run_dir" if point.parent.parent.resolve() == Path(recipe.run_dir).resolve() else "checkpoint.load"
        return [f"{key}: {err}"]
    return []


# ----------------------------------------------------------------------------- announcements


def recipe_changes(ckpt: Path, resolved_yaml: str) -> list[str]:
    """One line per ANNOUNCED key the new resolved recipe changes against the checkpoint's
    `config.yaml` (none when the checkpoint has no readable one)."""
    try:
        old = _flatten(yaml.safe_load((ckpt / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError):
        return []
    new = _flatten(yaml.safe_load(resolved_yaml) or {})
    return [
        f"{key} {_show(old.get(key))} -> {_show(new.get(key))}: {why}"
        for key, why in ANNOUNCED.items()
        if old.get(key) != new.get(key)
    ]


def _flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; mappings under a leaf key (lr_mult) stay whole."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in ANNOUNCED:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out
