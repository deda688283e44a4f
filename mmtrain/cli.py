"""`mmtrain` console script.

  mmtrain FAMILY RECIPE [a.b=c ...]     train (or dry_run / auto_tune) a model family; the
                                        families are those in mmtrain/registry.py
  mmtrain convert ...                   HF <-> megatron checkpoint conversion
  mmtrain generate FAMILY ...           generate from a checkpoint (Emu3 images, LLaVA-OV answers)
  mmtrain worst-samples RUN_DIR ...     ids of the highest-loss samples of a step
"""

from __future__ import annotations

import argparse
import functools
import sys

from mmtrain import convert, registry
from mmtrain.generation import cli as generation_cli
from mmtrain.runtime import launch, metrics


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmtrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for spec in registry.FAMILIES.values():
        p = sub.add_parser(spec.name, help=f"train {spec.help} from a YAML recipe",
                           description=(launch.__doc__ or "").strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        launch.add_arguments(p)
        p.set_defaults(run=functools.partial(launch.run, family=spec.name))
    p = sub.add_parser("convert", help="convert checkpoints between HF and megatron formats",
                       description=(convert.__doc__ or "").strip(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    convert.add_arguments(p)
    p.set_defaults(run=convert.run)
    p = sub.add_parser("generate", help="generate from a checkpoint: Emu3 images (batched CFG), LLaVA-OV answers",
                       description=(generation_cli.__doc__ or "").strip(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    generation_cli.add_arguments(p)
    p = sub.add_parser("worst-samples", help="print the ids of the worst samples of a step",
                       description=(metrics.__doc__ or "").strip(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    metrics.add_arguments(p)
    p.set_defaults(run=metrics.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
