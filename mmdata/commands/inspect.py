"""Summarise a shards directory before spending GPU-days on it: sample and shard counts,
sources, quarantine reasons, modality mix, image sizes, anyres tiles and image tokens, text
tokens, turns, languages and packing efficiency, from the manifest plus a bounded, seeded
random sample of the shards (`--all` reads everything). See docs/inspect.md; one sample in
detail: `mmdata preview`.

  mmdata inspect DIR [--tokenizer TOK] [--json] [--sample N | --all] [--cp N --tp N]
                     [--dp N --micro-batch-size N --global-batch-size N]
  mmdata inspect DIR --key K [--tokenizer TOK]     one sample, as `mmdata preview DIR --key K`
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="shards directory (output of `mmdata preprocess`)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="TOK",
        help="local HF tokenizer folder: enables text/loss/total tokens and packing efficiency",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (keys: docs/inspect.md)")
    parser.add_argument("--sample", type=int, default=1000, help="random samples to read (default 1000)")
    parser.add_argument("--all", action="store_true", help="read every sample instead of a random sample")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random sample (default 0)")
    parser.add_argument(
        "--context-lengths",
        type=str,
        default="4096,8192,16384,32768",
        help="comma-separated context lengths for the packing estimate",
    )
    for name, what in (("cp", "context"), ("tp", "tensor")):
        parser.add_argument(
            f"--{name}",
            type=int,
            default=1,
            metavar="N",
            help=f"{what} parallel size the packing report (bin fill, executed-token efficiency) "
            "counts CP padding for (default 1)",
        )
    for name, what, default in (
        ("dp", "data-parallel ranks", 8),
        ("micro_batch_size", "rows per micro-batch", 2),
        ("global_batch_size", "rows per step, all ranks", 32),
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=default,
            metavar="N",
            help=f"the step shape the vision balance simulates: {what} (default {default})",
        )
    parser.add_argument(
        "--key",
        default=None,
        metavar="K",
        help="show this one sample instead of the summary, as `mmdata preview DIR --key K`: a sample "
        "key from metrics / worst-samples (DIR#0000000041), a shard key or a record id",
    )


def run(args: argparse.Namespace) -> int:
    from mmdata.inspect import run as inspect_run  # CLI dispatch: reading samples loads energon and torch

    return inspect_run(args)
