"""`mmdata` console script: one subcommand per module, imported lazily so `--help` is fast.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "synth": ("mmdata.preprocess.synth", "write a small synthetic dataset in a real on-disk layout"),
    "preprocess": ("mmdata.preprocess.cli", "Ray job: validate, globally shuffle and write energon-ready shards"),
    "pack-plan": ("mmdata.preprocess.pack_plan", "a deterministic global packing plan from a shards directory's length index"),
    "inspect": ("mmdata.inspect", "summarise a shards directory (manifest + a bounded sample)"),
    "tiny-tokenizer": (
        "mmdata.energon_loaders.tiny_tokenizer",
        "train the tiny offline Qwen2-style (or --family emu3) tokenizer used by the demo and the tests",
    ),
    "tokenize-images": ("mmdata.vision_tokens.cli", "Ray job: turn shard images into Emu3 VQ token grids"),
    "tiny-vq": ("mmdata.vision_tokens.tiny_vq", "write a tiny random Emu3 VQ model for the demo and the tests"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmdata", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
