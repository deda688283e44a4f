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
import json
import sys
from pathlib import Path

from rich.console import Console

from mmdata.packing.balance import StepShape
from mmdata.errors import UserError
from mmdata.inspect import preview
from mmdata.inspect.render import summary_tables
from mmdata.inspect.stats import summarize
from mmdata.inspect.tokens import is_token_dataset, summarize_tokens, token_summary_tables
from mmdata.inspect.dataset import (  # noqa: F401 - public API
    Dataset,
    QuarantineRecord,
    ShardSample,
    find_sample,
    iter_samples,
    load_quarantine,
    open_dataset,
    random_samples,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="shards directory (output of `mmdata preprocess`)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="TOK",
                        help="local HF tokenizer folder: enables text/loss/total tokens and packing efficiency")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (keys: docs/inspect.md)")
    parser.add_argument("--sample", type=int, default=1000, help="random samples to read (default 1000)")
    parser.add_argument("--all", action="store_true", help="read every sample instead of a random sample")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random sample (default 0)")
    parser.add_argument("--context-lengths", type=str, default="4096,8192,16384,32768",
                        help="comma-separated context lengths for the packing estimate")
    for name, what in (("cp", "context"), ("tp", "tensor")):
        parser.add_argument(f"--{name}", type=int, default=1, metavar="N",
                            help=f"{what} parallel size the packing report (bin fill, executed-token efficiency) "
                                 "counts CP padding for (default 1)")
    for name, what, default in (("dp", "data-parallel ranks", 8), ("micro_batch_size", "rows per micro-batch", 2),
                                ("global_batch_size", "rows per step, all ranks", 32)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, metavar="N",
                            help=f"the step shape the vision balance simulates: {what} (default {default})")
    parser.add_argument("--key", default=None, metavar="K",
                        help="show this one sample instead of the summary, as `mmdata preview DIR --key K`: a sample "
                             "key from metrics / worst-samples (DIR#0000000041), a shard key or a record id")


def run(args: argparse.Namespace) -> int:
    if args.key is not None:  # one sample: the preview's view (found in one seek by key)
        return preview.run(argparse.Namespace(dir=args.dir, key=args.key, index=None, tokenizer=args.tokenizer,
                                              tiles_png=None))
    if args.sample < 1:
        raise UserError(f"--sample must be >= 1, got {args.sample}")
    for name in ("cp", "tp"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    try:
        shape = StepShape(args.dp, args.micro_batch_size, args.global_batch_size)
    except ValueError as e:
        raise UserError(f"--dp/--micro-batch-size/--global-batch-size: {e}") from None
    try:
        lengths = tuple(int(x) for x in args.context_lengths.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--context-lengths must be comma-separated integers, got {args.context_lengths!r}") from None
    if not lengths or min(lengths) <= 0:
        raise UserError(f"--context-lengths must list positive integers, got {args.context_lengths!r}")
    if is_token_dataset(args.dir):
        return _inspect_tokens(args)
    summary = summarize(args.dir, sample=args.sample, seed=args.seed, all=args.all,
                        tokenizer=args.tokenizer, context_lengths=lengths, cp=args.cp, tp=args.tp, step_shape=shape)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2, ensure_ascii=False))
    else:
        console = Console(width=None if sys.stdout.isatty() else 110)  # pipes/logs: wide enough for the tables
        for table in summary_tables(summary):
            console.print(table)
    return 0


def _inspect_tokens(args: argparse.Namespace) -> int:
    """Emu3 VQ token shards: a summary of their grids (mmdata/inspect/tokens.py), not images."""
    if args.tokenizer is not None:
        print(f"note: {args.dir} holds Emu3 VQ token shards; --tokenizer (text tokens, packing) is not used for them",
              file=sys.stderr)
    ds = open_dataset(args.dir)
    samples = list(iter_samples(ds)) if args.all else random_samples(ds, args.sample, args.seed)
    summary = summarize_tokens(ds, samples, seed=args.seed, sampled_all=args.all or len(samples) >= ds.total_samples)
    if args.json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 110)
    for table in token_summary_tables(summary):
        console.print(table)
    return 0
