"""What `mmtrain generate FAMILY` runs once its options are parsed (mmtrain/generate_cli.py):
sampling options checked, the checkpoint resolved and checked to be the family's, the family's job
prepared (`GenerationSpec.prepare`), the engine run with a progress display, outputs written."""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mmtrain import registry
from mmtrain.generation.checkpoint import GenerationError, Placement, resolve_checkpoint
from mmtrain.generation.engine import generate
from mmtrain.generation.sampling import SamplingParams
from mmtrain.runtime.logs import quiet_third_party


def run(args: argparse.Namespace) -> int:
    """`args.family`: the generate subcommand (a registry family with a `generation` entry)."""
    family = args.family
    if not getattr(args, "verbose", False):  # megatron's and torch's warnings about optional packages
        quiet_third_party()
    spec = registry.get_family(family).generation
    try:
        sampling = SamplingParams(0.0 if args.greedy else args.temperature, args.top_k, args.top_p)
    except ValueError as exc:
        raise GenerationError(str(exc)) from None
    if args.batch_size < 1:
        raise GenerationError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    placement = Placement.resolve(args.device, args.dtype)
    ref = resolve_checkpoint(args.checkpoint, family, args.iteration)
    job = spec.prepare(args, ref, placement)
    with GenerationProgress(not args.no_progress, len(job.requests), job.unit) as progress:
        results = generate(job.model, job.requests, sampling, batch_size=args.batch_size, progress=progress)
    job.finish(results)
    return 0


class GenerationProgress:
    """Generated tokens against the upper bound, tokens/s, on stderr (rich)."""

    def __init__(self, enabled: bool, requests: int, unit: str) -> None:
        self.progress = Progress(
            TextColumn(f"[bold]generating {requests} {unit}{'s' if requests != 1 else ''}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens {task.fields[rate]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self.task = self.progress.add_task("generate", total=None, rate="")
        self.t0 = time.perf_counter()

    def __enter__(self) -> "GenerationProgress":
        self.progress.__enter__()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, done: int, total: int) -> None:
        rate = done / max(1e-9, time.perf_counter() - self.t0)
        self.progress.update(self.task, completed=done, total=total, rate=f"({rate:,.0f}/s)")
