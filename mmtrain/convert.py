"""HF <-> megatron checkpoint conversion for every family with an HF counterpart
(`FamilySpec.hf`; the families are those in mmtrain/registry.py). See docs/conversion.md.

  mmtrain convert hf-to-mcore --model FAMILY --src HF_DIR --dst CKPT_DIR [--tp N --pp N]
  mmtrain convert mcore-to-hf --model FAMILY --src CKPT_DIR --dst HF_DIR [--max-shard-gib G]

A family may also assemble its first weights from separate HF checkpoints, e.g. llava-ov:
  mmtrain convert hf-to-mcore --model llava-ov --llm QWEN2_DIR --vision SIGLIP_DIR --dst CKPT_DIR
        (stage-1 weights: SigLIP's last layer dropped, projector and image_newline fresh)
and take the HF parts it does not train from elsewhere on export, e.g. emu3 (whose VQ model a
converted checkpoint keeps, but a checkpoint trained from scratch lacks):
  mmtrain convert mcore-to-hf --model emu3 --src CKPT_DIR --dst HF_DIR --vq VQ_DIR --tokenizer TOK_DIR
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from mmdata.errors import UserError
from mmtrain import registry

HF_TO_MCORE = """Convert an HF (transformers) checkpoint into a megatron distributed checkpoint that
`checkpoint.load` starts from, in any TP/PP layout (megatron checkpoints are reshardable).

  mmtrain convert hf-to-mcore --model FAMILY --src HF_DIR --dst CKPT_DIR [--tp N --pp N] [--overwrite]

