"""Show one sample of a shard folder as the model will see it, in the spirit of `energon
preview`: its record, each image with its size and anyres tiling (drawn to a PNG with
--tiles-png), the conversation with the spans the loss applies to, and its token counts. The
numbers come from the functions `mmdata inspect` uses (the loader's anyres arithmetic and chat
template), so they are what training will count.

  mmdata preview DIR                     the first sample
  mmdata preview DIR --index 41          the 42nd sample (global position, shard order)
  mmdata preview DIR --key 0000000041    by shard key (or DIR#0000000041, the sample key metrics print), or by the
  record's original id
  mmdata preview DIR --tokenizer TOK     + text/loss tokens and the loss spans (⟦...⟧)
  mmdata preview DIR --tiles-png out.png the images with their anyres tile grid
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="shards directory (output of `mmdata preprocess`)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--index",
        type=int,
        default=None,
        metavar="N",
        help="the sample at this global position (0-based, shard order; default 0)",
    )
    which.add_argument(
        "--key",
        default=None,
        metavar="K",
        help="the sample with this shard key (e.g. 0000000041), sample key as metrics and "
        "worst-samples name it (DIR#0000000041), or original record id (an id needs a scan "
        "of the shards)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="local HF tokenizer folder: text and loss tokens, and the conversation with its loss spans marked",
    )
    parser.add_argument(
        "--tiles-png",
        type=Path,
        default=None,
        metavar="OUT",
        help="write the sample's images with the anyres tile grid to this PNG",
    )


def run(args: argparse.Namespace) -> int:
    from mmdata.inspect import preview  # CLI dispatch: reading samples loads energon and torch

    return preview.run(args)
