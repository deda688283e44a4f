"""Recipe schema: YAML -> validated, typed config (nested dataclasses).

Recipes are data (DESIGN.md): a recipe is a YAML file checked against the dataclasses below.
Unknown keys, wrong types and bad enum values are rejected with the key's full path (and a
"did you mean" hint); any key can be overridden on the command line as `a.b.c=value`, the
value being read with `yaml.safe_load` and validated the same way. The `model:` section is
typed by the family's config dataclass (`ModelSpec.model_config_cls`).

Stages: a recipe may carry a `stages:` table, `{name: patch}`, where a patch is a partial
recipe (nested mappings or dotted keys) merged over the file when `stage: name` is selected
(in the file or as `stage=name` on the command line). Command-line overrides win over the
stage patch. The resolved config (`save_resolved`) has the patch applied and no `stages:`
table; its `stage:` then only records which stage it was made from.

Every key, with meaning and default: docs/recipes.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import re
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

Action = Literal["run", "dry_run", "auto_tune"]
Decay = Literal["cosine", "linear", "constant"]
Recompute = Literal["none", "full", "selective"]
Precision = Literal["fp32", "bf16"]
Backend = Literal["auto", "nccl", "gloo"]
Sharding = Literal["dp", "replicated"]


# ----------------------------------------------------------------------------- sections


@dataclass
class DataConfig:
    """Where the shards are and how the loader tiles/packs them (mmdata.energon_loaders)."""

    paths: list[str] = field(default_factory=list)  # shard dirs, or one energon metadataset YAML
    num_workers: int = 2
    max_tiles: int = 9  # anyres_max_N
    video_frames: int = 8
    packing: bool = True
    packing_buffer_size: int = 64
    shuffle_buffer_size: int = 100
    # (added by the train runtime, helper C) how DP ranks split the stream:
    #   "dp": energon's own per-DP-rank sharding (scales; loader state is tied to the DP size)
    #   "replicated": every rank reads the single-process stream and keeps its share of each
    #   global batch (identical batches for any TP/PP/DP layout, resumable across DP sizes;
    #   costs dp x the decoding work - for tests, layout changes and small DP)
    sharding: Literal["dp", "replicated"] = "dp"
    # held-out shard dirs (or one metadataset YAML) for `train.eval_interval`; read with the
    # same loader settings, the recipe's seed and no state carried between evaluations
    val_paths: list[str] = field(default_factory=list)


@dataclass
class TokenizerConfig:
    path: str | None = None  # HF tokenizer dir; required for action=run


@dataclass
class TrainConfig:
    iters: int = 1000
    seq_length: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 1
    eval_interval: int = 0  # steps between evaluations on data.val_paths; 0 = no evaluation
    eval_iters: int = 4  # global batches per evaluation


@dataclass
class OptimizerConfig:
    """AdamW + LR schedule. `vision_tower_lr: null` means the vision tower uses `lr`."""

    lr: float = 1.0e-5
    min_lr: float = 0.0
    vision_tower_lr: float | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0  # 0 = no clipping
    warmup_fraction: float = 0.03
    decay: Decay = "cosine"


@dataclass
class FreezeConfig:
    vision_tower: bool = False
    projector: bool = False
    llm: bool = False


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    precision: Precision = "fp32"
    distributed_optimizer: bool = True
    backend: Backend = "auto"

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def dp(self) -> int:
        """Data-parallel size (only meaningful once the recipe validated)."""
        return self.world_size // (self.tp * self.pp)


@dataclass
class CheckpointConfig:
    interval: int = 1000  # save every N steps (and at the end); 0 = only at the end
    keep_last: int = 2  # 0 = keep all
    load: str | None = None  # checkpoint dir (or HF dir) to start from
    # take only the model weights from `load` (fresh optimizer, schedule, step, data), as a new
    # training stage does; a run that has its own checkpoints in run_dir always resumes them
    weights_only: bool = False


@dataclass
class LoggingConfig:
    interval: int = 1
    tensorboard: bool = True  # used only when `tensorboard` is importable


@dataclass
class AutoTuneConfig:
    """Search space and device model for `action: auto_tune` (mmtrain/auto_tune.py).

    Empty candidate lists mean "every valid value"."""

    device_memory_gb: float = 80.0
    memory_fraction: float = 0.9  # usable share of device memory (allocator, fragmentation)
    device_tflops: float = 989.0  # peak dense TFLOP/s per device in the recipe's precision
    matmul_efficiency: float = 0.6  # achievable share of the peak (time model only)
    tp_bandwidth_gbps: float = 450.0  # per-device bandwidth of the TP group (NVLink), GB/s
    dp_bandwidth_gbps: float = 25.0  # per-device bandwidth for DP gradient traffic, GB/s
    tp: list[int] = field(default_factory=list)
    pp: list[int] = field(default_factory=list)
    micro_batch_size: list[int] = field(default_factory=list)
    recompute: list[Recompute] = field(default_factory=list)
    top: int = 10  # rows in the printed table
    # share of LLM positions that are image/video features; sizes the vision-tower activations
    # in dry_run and auto_tune (1.0 = worst case, every position an image feature)
    media_token_fraction: float = 1.0


@dataclass(kw_only=True)
class Recipe:
    """A whole, validated recipe. `model` is an instance of the family's config dataclass."""

    action: Action = "run"
    family: str
    run_dir: str
    seed: int = 1234
    stage: str | None = None
    model: Any
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    auto_tune: AutoTuneConfig = field(default_factory=AutoTuneConfig)

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)


