"""`mmtrain` console script.

  mmtrain llava-ov RECIPE [a.b=c ...]   train (or dry_run / auto_tune) a LLaVA-OneVision model
  mmtrain emu3 RECIPE [a.b=c ...]       train an Emu3 model
  mmtrain convert ...                   HF <-> megatron checkpoint conversion
  mmtrain worst-samples RUN_DIR ...     ids of the highest-loss samples of a step
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "llava-ov": ("mmtrain.launch", "train a LLaVA-OneVision model from a YAML recipe"),
    "emu3": ("mmtrain.launch", "train an Emu3 model from a YAML recipe"),
    "convert": ("mmtrain.convert", "convert checkpoints between HF and megatron formats"),
    "worst-samples": ("mmtrain.metrics", "print the ids of the worst samples of a step"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmtrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:  # a family not built yet
            if err.name and err.name.startswith("mmtrain"):
                continue
            raise
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(p, name)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
