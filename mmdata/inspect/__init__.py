"""Summarise a shards directory (`mmdata inspect`; the command line: mmdata/commands/inspect.py,
the sections: docs/inspect.md), and the sample-reading API the notebook uses."""

from __future__ import annotations

import argparse
import json
import sys

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


def run(args: argparse.Namespace) -> int:
    if args.key is not None:  # one sample: the preview's view (found in one seek by key)
        return preview.run(
            argparse.Namespace(dir=args.dir, key=args.key, index=None, tokenizer=args.tokenizer, tiles_png=None)
        )
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
    summary = summarize(
        args.dir,
        sample=args.sample,
        seed=args.seed,
        all=args.all,
        tokenizer=args.tokenizer,
        context_lengths=lengths,
        cp=args.cp,
        tp=args.tp,
        step_shape=shape,
    )
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
        print(
            f"note: {args.dir} holds Emu3 VQ token shards; --tokenizer (text tokens, packing) is not used for them",
            file=sys.stderr,
        )
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