# ----------------------------------------------------------------------------- errors


class RecipeError(ValueError):
    """All problems found in one recipe, one per line, each naming the key path."""

    def __init__(self, errors: Sequence[str], source: str = "recipe"):
        self.errors = list(errors)
        self.source = source
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid recipe {source}:\n{lines}")


class _Errors:
    """Collects (path, message); attributes a path to the override or stage that set it."""

    def __init__(self, origins: dict[tuple[str, ...], str]):
        self.items: list[str] = []
        self.origins = origins

    def add(self, path: tuple[str, ...], msg: str, involved: Sequence[tuple[str, ...]] = ()) -> None:
        """`involved`: other keys a cross-field check read, so an override that set one is named."""
        where = ".".join(path) or "<top level>"
        found = [o for o in dict.fromkeys(self._origin(q) for q in (path, *involved)) if o]
        origin = "".join(f"{o}: " for o in found)
        self.items.append(f"{origin}{where}: {msg}")

    def _origin(self, path: tuple[str, ...]) -> str:
        key = tuple(p.split("[")[0] for p in path)
        for n in range(len(key), 0, -1):
            if key[:n] in self.origins:
                return self.origins[key[:n]]
        return ""


def _suggest(word: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


# ----------------------------------------------------------------------------- conversion

_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
_NONE = type(None)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "anything"
    if tp is _NONE:
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return f"list of {len(args)} ({', '.join(_type_name(a) for a in args)})"
    if origin is dict:
        return f"mapping of {_type_name(args[1])}" if args else "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: tuple[str, ...], errors: _Errors) -> Any:
    """Check `value` against type `tp`; returns the typed value (dataclass instances for sections)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        for arg in args:
            if arg is _NONE:
                continue
            trial = _Errors({})
            out = _convert(value, arg, path, trial)
            if not trial.items:
                return out
        errors.add(path, f"expected {_type_name(tp)}, got {_show(value)}")
        return None
    if origin is Literal:
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        hint = _suggest(value, [str(a) for a in args]) if isinstance(value, str) else ""
        errors.add(path, f"expected {_type_name(tp)}, got {_show(value)}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(value, tp, path, errors)
    if origin is list:
        if not isinstance(value, list):
            errors.add(path, f"expected {_type_name(tp)}, got {_show(value)}")
            return []
        return [_convert(v, args[0] if args else Any, path[:-1] + (f"{path[-1]}[{i}]",), errors)
                for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            errors.add(path, f"expected {_type_name(tp)}, got {_show(value)}")
            return ()
        if len(args) == 2 and args[1] is Ellipsis:
            item_types = [args[0]] * len(value)
        else:
            item_types = list(args)
            if len(value) != len(args):
                errors.add(path, f"expected {_type_name(tp)}, got {len(value)} items")
                return tuple(value)
        return tuple(_convert(v, t, path[:-1] + (f"{path[-1]}[{i}]",), errors)
                     for i, (v, t) in enumerate(zip(value, item_types)))
    if origin is dict:
        if not isinstance(value, dict):
            errors.add(path, f"expected {_type_name(tp)}, got {_show(value)}")
            return {}
        key_t, val_t = args if args else (Any, Any)
        return {_convert(k, key_t, path + (str(k),), errors): _convert(v, val_t, path + (str(k),), errors)
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 (PyYAML) reads `1e-3` as a string; YAML 1.2 reads it as a float. Accept the
        # scientific-notation spelling only, so `lr=1e-3` on the command line works.
        if isinstance(value, str) and _YAML11_FLOAT.match(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value
    errors.add(path, f"expected {_type_name(tp)}, got {_show(value)}")
    return value


def _convert_dataclass(value: Any, cls: type, path: tuple[str, ...], errors: _Errors) -> Any:
    if not isinstance(value, dict):
        errors.add(path, f"expected a mapping (section {cls.__name__}), got {_show(value)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in value:
        if not isinstance(key, str) or key not in fields:
            errors.add(path + (str(key),), "unknown key" + _suggest(str(key), list(fields)))
    kwargs: dict[str, Any] = {}
    ok = True
    for name, f in fields.items():
        if name in value:
            before = len(errors.items)
            kwargs[name] = _convert(value[name], hints[name], path + (name,), errors)
            ok = ok and len(errors.items) == before
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.add(path + (name,), f"missing required key ({_type_name(hints[name])})")
            ok = False
    if not ok or len(value) != sum(1 for k in value if k in fields):
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # the class's own __post_init__ checks
        errors.add(path, str(err))
        return None


def to_plain(obj: Any) -> Any:
    """Dataclasses/tuples -> plain dicts/lists, ready for yaml.safe_dump."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- overrides & stages


@dataclass(frozen=True)
class Override:
    path: tuple[str, ...]
    value: Any
    text: str


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_][A-Za-z0-9_\-]*)*$")