A non-empty CKPT_DIR is refused unless --overwrite, which replaces it whole at the end.
The format of HF_DIR is read from its config.json (llava-ov: transformers' LLaVA-OneVision or the
LLaVA-NeXT code's LlavaQwenForCausalLM, e.g. Aquila-VL-2B and its stage checkpoints).
The megatron weights keep the source's dtype (bf16 stays bf16) unless --dtype says otherwise.
"""
MCORE_TO_HF = """Convert a megatron checkpoint (a run's `checkpoints/` folder, one `iter_*` folder, or the
output of hf-to-mcore) into an HF (transformers) checkpoint: config, safetensors shards and index.

  mmtrain convert mcore-to-hf --model FAMILY --src CKPT_DIR --dst HF_DIR [--max-shard-gib G] [--format F] [--overwrite]

A non-empty HF_DIR is refused unless --overwrite, which replaces it whole at the end (no stale
shard of an earlier export stays behind).
--format chooses the HF layout where a family has several (llava-ov: transformers, the default,
or llava-next, the original LLaVA-NeXT code's LlavaQwenForCausalLM). The export keeps the dtype
the megatron weights are stored in (config.json's dtype says it) unless --dtype says otherwise.
"""


OVERWRITE_HELP = ("replace a non-empty --dst (refused without it): the new checkpoint is written next to it and "
                  "swapped in at the end, so a failure leaves the old one intact and no old file stays behind")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = {"hf-to-mcore": "dtype the megatron weights are stored in (default auto: the source's, e.g. bfloat16 for "
                             "the published checkpoints; recorded as the saved model config's params_dtype)",
              "mcore-to-hf": "dtype of the exported tensors and config.json (default auto: the dtype the megatron "
                             "weights are stored in: a converted checkpoint's source dtype, a training's precision)"}


def _formats() -> list[str]:
    """Every family's `export_formats`, in order, once."""
    return list(dict.fromkeys(f for n in registry.convertible_families() for f in registry.get_family(n).hf.export_formats))


def _flags(kind: str) -> dict[str, str]:
    """`--flag` -> help, over every family's `assemble_from` or `export_from`."""
    flags: dict[str, str] = {}
    for name in registry.convertible_families():
        for flag, help_text in getattr(registry.get_family(name).hf, kind).items():
            flags[flag] = f"{flags[flag]}; {help_text} [{name}]" if flag in flags else f"{help_text} [{name}]"
    return flags


def add_arguments(parser: argparse.ArgumentParser,
                  add_common: Callable[[argparse.ArgumentParser], None] = lambda p: None) -> None:
    """One sub-command per direction, each with its own options and help."""
    raw = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    families = registry.convertible_families()

    to_mcore = sub.add_parser("hf-to-mcore", help="HF checkpoint -> megatron checkpoint", description=HF_TO_MCORE,
                              formatter_class=raw)
    to_mcore.add_argument("--model", required=True, choices=families, help="model family")
    to_mcore.add_argument("--src", metavar="HF_DIR", help="HF checkpoint dir (config.json + *.safetensors)")
    to_mcore.add_argument("--dst", required=True, metavar="CKPT_DIR", help="megatron checkpoint dir to write")
    for flag, help_text in _flags("assemble_from").items():
        to_mcore.add_argument(f"--{flag}", metavar="DIR",
                              help=f"instead of --src, assemble from separate checkpoints: {help_text}")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel layout to write (default 1)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel layout to write (default 1)")
    to_mcore.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP["hf-to-mcore"])
    to_mcore.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    to_mcore.set_defaults(run=run)
    add_common(to_mcore)

    to_hf = sub.add_parser("mcore-to-hf", help="megatron checkpoint -> HF checkpoint", description=MCORE_TO_HF,
                           formatter_class=raw)
    to_hf.add_argument("--model", required=True, choices=families, help="model family")
    to_hf.add_argument("--src", required=True, metavar="CKPT_DIR",
                       help="megatron checkpoint: a run's checkpoints/ dir, an iter_* dir, or hf-to-mcore's output")
    to_hf.add_argument("--dst", required=True, metavar="HF_DIR", help="HF checkpoint dir to write")
    for flag, help_text in _flags("export_from").items():
        to_hf.add_argument(f"--{flag}", metavar="DIR", help=help_text)
    if _formats():
        to_hf.add_argument("--format", choices=_formats(), default=None,
                           help="HF checkpoint format to write (default: the family's first; llava-ov: transformers)")
    to_hf.add_argument("--max-shard-gib", type=float, default=2.0, metavar="G",
                       help="largest safetensors shard, in GiB (default 2)")
    to_hf.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP["mcore-to-hf"])
    to_hf.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    to_hf.set_defaults(run=run)
    add_common(to_hf)


def run(args: argparse.Namespace) -> int:
    from mmtrain.models.state_dict_adapter import ConversionError

    verbose = getattr(args, "verbose", False) or os.environ.get("MMTRAIN_VERBOSE") == "1"
    # our INFO lines; third-party loggers (megatron's "Using Megatron-FSDP ...") at WARNING unless --verbose
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mmtrain").setLevel(logging.INFO)
    if not verbose:
        _quiet_third_party()
    try:
        return _convert(args)
    except ConversionError as exc:  # a checkpoint that does not fit the family: told in one line
        raise UserError(str(exc)) from None


def _convert(args: argparse.Namespace) -> int:
    hf = registry.get_family(args.model).hf
    if args.direction == "hf-to-mcore":
        parts = {flag: getattr(args, flag) for flag in _flags("assemble_from") if getattr(args, flag, None) is not None}
        if bool(parts) == bool(args.src) or (parts and set(parts) != set(hf.assemble_from)):
            both = " ".join(f"--{f} DIR" for f in hf.assemble_from)
            raise UserError(f"hf-to-mcore --model {args.model}: give either --src HF_DIR"
                            + (f", or all of {both}" if both else ""))
        _check_sources({"--src": args.src} if args.src else {f"--{k}": v for k, v in parts.items()}, args.dst)
        if args.src:
            _check_hf_source(args.model, args.src)
        with _writing(args, [args.src] if args.src else list(parts.values())) as dst:
            if parts:
                hf.assemble(parts, str(dst), tp=args.tp, pp=args.pp, dtype=args.dtype)
            else:
                hf.to_mcore(args.src, str(dst), tp=args.tp, pp=args.pp, dtype=args.dtype)
        print(f"wrote megatron checkpoint {args.dst}")
    else:
        extras = {flag: getattr(args, flag) for flag in _flags("export_from") if getattr(args, flag, None) is not None}
        unknown = sorted(set(extras) - set(hf.export_from))
        if unknown:
            raise UserError(f"mcore-to-hf --model {args.model} takes no {' '.join('--' + f for f in unknown)}")
        if args.max_shard_gib <= 0:
            raise UserError(f"--max-shard-gib must be > 0, got {args.max_shard_gib}")
        fmt = getattr(args, "format", None)
        if fmt is not None and fmt not in hf.export_formats:  # the options first, then the folders
            raise UserError(f"mcore-to-hf --model {args.model} writes no --format {fmt}"
                            + (f" (it writes {', '.join(hf.export_formats)})" if hf.export_formats else ""))
        _check_sources({"--src": args.src, **{f"--{k}": v for k, v in extras.items()}}, args.dst)
        _check_megatron_source(args.model, args.src)
        if fmt is not None:
            extras["format"] = fmt
        sources = [args.src, *(v for k, v in extras.items() if k != "format")]
        with _writing(args, sources) as dst:
            hf.to_hf(args.src, str(dst), max_shard_bytes=int(args.max_shard_gib * 1024**3), dtype=args.dtype,
                     **extras)
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


def _quiet_third_party() -> None:
    """Hide the third-party warnings training hides (optional Transformer Engine / Apex absent,
    megatron deprecations), here and in the ranks a conversion spawns (they read the variable
    when they import mmtrain/runtime/hf_conversion.py, before megatron)."""
    from mmtrain.runtime.logs import quiet_third_party

    quiet_third_party()  # first: importing hf_conversion imports megatron
    from mmtrain.runtime.hf_conversion import QUIET_ENV

    os.environ[QUIET_ENV] = "1"


def _is_megatron_dir(path: Path) -> bool:
    """A megatron checkpoint: a `latest` file or iter_*/model folders, or one iter_* folder."""
    from mmtrain.runtime.checkpoint.layout import find_latest_iteration

    return find_latest_iteration(path) is not None or (path / "model").is_dir()


def _hf_owner(config: dict) -> str | None:
    """The family whose HF `model_type` this config.json has (GenerationSpec.hf_model_types)."""
    for name in registry.convertible_families():
        gen = registry.get_family(name).generation
        if gen is not None and config.get("model_type") in gen.hf_model_types:
            return name
    return None


def _check_hf_source(family: str, src: str) -> None:
    """hf-to-mcore --src is an HF checkpoint (not a megatron one) of `family`: refused in one line."""
    import json

    path = Path(src)
    if _is_megatron_dir(path):
        raise UserError(f"--src {src} is a megatron checkpoint, not an HF one; hf-to-mcore reads an HF dir "
                        f"(to export this one: mmtrain convert mcore-to-hf --model {family} --src {src} --dst HF_DIR)")
    if not (path / "config.json").is_file():
        raise UserError(f"--src {src} is not an HF checkpoint: it has no config.json")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise UserError(f"--src {src}/config.json is not valid JSON ({exc})") from None
    owner = _hf_owner(config)
    if owner is not None and owner != family:
        raise UserError(f"--src {src} is an HF {owner} checkpoint (model_type {config.get('model_type')!r}), "
                        f"not {family}; give --model {owner}")


def _megatron_config(path: Path) -> dict | None:
    """The saved model config (model_config.yaml) of a megatron checkpoint, None if unreadable."""
    import yaml

    from mmtrain.runtime.checkpoint.weights import MODEL_CONFIG, load_model_config_dict

    try:
        if (path / "model").is_dir() and (path / MODEL_CONFIG).is_file():
            return yaml.safe_load((path / MODEL_CONFIG).read_text())
        return load_model_config_dict(path)
    except (OSError, yaml.YAMLError):
        return None


def _megatron_owners(config: dict) -> list[str]:
    """The families whose model config this saved model config is: it names every field (a
    saved config is written whole; defaults would let a smaller config pass as a larger one)
    and validates."""
    import dataclasses

    from mmtrain.config.errors import RecipeError
    from mmtrain.config.typed import from_plain

    owners = []
    for name in registry.convertible_families():
        cls = registry.get_family(name).model_config_cls
        if not {f.name for f in dataclasses.fields(cls)} <= set(config):
            continue
        try:
            from_plain(cls, config, "model_config.yaml")
        except (RecipeError, TypeError, ValueError):
            continue
        owners.append(name)
    return owners


def _check_megatron_source(family: str, src: str) -> None:
    """mcore-to-hf --src is a megatron checkpoint (not an HF one) of `family`: refused in one line."""
    from mmtrain.runtime.hf_conversion import is_hf_dir

    path = Path(src)
    if is_hf_dir(path):
        raise UserError(f"--src {src} is an HF checkpoint (config.json), not a megatron one; mcore-to-hf reads a "
                        f"megatron checkpoint (to import this one: mmtrain convert hf-to-mcore --model {family} "
                        f"--src {src} --dst CKPT_DIR)")
    if not _is_megatron_dir(path):
        raise UserError(f"--src {src} is not a megatron checkpoint: no 'latest' file, no iter_*/model folder")
    config = _megatron_config(path)
    owners = _megatron_owners(config) if isinstance(config, dict) else []
    if owners and family not in owners:
        raise UserError(f"--src {src} is a megatron {' or '.join(owners)} checkpoint (its model_config.yaml), "
                        f"not {family}; give --model {owners[0]}")


@contextlib.contextmanager
def _writing(args: argparse.Namespace, sources: list[str]) -> Iterator[Path]:
    """The folder to write the checkpoint into, for --dst: one conversion per --dst at a time
    (mmdata/folder_lock.py); a non-empty --dst refused without --overwrite and replaced whole
    with it, never a source inside it."""
    from mmdata.folder_lock import FolderLock, fresh_folder

    dst = Path(args.dst).resolve()
    for src in sources:
        if Path(src).resolve().is_relative_to(dst):
            raise UserError(f"--dst {args.dst} holds the source {src}; write the checkpoint to another folder")
    with FolderLock(dst, "--dst"), fresh_folder(dst, args.overwrite, "--dst") as tmp:
        yield tmp
