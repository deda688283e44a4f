"""mmdata: multimodal instruction data -> energon-ready shards, and a look inside them.

  mmdata synth ...            a small synthetic dataset in a real on-disk layout
  mmdata preprocess ...       raw records -> energon-ready shards (Ray job, resumable)
  mmdata pack-plan DIR ...    a global packing plan from a shard folder's length index
  mmdata inspect DIR          what a shard folder holds (tables or JSON)
  mmdata preview DIR ...      one sample as the model sees it
  mmdata tokenize-images ...  shard images -> Emu3 VQ token shards (Ray job, resumable)
  mmdata tiny-tokenizer ...   the tiny offline Qwen2-style (or Emu3) tokenizer of the demo and tests
  mmdata tiny-vq ...          a tiny random Emu3 VQ model for the demo and the tests

`mmdata COMMAND --help` describes each command and its options; docs/ has the how-tos.
Exit status: 0 done; 2 an expected problem (a bad option, a missing path, an output folder of
another job), said in one line before anything is written; 130 interrupted (Ctrl-C: a Ray job
resumes when rerun); 1 an unexpected error, whose traceback goes to a log file named on stderr
(--verbose prints it).
"""

# One subcommand per module; each exposes `add_arguments(parser)` and `run(args) -> int`, and
# the error policy (mmdata/errors.py) is applied here, once.

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import mmdata
from mmdata.errors import HintingParser, add_common_options, run_main
from mmdata.units import plural

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "synth": ("mmdata.dev.synth", "write a small synthetic dataset in a real on-disk layout"),
    "preprocess": ("mmdata.preprocess.cli", "Ray job: validate, globally shuffle and write energon-ready shards"),
    "pack-plan": ("mmdata.packing.cli", "a deterministic global packing plan from a shards directory's length index"),
    "inspect": ("mmdata.commands.inspect", "summarise a shards directory (manifest + a bounded sample)"),
    "preview": ("mmdata.commands.preview", "show one sample as the model sees it: images, tiles, chat, tokens, loss"),
    "tiny-tokenizer": (
        "mmdata.dev.tiny_tokenizer",
        "train the tiny offline Qwen2-style (or --family emu3) tokenizer used by the demo and the tests",
    ),
    "tokenize-images": ("mmdata.vision_tokens.cli", "Ray job: turn shard images into Emu3 VQ token grids"),
    "tiny-vq": ("mmdata.dev.tiny_vq", "write a tiny random Emu3 VQ model for the demo and the tests"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = HintingParser(prog="mmdata", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_options(parser, version=mmdata.__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        add_common_options(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network at run time: local paths never reach the hub
    args = build_parser().parse_args(argv)
    return run_main(f"mmdata {args.command}", args, args._module.run)


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    """Where a Ray job runs: --address (a cluster) or --num-cpus (the private local instance)."""
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: RAY_ADDRESS if set, else a private local instance)",
    )
    parser.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs for the local Ray instance (default: all; at least 1)"
    )


def run_alone(command: str, argv: list[str] | None = None) -> int:
    """`python -m` on a subcommand's module: that subcommand alone (tests and scripts use it)."""
    return main([command, *(sys.argv[1:] if argv is None else argv)])


def job_summary(output: Path, manifest: dict, media: str = "", curated: str = "") -> str:
    """The closing line of a shard-writing job: what it wrote where, and what it set aside."""
    c = manifest["counts"]
    return (
        f"{output.resolve()}: {plural(c['written'], 'sample')}{media} in {plural(len(manifest['shards']), 'shard')}, "
        f"{c['quarantined']:,} quarantined{curated} (of {c['read']:,} read)"
    )


if __name__ == "__main__":
    sys.exit(main())