def parse_override(text: str) -> Override:
    """`a.b.c=value` -> Override; the value is read with yaml.safe_load (`x=` means null)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise RecipeError([f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. train.iters=100"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise RecipeError([f"override {text!r}: value is not valid YAML ({err})"]) from None
    return Override(tuple(key.split(".")), value, text)


def _set_path(tree: dict, path: tuple[str, ...], value: Any, what: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            raise RecipeError([f"{what}: {'.'.join(path[: i + 1])} is a {type(nxt).__name__}, not a section"])
        node = nxt
    node[path[-1]] = value


def _nest(patch: dict) -> dict:
    """Dotted keys in a stage patch -> nested mappings."""
    out: dict = {}
    for key, value in patch.items():
        value = _nest(value) if isinstance(value, dict) else value
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = _merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = value
    return out


def _merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaf_paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            paths += _leaf_paths(value, prefix + (str(key),))
        else:
            paths.append(prefix + (str(key),))
    return paths


def _stage_name(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # `stage: 1` and `stage=1` name stage "1"
    raise RecipeError([f"stage: expected a stage name (str or int), got {_show(value)}"])


# ----------------------------------------------------------------------------- model class


def model_config_class(family: str) -> type:
    """The family's `model:` dataclass: from its ModelSpec, or (spec not built yet) from the
    family's `config` module, the one dataclass there whose name ends in `ModelConfig`."""
    from mmtrain.model_spec import get_model_spec

    package = "mmtrain." + family.replace("-", "_")
    try:
        return get_model_spec(family).model_config_cls
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith(package):
            raise
    module = importlib.import_module(package + ".config")
    found = [v for k, v in vars(module).items()
             if k.endswith("ModelConfig") and dataclasses.is_dataclass(v) and v.__module__ == module.__name__]
    if len(found) != 1:
        raise KeyError(f"{package}.config must define exactly one *ModelConfig dataclass, found {len(found)}")
    return found[0]


# ----------------------------------------------------------------------------- loading


def load_recipe(
    path: str | os.PathLike,
    overrides: Sequence[str] = (),
    family: str | None = None,
    model_config_cls: type | None = None,
) -> Recipe:
    """Read, merge (stage, overrides) and validate a recipe file. `family` is the CLI
    subcommand (`llava-ov`, `emu3`); the recipe's `family:` must match it."""
    text = Path(path).read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RecipeError([f"not valid YAML: {err}"], str(path)) from None
    return load_recipe_dict(raw if raw is not None else {}, overrides, family, model_config_cls, source=str(path))


def load_recipe_dict(
    raw: Any,
    overrides: Sequence[str] = (),
    family: str | None = None,
    model_config_cls: type | None = None,
    source: str = "<dict>",
) -> Recipe:
    """`load_recipe` for an already-parsed mapping (tests, programmatic use)."""
    try:
        return _load(raw, overrides, family, model_config_cls)
    except RecipeError as err:
        raise RecipeError(err.errors, source) from None


