"""mmtrain: train multimodal model families on megatron-core from YAML recipes.

  mmtrain FAMILY RECIPE [a.b=c ...]     train, dry-run, auto-tune or print the resolved recipe of
                                        a model family (the families: mmtrain/registry.py)
  mmtrain convert hf-to-mcore ...       HF -> megatron checkpoint
  mmtrain convert mcore-to-hf ...       megatron -> HF checkpoint
  mmtrain generate FAMILY ...           generate from a checkpoint (Emu3 images with batched
                                        guidance, LLaVA-OV answers)
  mmtrain worst-samples RUN_DIR ...     the highest-loss samples of a training step
  mmtrain pack-plan RECIPE [DIR] ...    the packing plan a recipe trains with (data.packing: plan)

`mmtrain COMMAND --help` describes each command and its options; docs/ has the how-tos.
Exit status: 0 done; 2 an expected problem (an invalid recipe, a missing path, a checkpoint of
another model), said in one line before anything is written; 130 interrupted (Ctrl-C); 1 an
unexpected error, whose traceback goes to a log file named on stderr (--verbose prints it).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import mmtrain
from mmdata.errors import HintingParser, add_common_options, run_main
from mmtrain import convert, pack_plan_cli, registry
from mmtrain.generation import cli as generation_cli
from mmtrain.runtime import launch, metrics

RAW = argparse.RawDescriptionHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    parser = HintingParser(prog="mmtrain", description=__doc__, formatter_class=RAW)
    add_common_options(parser, version=mmtrain.__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for spec in registry.FAMILIES.values():
        p = sub.add_parser(spec.name, help=f"train {spec.help} from a YAML recipe",
                           description=launch.__doc__.replace("FAMILY", spec.name).strip(), formatter_class=RAW)
        launch.add_arguments(p)
        add_common_options(p)
        p.set_defaults(run=functools.partial(launch.run, family=spec.name))
    p = sub.add_parser("convert", help="convert checkpoints between HF and megatron formats",
                       description=(convert.__doc__ or "").strip(), formatter_class=RAW)
    convert.add_arguments(p, add_common_options)
    p = sub.add_parser("generate", help="generate from a checkpoint: Emu3 images (batched CFG), LLaVA-OV answers",
                       description=generation_cli.GENERATE_HELP, formatter_class=RAW)
    generation_cli.add_arguments(p, add_common_options)
    p = sub.add_parser("worst-samples", help="print the samples of a training step ranked by their loss",
                       description=metrics.WORST_SAMPLES_HELP, formatter_class=RAW)
    metrics.add_arguments(p)
    add_common_options(p)
    p.set_defaults(run=metrics.run)
    p = sub.add_parser("pack-plan", help=pack_plan_cli.HELP, description=pack_plan_cli.__doc__, formatter_class=RAW)
    pack_plan_cli.add_arguments(p)
    add_common_options(p)
    p.set_defaults(run=pack_plan_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network at run time: local paths never reach the hub
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):  # `RECIPE --print-config a.b=c`: overrides after an option too
        args.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
        extra = [x for x in extra if x not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    prog = " ".join(["mmtrain", args.command] + [getattr(args, sub) for sub in ("direction", "family")
                                                  if getattr(args, sub, None)])
    return run_main(prog, args, args.run)


if __name__ == "__main__":
    sys.exit(main())
