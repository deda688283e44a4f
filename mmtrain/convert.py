"""HF <-> megatron checkpoint conversion for every family with an HF counterpart
(`FamilySpec.hf`; the families are those in mmtrain/registry.py).

  mmtrain convert hf-to-mcore --model FAMILY --src HF_DIR --dst CKPT_DIR [--tp N --pp N]
  mmtrain convert mcore-to-hf --model FAMILY --src CKPT_DIR --dst HF_DIR [--max-shard-gb G]

A family may also assemble its first weights from separate HF checkpoints, e.g. llava-ov:
  mmtrain convert hf-to-mcore --model llava-ov --llm QWEN2_DIR --vision SIGLIP_DIR --dst CKPT_DIR
        (stage-1 weights: SigLIP's last layer dropped, projector and image_newline fresh)
and take the HF parts it does not train from elsewhere on export, e.g. emu3 (whose VQ model a
converted checkpoint keeps, but a checkpoint trained from scratch lacks):
  mmtrain convert mcore-to-hf --model emu3 --src CKPT_DIR --dst HF_DIR --vq VQ_DIR --tokenizer TOK_DIR
"""

from __future__ import annotations

import argparse
import logging
import sys

from mmtrain import registry


def _flags(kind: str) -> dict[str, str]:
    """`--flag` -> help, over every family's `assemble_from` or `export_from`."""
    flags: dict[str, str] = {}
    for name in registry.convertible_families():
        for flag, help_text in getattr(registry.get_family(name).hf, kind).items():
            flags[flag] = f"{flags[flag]}; {help_text} [{name}]" if flag in flags else f"{help_text} [{name}]"
    return flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    parser.add_argument("--model", required=True, choices=registry.convertible_families(), help="model family")
    parser.add_argument("--src", help="HF dir (hf-to-mcore) or megatron checkpoint dir (mcore-to-hf)")
    parser.add_argument("--dst", required=True)
    for flag, help_text in _flags("assemble_from").items():
        parser.add_argument(f"--{flag}", help=f"hf-to-mcore: assemble from separate checkpoints: {help_text}")
    for flag, help_text in _flags("export_from").items():
        parser.add_argument(f"--{flag}", help=f"mcore-to-hf: {help_text}")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel layout to convert in (checkpoint is reshardable)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel layout to convert in")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="mcore-to-hf: max safetensors shard size")


def run(args: argparse.Namespace) -> int:
    from mmtrain.models.state_dict_adapter import ConversionError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _convert(args)
    except (ConversionError, FileNotFoundError) as exc:  # bad input: told in one line
        return _usage_error(str(exc))


def _convert(args: argparse.Namespace) -> int:
    hf = registry.get_family(args.model).hf
    parts = {flag: getattr(args, flag) for flag in _flags("assemble_from") if getattr(args, flag) is not None}
    extras = {flag: getattr(args, flag) for flag in _flags("export_from") if getattr(args, flag) is not None}
    if args.direction == "hf-to-mcore" and extras:
        return _usage_error(f"{' '.join('--' + f for f in extras)}: for mcore-to-hf only")
    if args.direction == "hf-to-mcore":
        if bool(parts) == bool(args.src) or (parts and set(parts) != set(hf.assemble_from)):
            both = " ".join(f"--{f} DIR" for f in hf.assemble_from)
            return _usage_error(f"hf-to-mcore --model {args.model}: give either --src HF_DIR"
                                + (f", or all of {both}" if both else ""))
        if parts:
            hf.assemble(parts, args.dst, tp=args.tp, pp=args.pp)
        else:
            hf.to_mcore(args.src, args.dst, tp=args.tp, pp=args.pp)
        print(f"wrote megatron checkpoint {args.dst}")
    else:
        if parts or not args.src:
            return _usage_error("mcore-to-hf: give --src CKPT_DIR (and no assembly sources)")
        unknown = sorted(set(extras) - set(hf.export_from))
        if unknown:
            return _usage_error(f"mcore-to-hf --model {args.model} takes no {' '.join('--' + f for f in unknown)}")
        out = hf.to_hf(args.src, args.dst, max_shard_bytes=int(args.max_shard_gb * 1024**3), **extras)
        print(f"wrote HF checkpoint {out}")
    return 0


def _usage_error(message: str) -> int:
    print(f"mmtrain convert: {message}", file=sys.stderr)
    return 2
