"""Write a small synthetic dataset in a real on-disk layout (Infinity-MM tar shards or
LLaVA-style JSONL + image folder), varied like the real data and optionally with a fraction
of deliberately broken records, so demos and tests exercise every path of the preprocessor.

Pictures are photo-like by default: crops of real photos resized to each record's size
(`mmdata/dev/photo_source.py`), so encoded sizes and decode costs are those of real data.
`--synthetic` (`synthetic=True`) draws colour gradients with a few rectangles instead: several
times cheaper to make and to check, for tests that need tidy fixtures, not realistic pixels.

As in the published Infinity-MM tars, a record's `image` field is by default provenance, not
a member name: mostly an absolute path on the producer's storage whose basename and extension
differ from the member `{stem}.jpg` (some records name the member exactly, some by basename
under a foreign folder; `--image-field member` writes only exact member names). `phash` is the
card's format, a list of 64-bit integers (the perceptual hash of each image).

The output is byte-deterministic for a given (--dataset, --num-samples, --seed,
--broken-fraction, --video-fraction, --samples-per-tar, --image-field, --synthetic). The image
kind changes only the pixels (a photo's crop depends only on seed and record index): the records'
structure, sizes, formats and text are the same with and without --synthetic.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmdata.cli import run_alone
from mmdata.dev.synth_media import SynthImage
from mmdata.dev.synth_records import (
    BROKEN_KINDS,
    EN_ANSWERS,
    EN_PROMPTS,
    PRODUCER_ROOT,
    SUBSETS,
    TEXT_ONLY,
    ZH_ANSWERS,
    ZH_PROMPTS,
    SynthRecord,
    generate_records,
)
from mmdata.dev.synth_writers import write_infinity_mm, write_llava_json
from mmdata.errors import UserError
from mmdata.ray_job import remove
from mmdata.units import plural

#: the dataset's public names, importable from here (the records, media and writers modules hold them)
__all__ = [
    "BROKEN_KINDS",
    "EN_ANSWERS",
    "EN_PROMPTS",
    "PRODUCER_ROOT",
    "SUBSETS",
    "TEXT_ONLY",
    "ZH_ANSWERS",
    "ZH_PROMPTS",
    "SynthImage",
    "SynthRecord",
    "generate_records",
    "write_infinity_mm",
    "write_llava_json",
    "add_arguments",
    "main",
    "run",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        choices=["infinity-mm", "llava-json"],
        default="infinity-mm",
        help="on-disk layout to write (default: infinity-mm)",
    )
    parser.add_argument(
        "--output", required=True, type=Path, metavar="DIR", help="output directory (new or empty; see --overwrite)"
    )
    parser.add_argument("--num-samples", type=int, required=True, metavar="N", help="number of records")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--broken-fraction",
        type=float,
        default=0.0,
        help=f"fraction of deliberately broken records, cycling through {', '.join(BROKEN_KINDS)} (default 0)",
    )
    parser.add_argument(
        "--video-fraction",
        type=float,
        default=0.0,
        help="fraction of records that are short MP4 clips with a <video> turn (default 0)",
    )
    parser.add_argument(
        "--samples-per-tar", type=int, default=100, help="records per tar file in the infinity-mm layout (default 100)"
    )
    parser.add_argument(
        "--image-field",
        choices=["realistic", "member"],
        default="realistic",
        help="infinity-mm `image` field: realistic (mostly foreign absolute paths whose "
        "basename/extension differ from the member, as in the published tars) or "
        "member (exact member names) (default realistic)",
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="colour gradients with a few rectangles instead of photo-like crops of real photos: "
        "cheap tidy fixtures, but they compress to almost nothing and decode several times "
        "faster than real images (default: photo-like)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --output: first delete what synth writes there (stageN/ "
        "folders, or annotations.jsonl, images/ and videos/); other files are kept",
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m mmdata.dev.synth ...`: the subcommand alone."""
    return run_alone("synth", argv)


def own_entries(dataset: str) -> list[str]:
    """The top-level entries synth writes into its output folder."""
    if dataset == "infinity-mm":
        return sorted({stage for stage, _ in SUBSETS})
    return ["annotations.jsonl", "images", "videos"]


def check_output(out: Path, dataset: str, overwrite: bool) -> None:
    """Refuse a file, or a non-empty folder without --overwrite (which removes synth's own
    entries first, so no stale file of a bigger earlier run stays behind)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; give a new or empty folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(
            f"--output {out} is not empty; choose a new or empty folder, or pass --overwrite to replace "
            f"what synth writes there ({', '.join(own_entries(dataset))})"
        )
    remove([out / name for name in own_entries(dataset) if (out / name).exists()])


def run(args: argparse.Namespace) -> int:
    if args.num_samples <= 0:
        raise UserError(f"--num-samples must be a positive number, got {args.num_samples}")
    if args.samples_per_tar <= 0:
        raise UserError(f"--samples-per-tar must be a positive number, got {args.samples_per_tar}")
    for flag, value in (("--broken-fraction", args.broken_fraction), ("--video-fraction", args.video_fraction)):
        if not 0.0 <= value <= 1.0:
            raise UserError(f"{flag} must be between 0 and 1, got {value}")
    check_output(args.output, args.dataset, args.overwrite)
    records = generate_records(
        args.num_samples,
        seed=args.seed,
        broken_fraction=args.broken_fraction,
        video_fraction=args.video_fraction,
        image_field=args.image_field,
        synthetic=args.synthetic,
    )
    if args.dataset == "infinity-mm":
        files = write_infinity_mm(records, args.output, samples_per_tar=args.samples_per_tar)
    else:
        files = write_llava_json(records, args.output)
    n_broken = sum(1 for r in records if r.broken)
    print(
        f"wrote {plural(len(records), 'record')} ({n_broken:,} broken) in {plural(len(files), 'file')} "
        f"under {args.output}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
