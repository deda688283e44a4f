"""Validate, curate (filters, near-duplicates, source mix), globally shuffle (deterministic by
--seed) and write energon-ready WebDataset shards with a per-sample length index, as a Ray job:
local by default, an existing cluster with --address or RAY_ADDRESS. Rerunning into the same
--output resumes an interrupted job. See docs/preprocess.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmdata.cli import add_ray_options, job_summary, run_alone
from mmdata.errors import UserError
from mmdata.preprocess.job import PreprocessConfig, run_preprocess
from mmdata.preprocess.loss_check import DEFAULT_FIRST_RECORDS, DEFAULT_MAX_FRACTION
from mmdata.preprocess.validation import ValidationConfig
from mmdata.shard_job.direct_io import direct_io_override


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        required=True,
        choices=["infinity-mm", "llava-json"],
        help="input layout: infinity-mm (stageN/<subset>/*.tar) or llava-json (JSON/JSONL + image root)",
    )
    parser.add_argument(
        "--input",
        required=True,
        nargs="+",
        type=Path,
        metavar="PATH",
        help="input files or folders (searched recursively)",
    )
    parser.add_argument("--output", required=True, type=Path, metavar="DIR", help="output shard folder")
    parser.add_argument(
        "--image-root",
        type=Path,
        default=None,
        metavar="DIR",
        help="llava-json: folder image paths are relative to (default: each annotation file's folder)",
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=None,
        metavar="N",
        help="samples per shard (default: sized for ~256 MiB shards)",
    )
    add_ray_options(parser)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete this tool's outputs in --output and start fresh (also: write into a folder "
        "holding other files, which are kept)",
    )
    parser.add_argument(
        "--num-buckets",
        type=int,
        default=None,
        help="advanced: shuffle buckets (default: from input size; never changes the output)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=ValidationConfig.max_image_pixels,
        help="decompression-bomb guard: images with more pixels are quarantined "
        f"(default {ValidationConfig.max_image_pixels})",
    )
    cur = parser.add_argument_group("curation (docs/preprocess.md, 'Curation'; all part of the job's fingerprint)")
    cur.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="EXPR",
        help="keep records satisfying EXPR (repeatable), e.g. 'qw2vl_loss<=2.5', 'source in [a,b]', "
        "'min_side>=32', 'turns<=20'; fields: qw2vl_loss, source, subset, id, modality, images, "
        "min_side, max_side, turns, text_chars",
    )
    cur.add_argument(
        "--dedup",
        default=None,
        metavar="phash[:D]",
        help="drop near-duplicates: images whose 64-bit perceptual hashes are within Hamming "
        "distance D (default 0, at most 8); the record's `phash` field is used when present",
    )
    cur.add_argument(
        "--dedup-scope",
        choices=["record", "image"],
        default="record",
        help="record (default): a duplicate also needs equal normalised conversation text; "
        "image: one record per near-duplicate image (caption stages)",
    )
    cur.add_argument(
        "--mix",
        default=None,
        metavar="FILE.yaml|source=weight,...",
        help="target proportions per source (or input subset) by deterministic down-sampling "
        "and, when the file says `repeat: true`, up-sampling by repetition",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="HF tokenizer folder: exact text token counts in the length index "
        "(default: an estimate; image tokens always follow the anyres rule)",
    )
    parser.add_argument(
        "--no-length-index",
        action="store_true",
        help="do not count tokens nor write lengths.parquet (saves the per-worker import of the "
        "loader's anyres code; `mmdata pack-plan` needs the index)",
    )
    parser.add_argument(
        "--max-quarantine-fraction",
        type=float,
        default=DEFAULT_MAX_FRACTION,
        metavar="F",
        help="stop, writing nothing, when one quarantine reason takes more than this share of "
        f"the first {DEFAULT_FIRST_RECORDS:,} records (a misconfiguration, not bad data); "
        f"1.0 disables the check (default {DEFAULT_MAX_FRACTION})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress display")


def run(args: argparse.Namespace) -> int:
    if args.image_root is not None and args.dataset != "llava-json":
        raise UserError("--image-root applies to --dataset llava-json only")
    if args.tokenizer is not None and args.no_length_index:
        raise UserError("--tokenizer only serves the length index; drop it or --no-length-index")
    if not 0.0 <= args.max_quarantine_fraction <= 1.0:
        raise UserError(f"--max-quarantine-fraction must be between 0 and 1, got {args.max_quarantine_fraction}")
    try:  # read again by each shard writer: a bad value stops the job here, not in its tasks
        direct_io_override()
    except ValueError as e:
        raise UserError(str(e)) from None
    cfg = PreprocessConfig(
        dataset=args.dataset,
        inputs=list(args.input),
        output=args.output,
        seed=args.seed,
        samples_per_shard=args.samples_per_shard,
        image_root=args.image_root,
        address=args.address,
        num_cpus=args.num_cpus,
        overwrite=args.overwrite,
        num_buckets=args.num_buckets,
        validation=ValidationConfig(max_image_pixels=args.max_image_pixels),
        progress=not args.no_progress,
        max_quarantine_fraction=args.max_quarantine_fraction,
        filters=list(args.filter),
        dedup=args.dedup,
        dedup_scope=args.dedup_scope,
        mix=args.mix,
        tokenizer=args.tokenizer,
        length_index=not args.no_length_index,
    )
    manifest = run_preprocess(cfg)  # (one job per output folder: the runner locks it, mmdata/folder_lock.py)
    c = manifest["counts"]
    curated = "".join(
        f", {c[k]:,} {k.replace('_', ' ')}" for k in ("filtered", "duplicates", "mixed_out", "repeated") if c[k]
    )
    print(job_summary(args.output, manifest, curated=curated))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m mmdata.preprocess.cli ...`: the subcommand alone (used by tests and scripts)."""
    return run_alone("preprocess", argv)


if __name__ == "__main__":
    sys.exit(main())
