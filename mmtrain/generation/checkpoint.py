"""Which checkpoint `mmtrain generate` was given, before anything heavy loads: a megatron
checkpoint dir (converted, or a training run's, at any TP/PP: dist-checkpointing reshards it
to the single process generation runs in), a training run dir, or an HF dir; that it holds the
asked family's model (another family's checkpoint is named as such); where its HF side files
(tokenizer, processor, kept VQ...) are; and the device / dtype the model runs in."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from mmdata.errors import UserError
from mmtrain.config.errors import RecipeError
from mmtrain.config.typed import from_plain
from mmtrain.runtime.checkpoint.layout import LATEST, checkpoints_root
from mmtrain.runtime.checkpoint.weights import MODEL_CONFIG, load_model_config_dict
from mmtrain.runtime.hf_conversion import ASSETS_DIR, is_hf_dir
from mmtrain.spec import Ref

#: every family, to name the one a checkpoint holds: the registry sits above the engine (its
#: families build on it), so it is reached through its "module:function" boundary
ALL_FAMILIES = Ref("mmtrain.registry:FAMILIES")


class GenerationError(UserError):
    """A user error (bad checkpoint, missing asset, bad option): one line, exit 2 (mmdata/errors.py)."""


@dataclass(frozen=True)
class CheckpointRef:
    #: what the family's loader takes: a megatron checkpoint dir (with `latest`) or an HF dir
    path: Path
    is_hf: bool
    #: where the checkpoint's HF side files are (the HF dir itself, or a converted checkpoint's
    #: `hf_assets/`); None when it has none (e.g. a checkpoint trained from scratch)
    assets: Optional[Path]
    iteration: Optional[int] = None


@dataclass(frozen=True)
class Placement:
    """Where and in which precision the model runs."""

    device: torch.device
    dtype: torch.dtype

    @classmethod
    def resolve(cls, device: str = "auto", dtype: str = "auto") -> "Placement":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise GenerationError("--device cuda: no CUDA device is available")
        if dtype == "auto":
            dtype = "bfloat16" if dev.type == "cuda" else "float32"
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
        if dt is None:
            raise GenerationError(f"--dtype {dtype}: expected auto, float32, bfloat16 or float16")
        return cls(dev, dt)

    def apply(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(device=self.device, dtype=self.dtype)


def resolve_checkpoint(path: str | os.PathLike, family: str, iteration: Optional[int] = None) -> CheckpointRef:
    """Check `path` holds a `family` model; GenerationError naming what it holds otherwise."""
    p = Path(path)
    if not p.is_dir():
        raise GenerationError(f"--checkpoint {p}: no such directory")
    if not (p / LATEST).exists() and (checkpoints_root(p) / LATEST).exists():
        p = checkpoints_root(p)  # a training run dir
    if is_hf_dir(p):
        _check_hf_family(p, family)
        return CheckpointRef(p, True, p, iteration)
    if not (p / LATEST).exists():
        raise GenerationError(
            f"--checkpoint {p}: neither a megatron checkpoint dir (no '{LATEST}' file) "
            "nor an HF model dir (no config.json)"
        )
    _check_mcore_family(p, family, iteration)
    assets = p / ASSETS_DIR
    return CheckpointRef(p, False, assets if assets.is_dir() else None, iteration)


def _families_with_generation() -> dict:
    return {name: spec for name, spec in ALL_FAMILIES.resolve().items() if spec.generation is not None}


def _check_hf_family(p: Path, family: str) -> None:
    try:
        model_type = json.loads((p / "config.json").read_text()).get("model_type")
    except ValueError as exc:
        raise GenerationError(f"{p / 'config.json'}: not JSON ({exc})") from None
    families = _families_with_generation()
    if model_type in families[family].generation.hf_model_types:
        return
    owner = next((n for n, s in families.items() if model_type in s.generation.hf_model_types), None)
    hint = f": a model of family {owner!r} (use `mmtrain generate {owner}`)" if owner else ""
    expected = " or ".join(repr(t) for t in families[family].generation.hf_model_types)
    raise GenerationError(
        f"--checkpoint {p}: config.json model_type is {model_type!r}, not {family}'s {expected}{hint}"
    )


def _check_mcore_family(p: Path, family: str, iteration: Optional[int]) -> None:
    try:
        saved = load_model_config_dict(p, iteration)
    except FileNotFoundError as exc:
        raise GenerationError(f"--checkpoint {p}: {exc}") from None
    families = _families_with_generation()

    def holds(name: str) -> bool:
        """A saved model config is the whole dataclass of its family: the same keys, valid values
        (a subset of keys would parse as a family with more fields, filled with defaults)."""
        cls = families[name].model_config_cls
        if not isinstance(saved, dict) or set(saved) != {f.name for f in dataclasses.fields(cls) if f.init}:
            return False
        try:
            from_plain(cls, saved, MODEL_CONFIG)
        except RecipeError:
            return False
        return True

    if holds(family):
        return
    other = next((name for name in families if name != family and holds(name)), None)
    if other is not None:
        raise GenerationError(
            f"--checkpoint {p}: its {MODEL_CONFIG} holds a model of family {other!r}, not "
            f"{family!r} (use `mmtrain generate {other}`)"
        )
    try:
        from_plain(families[family].model_config_cls, saved, MODEL_CONFIG)
        problem = f"keys {sorted(saved) if isinstance(saved, dict) else saved}"
    except RecipeError as exc:
        problem = "; ".join(exc.errors[:3])
    raise GenerationError(f"--checkpoint {p}: its {MODEL_CONFIG} is not a {family} model ({problem})")


def asset_dir(ref: CheckpointRef, override: Optional[str], what: str, flag: str) -> Path:
    """The dir holding `what` (e.g. the tokenizer): `override` when given, else the checkpoint's
    side files; GenerationError saying which flag to pass otherwise."""
    if override is not None:
        d = Path(override)
        if not d.is_dir():
            raise GenerationError(f"--{flag} {d}: no such directory")
        return d
    if ref.assets is None:
        raise GenerationError(
            f"--checkpoint {ref.path} keeps no {what} (it was not converted from an HF dir); give --{flag} DIR"
        )
    return ref.assets