def _load(raw: Any, override_texts: Sequence[str], family: str | None, model_cls: type | None) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError([f"<top level>: expected a mapping, got {_show(raw)}"])
    parsed = [parse_override(t) for t in override_texts]
    tree = _copy(raw)
    origins: dict[tuple[str, ...], str] = {}
    for ov in parsed:  # first pass: may select the stage or edit the stage table
        _set_path(tree, ov.path, ov.value, f"override {ov.text!r}")

    stages = tree.pop("stages", None)
    stage = _stage_name(tree.get("stage"))
    tree["stage"] = stage
    stage_override = next((ov.text for ov in parsed if ov.path == ("stage",)), None)
    if stages is None and stage is not None and stage_override is not None:
        raise RecipeError([f"override {stage_override!r}: stage: this recipe has no stages: table"])
    if stages is not None and stage is not None:
        if not isinstance(stages, dict) or not all(isinstance(v, dict) for v in stages.values()):
            raise RecipeError(["stages: expected a mapping of stage name -> partial recipe"])
        table = {_stage_name(k): v for k, v in stages.items()}
        if stage not in table:
            raise RecipeError([f"stage: unknown stage {stage!r}; known: {', '.join(map(repr, table))}"
                               + _suggest(stage, list(table))])
        patch = _nest(table[stage])
        if "stages" in patch or "stage" in patch:
            raise RecipeError([f"stages.{stage}: a stage may not set 'stage' or 'stages'"])
        tree = _merge(tree, patch)
        for p in _leaf_paths(patch):
            origins[p] = f"stage {stage!r}"
    for ov in parsed:  # second pass: the command line wins over the stage patch
        if ov.path[0] not in ("stages", "stage"):
            _set_path(tree, ov.path, ov.value, f"override {ov.text!r}")
            origins[ov.path] = f"override {ov.text!r}"

    errors = _Errors(origins)
    had_model = "model" in tree
    model_raw = tree.pop("model", None)
    tree["model"] = {}  # typed below by the family's class
    recipe = _convert_dataclass(tree, Recipe, (), errors)
    if not had_model:
        errors.add(("model",), "missing required key (the family's model config)")

    fam = tree.get("family")
    if family is not None and isinstance(fam, str) and fam != family:
        errors.add(("family",), f"recipe is for {fam!r} but was run as `mmtrain {family}`")
    model = None
    if model_cls is None and isinstance(fam, str):
        try:
            model_cls = model_config_class(fam)
        except (KeyError, ModuleNotFoundError) as err:
            errors.add(("family",), f"unknown or unavailable model family {fam!r} ({err})")
    if model_cls is not None:
        model = _convert_dataclass(model_raw if model_raw is not None else {}, model_cls, ("model",), errors)

    if recipe is not None and model is not None:
        recipe.model = model
        _cross_checks(recipe, errors)
    if errors.items:
        raise RecipeError(errors.items)
    return recipe


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def _cross_checks(r: Recipe, errors: _Errors) -> None:
    """Checks that span keys; each names the keys involved."""
    t, p, o = r.train, r.parallel, r.optimizer
    positive = {
        ("train", "iters"): t.iters, ("train", "seq_length"): t.seq_length,
        ("train", "micro_batch_size"): t.micro_batch_size, ("train", "global_batch_size"): t.global_batch_size,
        ("train", "eval_iters"): t.eval_iters,
        ("parallel", "tp"): p.tp, ("parallel", "pp"): p.pp,
        ("parallel", "nproc_per_node"): p.nproc_per_node, ("parallel", "nnodes"): p.nnodes,
        ("logging", "interval"): r.logging.interval, ("data", "max_tiles"): r.data.max_tiles,
        ("data", "video_frames"): r.data.video_frames,
    }
    for path, value in positive.items():
        if value <= 0:
            errors.add(path, f"must be > 0, got {value}")
    non_negative = {
        ("train", "eval_interval"): t.eval_interval, ("checkpoint", "interval"): r.checkpoint.interval,
        ("checkpoint", "keep_last"): r.checkpoint.keep_last, ("data", "num_workers"): r.data.num_workers,
        ("data", "packing_buffer_size"): r.data.packing_buffer_size,
        ("data", "shuffle_buffer_size"): r.data.shuffle_buffer_size,
        ("optimizer", "lr"): o.lr, ("optimizer", "min_lr"): o.min_lr, ("optimizer", "clip_grad"): o.clip_grad,
        ("optimizer", "weight_decay"): o.weight_decay,
    }
    for path, value in non_negative.items():
        if value < 0:
            errors.add(path, f"must be >= 0, got {value}")
    if t.eval_interval > 0 and not r.data.val_paths:
        errors.add(("data", "val_paths"), f"must list at least one shard dir or metadataset YAML when "
                   f"train.eval_interval={t.eval_interval} (> 0); set train.eval_interval=0 to skip evaluation",
                   [("train", "eval_interval")])
    if o.vision_tower_lr is not None and o.vision_tower_lr < 0:
        errors.add(("optimizer", "vision_tower_lr"), f"must be >= 0, got {o.vision_tower_lr}")
    if o.min_lr > o.lr:
        errors.add(("optimizer", "min_lr"), f"must be <= optimizer.lr ({o.lr}), got {o.min_lr}", [("optimizer", "lr")])
    if not 0.0 <= o.warmup_fraction <= 1.0:
        errors.add(("optimizer", "warmup_fraction"), f"must be in [0, 1], got {o.warmup_fraction}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            errors.add(("optimizer", name), f"must be in [0, 1), got {getattr(o, name)}")
    if not 0 <= p.node_rank < max(p.nnodes, 1):
        errors.add(("parallel", "node_rank"), f"must be in [0, parallel.nnodes={p.nnodes}), got {p.node_rank}")
    if not 0 < p.master_port < 65536:
        errors.add(("parallel", "master_port"), f"must be a TCP port, got {p.master_port}")
    if min(p.tp, p.pp, p.nproc_per_node, p.nnodes, t.micro_batch_size) > 0:
        world, mp = p.world_size, p.tp * p.pp
        layout = [("parallel", k) for k in ("tp", "pp", "nproc_per_node", "nnodes")]
        if world % mp:
            errors.add(("parallel",), f"tp*pp = {p.tp}*{p.pp} = {mp} does not divide the world size "
                       f"nproc_per_node*nnodes = {p.nproc_per_node}*{p.nnodes} = {world}", layout)
        else:
            dp = world // mp
            if t.global_batch_size % (t.micro_batch_size * dp):
                errors.add(("train", "global_batch_size"),
                           f"{t.global_batch_size} is not divisible by micro_batch_size*dp = "
                           f"{t.micro_batch_size}*{dp} = {t.micro_batch_size * dp} "
                           f"(dp = world {world} / (tp {p.tp} * pp {p.pp}))", layout + [("train", "micro_batch_size")])
    model_tiles = getattr(r.model, "max_tiles", None)
    if model_tiles is not None and model_tiles != r.data.max_tiles:
        errors.add(("data", "max_tiles"), f"{r.data.max_tiles} differs from model.max_tiles={model_tiles}; "
                   "the loader and the model must lay out the same tiles", [("model", "max_tiles")])
    a = r.auto_tune
    for name in ("device_memory_gb", "device_tflops", "tp_bandwidth_gbps", "dp_bandwidth_gbps", "top"):
        if getattr(a, name) <= 0:
            errors.add(("auto_tune", name), f"must be > 0, got {getattr(a, name)}")
    for name in ("memory_fraction", "matmul_efficiency"):
        if not 0 < getattr(a, name) <= 1:
            errors.add(("auto_tune", name), f"must be in (0, 1], got {getattr(a, name)}")
    if not 0 <= a.media_token_fraction <= 1:
        errors.add(("auto_tune", "media_token_fraction"), f"must be in [0, 1], got {a.media_token_fraction}")
    for name in ("tp", "pp", "micro_batch_size"):
        if any(x <= 0 for x in getattr(a, name)):
            errors.add(("auto_tune", name), f"candidates must be > 0, got {getattr(a, name)}")
    if r.action == "run":
        if not r.data.paths:
            errors.add(("data", "paths"), "must list at least one shard dir or metadataset YAML for action: run")
        if not r.tokenizer.path:
            errors.add(("tokenizer", "path"), "is required for action: run")
        if r.freeze.vision_tower and r.freeze.projector and r.freeze.llm:
            errors.add(("freeze",), "everything is frozen; nothing would train", [("action",)])


# ----------------------------------------------------------------------------- saving


def recipe_to_dict(recipe: Recipe) -> dict:
    return to_plain(recipe)


def dump_recipe(recipe: Recipe) -> str:
    header = ("# Resolved recipe (stage and command-line overrides applied), written by mmtrain.\n"
              "# Re-run it as is: mmtrain FAMILY THIS_FILE\n")
    return header + yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False)


def save_resolved(recipe: Recipe, path: str | os.PathLike) -> Path:
    """Write the fully resolved recipe atomically; `load_recipe(path) == recipe`."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dump_recipe(recipe))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
