"""Turn the images of preprocessed shards into Emu3 VQ token grids (a Ray job: local by default,
an existing cluster with --address or RAY_ADDRESS). Each image is resized exactly as
transformers' Emu3ImageProcessor does (to about --image-area pixels, sides in multiples of the
VQ's spatial factor) and encoded with the Emu3 VQ model of --vision-tokenizer. The output has the
input's shard names, keys and order, energon-ready. Rerunning into the same --output resumes an
interrupted job."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmdata.cli import add_ray_options, job_summary, run_alone
from mmdata.errors import UserError
from mmdata.packing.emu3_geometry import DEFAULT_SYSTEM_PROMPT
from mmdata.units import plural
from mmdata.vision_tokens.defaults import DEFAULT_CHUNK_SAMPLES, DEFAULT_IMAGE_AREA


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "shards", type=Path, metavar="SHARDS", help="a preprocessed shard folder (mmdata preprocess output)"
    )
    parser.add_argument(
        "--vision-tokenizer",
        required=True,
        type=Path,
        metavar="VQ_DIR",
        help="Emu3 VQ model: an Emu3VQVAE dir (e.g. from mmdata tiny-vq) or a whole transformers "
        "Emu3 checkpoint dir; safetensors weights + preprocessor_config.json",
    )
    parser.add_argument("--output", required=True, type=Path, metavar="DIR", help="output token shard folder")
    parser.add_argument(
        "--image-area",
        type=int,
        default=DEFAULT_IMAGE_AREA,
        help=f"target pixels per image: the processor's min_pixels = max_pixels (default "
        f"{DEFAULT_IMAGE_AREA} = 512x512, Emu3-Chat's); 0 keeps the VQ dir's own bounds",
    )
    add_ray_options(parser)
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the VQ runs (default auto: cuda when the Ray cluster has GPUs)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="tokenizing workers (Ray actors), each loading the VQ model once and keeping it for "
        "every chunk it is sent (default: one per CPU of the cluster on cpu, one per "
        "--gpus-per-worker GPUs on cuda)",
    )
    parser.add_argument(
        "--gpus-per-worker",
        "--gpus-per-task",
        dest="gpus_per_worker",
        type=float,
        default=1.0,
        metavar="F",
        help="GPUs each worker asks Ray for on cuda (default 1; 0.25 = 4 workers, 4 VQ copies, per "
        "GPU). Workers are actors, not tasks, because Ray starts a fresh process for every "
        "GPU task (max_calls=1) and would reload the model for each chunk. (--gpus-per-task "
        "is the old name.)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="same-size images per VQ forward (default: 1 on CPU, 8 on GPU)"
    )
    parser.add_argument(
        "--chunk-samples",
        type=int,
        default=DEFAULT_CHUNK_SAMPLES,
        help=f"samples per chunk, the unit sent to a worker (default {DEFAULT_CHUNK_SAMPLES}; "
        "never changes the output)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="the Emu3 text tokenizer training uses (the recipe's tokenizer.path): also write "
        "lengths.parquet, each sample's exact length per Emu3 task, which `mmdata pack-plan` "
        "plans packing from (data.packing: plan)",
    )
    parser.add_argument(
        "--system-prompt",
        default=DEFAULT_SYSTEM_PROMPT,
        metavar="TEXT",
        help="with --tokenizer: the system prompt the lengths are counted with (the recipe's "
        f"data.system_prompt; default {DEFAULT_SYSTEM_PROMPT!r})",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="delete this tool's outputs in --output and start fresh"
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress display")


def run(args: argparse.Namespace) -> int:
    from mmdata.vision_tokens.job import TokenizeConfig, run_tokenize  # CLI dispatch: the job (torch, ray)

    if args.image_area < 0:
        raise UserError(f"--image-area must be positive (or 0 for the VQ dir's own bounds), got {args.image_area}")
    if args.gpus_per_worker <= 0:
        raise UserError(f"--gpus-per-worker must be positive, got {args.gpus_per_worker}")
    if args.workers is not None and args.workers <= 0:
        raise UserError(f"--workers must be positive, got {args.workers}")
    cfg = TokenizeConfig(
        input=args.shards,
        vision_tokenizer=args.vision_tokenizer,
        output=args.output,
        image_area=args.image_area or None,
        address=args.address,
        num_cpus=args.num_cpus,
        device=args.device,
        gpus_per_worker=args.gpus_per_worker,
        workers=args.workers,
        batch_size=args.batch_size,
        chunk_samples=args.chunk_samples,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        tokenizer=args.tokenizer,
        system_prompt=args.system_prompt,
    )
    manifest = run_tokenize(cfg)
    c = manifest["counts"]
    media = f" ({plural(c['tokens']['images'], 'image')}, {plural(c['tokens']['visual_tokens'], 'visual token')})"
    print(job_summary(args.output, manifest, media))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m mmdata.vision_tokens.cli ...`: the subcommand alone (used by tests and scripts)."""
    return run_alone("tokenize-images", argv)


if __name__ == "__main__":
    sys.exit(main())
