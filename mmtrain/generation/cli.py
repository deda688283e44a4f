"""`mmtrain generate FAMILY --checkpoint CKPT ...`: generate with a trained or converted model.
The parser is built from the registry (families with a `generation` entry); the engine is
mmtrain/generation/engine.py. See docs/generation.md."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

from mmtrain import registry

#: shared by every `mmtrain generate` help page
CHECKPOINTS_AND_EXIT = """CKPT is a megatron checkpoint dir written by mmtrain (converted, or a training run's
`checkpoints/`, or the run dir itself) saved at any TP/PP (it is loaded resharded into this one
process), or an HF model dir. Greedy decoding or seeded sampling: the same command and seed give
the same output.

Exit status: 0 done; 2 an expected problem (a missing path, a checkpoint of another family, a
missing VQ model or tokenizer, a bad option), said in one line before anything is written; 130
interrupted; 1 an unexpected error (its traceback in a log file, or on stderr with --verbose).
"""

GENERATE_HELP = """Generate with a trained or converted model: Emu3 images (classifier-free guidance with the
conditional and unconditional rows in one batch), LLaVA-OV answers about images.

  mmtrain generate emu3 --checkpoint CKPT --prompt TEXT [--negative-prompt TEXT] --cfg-scale 3.0
                        --height 512 --width 512 --seed S --output out.png
  mmtrain generate emu3 --checkpoint CKPT --prompts prompts.txt --output DIR
  mmtrain generate llava-ov --checkpoint CKPT --image IMG --prompt TEXT [--max-new-tokens N]

`mmtrain generate FAMILY --help` lists each family's own options.
""" + "\n" + CHECKPOINTS_AND_EXIT


def add_arguments(parser: argparse.ArgumentParser,
                  add_common: Callable[[argparse.ArgumentParser], None] = lambda p: None) -> None:
    """One sub-command per family that can generate, each with the shared and its own options."""
    sub = parser.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for spec in registry.FAMILIES.values():
        gen = spec.generation
        if gen is None:
            continue
        description = f"{spec.name}: {gen.help}.\n\n{gen.usage.strip(chr(10))}\n\n{CHECKPOINTS_AND_EXIT}"
        p = sub.add_parser(spec.name, help=gen.help, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _shared_arguments(p, gen.sampling_defaults)
        gen.add_arguments(p)
        add_common(p)
        p.set_defaults(run=functools.partial(run, family=spec.name))


def _shared_arguments(p: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--checkpoint", required=True, metavar="CKPT",
                   help="megatron checkpoint dir (any TP/PP; a training run dir works too) or HF model dir")
    g.add_argument("--iteration", type=int, default=None, help="megatron checkpoint: which saved iteration (default: latest)")
    g.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="tokenizer dir (default: the checkpoint's own: an HF dir's files, or a converted checkpoint's hf_assets/)")
    g.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (auto: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    s = p.add_argument_group("sampling")
    s.add_argument("--seed", type=int, default=0,
                   help="sampling seed; prompt i of a --prompts file uses seed+i unless its line gives one (default 0)")
    s.add_argument("--temperature", type=float, default=defaults.get("temperature", 0.0),
                   help="softmax temperature; 0 = greedy (default %(default)s)")
    s.add_argument("--top-k", type=int, default=defaults.get("top_k", 0),
                   help="sample among the k most likely tokens; 0 = all (default %(default)s)")
    s.add_argument("--top-p", type=float, default=defaults.get("top_p", 1.0),
                   help="sample among the most likely tokens whose probability reaches p; 1 = all (default %(default)s)")
    s.add_argument("--greedy", action="store_true", help="greedy decoding (same as --temperature 0)")
    s.add_argument("--batch-size", type=int, default=8,
                   help="prompts per forward batch (default %(default)s)")
    s.add_argument("--no-progress", action="store_true", help="no live progress display")


def run(args: argparse.Namespace, family: str) -> int:
    from mmtrain.runtime.launch import quiet_third_party

    if not getattr(args, "verbose", False):  # megatron's and torch's warnings about optional packages
        quiet_third_party()
    from mmtrain.generation.checkpoint import GenerationError, Placement, resolve_checkpoint
    from mmtrain.generation.engine import generate
    from mmtrain.generation.sampling import SamplingParams

    spec = registry.get_family(family).generation
    try:
        sampling = SamplingParams(0.0 if args.greedy else args.temperature, args.top_k, args.top_p)
    except ValueError as exc:
        raise GenerationError(str(exc)) from None
    if args.batch_size < 1:
        raise GenerationError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads is not None:
        import torch

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
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn(f"[bold]generating {requests} {unit}{'s' if requests != 1 else ''}"),
                                 BarColumn(), MofNCompleteColumn(), TextColumn("tokens {task.fields[rate]}"),
                                 TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled)
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
