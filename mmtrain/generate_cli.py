"""`mmtrain generate FAMILY --checkpoint CKPT ...`: the command's parser and help, built from the
registry (families with a `generation` entry). What it runs: mmtrain/generate_command.py, imported
at dispatch; the engine is mmtrain/generation/engine.py. See docs/generation.md."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from mmtrain import registry

#: what `mmtrain generate FAMILY` runs, imported at dispatch (it imports torch and the engine)
GENERATE_ACTION = "mmtrain.generate_command:run"

#: shared by every `mmtrain generate` help page
CHECKPOINTS_AND_EXIT = """CKPT is a megatron checkpoint dir written by mmtrain (converted, or a training run's
`checkpoints/`, or the run dir itself) saved at any TP/PP (it is loaded resharded into this one
process), or an HF model dir. Greedy decoding or seeded sampling: the same command and seed give
the same output.

An existing --output file, or a non-empty --output folder, is refused unless --overwrite (as
every writing command does); outputs are put in place only when complete.

Exit status: 0 done; 2 an expected problem (a missing path, a checkpoint of another family, a
missing VQ model or tokenizer, a bad option, an existing --output), said in one line before
anything is written; 130 interrupted; 1 an unexpected error (its traceback in a log file, or on stderr with --verbose).
"""


#: the sampling options a family's `GenerationSpec.sampling_defaults` may set: (key, type,
#: default when the family sets none, help)
SAMPLING_OPTIONS: tuple[tuple[str, type, float, str], ...] = (
    ("temperature", float, 0.0, "softmax temperature; 0 = greedy"),
    ("top_k", int, 0, "sample among the k most likely tokens; 0 = all"),
    ("top_p", float, 1.0, "sample among the most likely tokens whose probability reaches p; 1 = all"),
)


def generate_help() -> str:
    """`mmtrain generate --help`: each family's usage lines, from the registry."""
    gens = [spec for spec in registry.FAMILIES.values() if spec.generation is not None]
    lines = "\n".join(f"  {spec.name}: {spec.generation.help}" for spec in gens)
    usage = "\n".join(spec.generation.usage.strip("\n").split("\n\n")[0] for spec in gens)
    return (
        f"Generate with a trained or converted model:\n{lines}\n\n{usage}\n\n"
        "`mmtrain generate FAMILY --help` lists each family's own options.\n\n" + CHECKPOINTS_AND_EXIT
    )


def add_arguments(
    parser: argparse.ArgumentParser, add_common: Callable[[argparse.ArgumentParser], None] = lambda p: None
) -> None:
    """One sub-command per family that can generate, each with the shared and its own options."""
    sub = parser.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for spec in registry.FAMILIES.values():
        gen = spec.generation
        if gen is None:
            continue
        description = f"{spec.name}: {gen.help}.\n\n{gen.usage.strip(chr(10))}\n\n{CHECKPOINTS_AND_EXIT}"
        p = sub.add_parser(
            spec.name, help=gen.help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        _shared_arguments(p, gen.sampling_defaults)
        gen.add_arguments(p)
        add_common(p)
        p.set_defaults(run=GENERATE_ACTION)


def _shared_arguments(p: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--checkpoint",
        required=True,
        metavar="CKPT",
        help="megatron checkpoint dir (any TP/PP; a training run dir works too) or HF model dir",
    )
    g.add_argument(
        "--iteration", type=int, default=None, help="megatron checkpoint: which saved iteration (default: latest)"
    )
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="tokenizer dir (default: the checkpoint's own: an HF dir's files, or a converted checkpoint's hf_assets/)",
    )
    g.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations (auto: bfloat16 on cuda, float32 on cpu)",
    )
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    s = p.add_argument_group("sampling")
    s.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed; prompt i of a --prompts file uses seed+i unless its line gives one (default 0)",
    )
    for key, kind, default, what in SAMPLING_OPTIONS:
        s.add_argument(
            "--" + key.replace("_", "-"),
            type=kind,
            default=defaults.get(key, default),
            help=f"{what} (default %(default)s)",
        )
    s.add_argument("--greedy", action="store_true", help="greedy decoding (same as --temperature 0)")
    s.add_argument("--batch-size", type=int, default=8, help="prompts per forward batch (default %(default)s)")
    s.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output file, or a non-empty --output folder (refused without it): "
        "the new output is written next to it and put in place at the end, the folder replaced whole",
    )
