"""What `mmtrain convert` does (its parser: mmtrain/convert.py, which the CLI imports at start-up and
so stays free of torch and megatron): check the sources and --dst, then run the family's
conversion into a fresh folder."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from mmdata.errors import InterruptsAfterCompletion, UserError
from mmdata.folder_lock import FolderLock, fresh_folder
from mmtrain import registry
from mmtrain.config.errors import RecipeError
from mmtrain.config.typed import from_plain
from mmtrain.models.state_dict_adapter import ConversionError
from mmtrain.runtime.checkpoint.layout import find_latest_iteration
from mmtrain.runtime.checkpoint.weights import MODEL_CONFIG, load_model_config_dict
from mmtrain.runtime.hf_conversion import QUIET_ENV, is_hf_dir
from mmtrain.spec import FamilySpec


def convert(args: argparse.Namespace, quiet: bool) -> int:
    """The conversion `args` ask for; `quiet`: the ranks it spawns hide third-party warnings too."""
    if quiet:
        os.environ[QUIET_ENV] = "1"  # read when a rank imports mmtrain/runtime/hf_conversion.py, before megatron
    try:
        return _convert(args)
    except ConversionError as exc:  # a checkpoint that does not fit the family: told in one line
        raise UserError(str(exc)) from None


def _convert(args: argparse.Namespace) -> int:
    hf = registry.get_family(args.model).hf
    if args.direction == "hf-to-mcore":
        parts = {
            flag: getattr(args, flag)
            for flag in registry.hf_flags("assemble_from")
            if getattr(args, flag, None) is not None
        }
        if bool(parts) == bool(args.src) or (parts and set(parts) != set(hf.assemble_from)):
            both = " ".join(f"--{f} DIR" for f in hf.assemble_from)
            raise UserError(
                f"hf-to-mcore --model {args.model}: give either --src HF_DIR" + (f", or all of {both}" if both else "")
            )
        _check_sources({"--src": args.src} if args.src else {f"--{k}": v for k, v in parts.items()}, args.dst)
        if args.src:
            _check_hf_source(args.model, args.src)
        with _finished(args) as done:
            with _writing(args, [args.src] if args.src else list(parts.values())) as dst:
                if parts:
                    hf.assemble(parts, str(dst), tp=args.tp, pp=args.pp, dtype=args.dtype)
                else:
                    hf.to_mcore(args.src, str(dst), tp=args.tp, pp=args.pp, dtype=args.dtype)
                done.hold()  # complete: what follows only puts it in place
            print(f"wrote megatron checkpoint {args.dst}")
    else:
        extras = {
            flag: getattr(args, flag)
            for flag in registry.hf_flags("export_from")
            if getattr(args, flag, None) is not None
        }
        unknown = sorted(set(extras) - set(hf.export_from))
        if unknown:
            raise UserError(f"mcore-to-hf --model {args.model} takes no {' '.join('--' + f for f in unknown)}")
        if args.max_shard_gib <= 0:
            raise UserError(f"--max-shard-gib must be > 0, got {args.max_shard_gib}")
        fmt = getattr(args, "format", None)
        if fmt is not None and fmt not in hf.export_formats:  # the options first, then the folders
            raise UserError(
                f"mcore-to-hf --model {args.model} writes no --format {fmt}"
                + (f" (it writes {', '.join(hf.export_formats)})" if hf.export_formats else "")
            )
        _check_sources({"--src": args.src, **{f"--{k}": v for k, v in extras.items()}}, args.dst)
        _check_megatron_source(args.model, args.src)
        if fmt is not None:
            extras["format"] = fmt
        sources = [args.src, *(v for k, v in extras.items() if k != "format")]
        with _finished(args) as done:
            with _writing(args, sources) as dst:
                hf.to_hf(
                    args.src, str(dst), max_shard_bytes=int(args.max_shard_gib * 1024**3), dtype=args.dtype, **extras
                )
                done.hold()  # complete: what follows only puts it in place
            print(f"wrote HF checkpoint {Path(args.dst).resolve()}")
    return 0


def _check_sources(sources: dict[str, str], dst: str) -> None:
    """Every source is an existing local folder and --dst is not a file: before any work."""
    for flag, path in sources.items():
        if not Path(path).is_dir():
            what = "is a file, not a checkpoint folder" if Path(path).exists() else "does not exist"
            raise UserError(f"{flag} {path} {what}")
    if Path(dst).exists() and not Path(dst).is_dir():
        raise UserError(f"--dst {dst} is a file; give a folder to write the checkpoint into")


def _is_megatron_dir(path: Path) -> bool:
    """A megatron checkpoint: a `latest` file or iter_*/model folders, or one iter_* folder."""
    return find_latest_iteration(path) is not None or (path / "model").is_dir()


def _families_where(test: Callable[[FamilySpec], bool]) -> list[str]:
    """The convertible families whose spec passes `test`, in registry order."""
    return [name for name in registry.convertible_families() if test(registry.get_family(name))]


def _hf_owner(config: dict) -> str | None:
    """The family whose HF `model_type` this config.json has (GenerationSpec.hf_model_types)."""
    owners = _families_where(
        lambda spec: spec.generation is not None and config.get("model_type") in spec.generation.hf_model_types
    )
    return owners[0] if owners else None


def _check_hf_source(family: str, src: str) -> None:
    """hf-to-mcore --src is an HF checkpoint (not a megatron one) of `family`: refused in one line."""
    path = Path(src)
    if _is_megatron_dir(path):
        raise UserError(
            f"--src {src} is a megatron checkpoint, not an HF one; hf-to-mcore reads an HF dir "
            f"(to export this one: mmtrain convert mcore-to-hf --model {family} --src {src} --dst HF_DIR)"
        )
    if not (path / "config.json").is_file():
        raise UserError(f"--src {src} is not an HF checkpoint: it has no config.json")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise UserError(f"--src {src}/config.json is not valid JSON ({exc})") from None
    owner = _hf_owner(config)
    if owner is not None and owner != family:
        raise UserError(
            f"--src {src} is an HF {owner} checkpoint (model_type {config.get('model_type')!r}), "
            f"not {family}; give --model {owner}"
        )


def _megatron_config(path: Path) -> dict | None:
    """The saved model config (model_config.yaml) of a megatron checkpoint, None if unreadable."""
    try:
        if (path / "model").is_dir() and (path / MODEL_CONFIG).is_file():
            return yaml.safe_load((path / MODEL_CONFIG).read_text())
        return load_model_config_dict(path)
    except (OSError, yaml.YAMLError):
        return None


def _megatron_owners(config: dict) -> list[str]:
    """The families whose model config this saved model config is (`_is_model_config`)."""
    return _families_where(lambda spec: _is_model_config(spec.model_config_cls, config))


def _is_model_config(cls: type, config: dict) -> bool:
    """`config` names every field of `cls` (a saved config is written whole; defaults would let a
    smaller config pass as a larger one) and validates as one."""
    if not {f.name for f in dataclasses.fields(cls)} <= set(config):
        return False
    try:
        from_plain(cls, config, "model_config.yaml")
    except (RecipeError, TypeError, ValueError):
        return False
    return True


def _check_megatron_source(family: str, src: str) -> None:
    """mcore-to-hf --src is a megatron checkpoint (not an HF one) of `family`: refused in one line."""
    path = Path(src)
    if is_hf_dir(path):
        raise UserError(
            f"--src {src} is an HF checkpoint (config.json), not a megatron one; mcore-to-hf reads a "
            f"megatron checkpoint (to import this one: mmtrain convert hf-to-mcore --model {family} "
            f"--src {src} --dst CKPT_DIR)"
        )
    if not _is_megatron_dir(path):
        raise UserError(f"--src {src} is not a megatron checkpoint: no 'latest' file, no iter_*/model folder")
    config = _megatron_config(path)
    owners = _megatron_owners(config) if isinstance(config, dict) else []
    if owners and family not in owners:
        raise UserError(
            f"--src {src} is a megatron {' or '.join(owners)} checkpoint (its model_config.yaml), "
            f"not {family}; give --model {owners[0]}"
        )


def _finished(args: argparse.Namespace) -> InterruptsAfterCompletion:
    """Once the conversion has written everything, a Ctrl-C while --dst is put in place (the old
    folder removed, with --overwrite) or the lock released no longer makes it exit 130: the
    checkpoint is complete, and the command says so and exits 0 (mmdata/errors.py)."""
    return InterruptsAfterCompletion(f"mmtrain convert {args.direction}", f"--dst {args.dst}")


@contextlib.contextmanager
def _writing(args: argparse.Namespace, sources: list[str]) -> Iterator[Path]:
    """The folder to write the checkpoint into, for --dst: one conversion per --dst at a time
    (mmdata/folder_lock.py); a non-empty --dst refused without --overwrite and replaced whole
    with it, never a source inside it."""
    dst = Path(args.dst).resolve()
    for src in sources:
        if Path(src).resolve().is_relative_to(dst):
            raise UserError(f"--dst {args.dst} holds the source {src}; write the checkpoint to another folder")
    with FolderLock(dst, "--dst"), fresh_folder(dst, args.overwrite, "--dst") as tmp:
        yield tmp
