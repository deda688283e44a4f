"""Write a tiny random Emu3 VQ model directory (`mmdata tiny-vq`), for tests and the demo.

The same architecture as Emu3's vision tokenizer (transformers' `Emu3VQVAE`: 8x8 spatial
compression from four resolution levels, 4x temporal, attention at the lowest level) at toy
width, random weights from a seed. Written as `Emu3VQVAE.save_pretrained` does (config.json,
model.safetensors) plus the `Emu3ImageProcessor` settings of the real one (mean/std 0.5,
spatial factor 8, 512²..1024² pixels), so `mmdata tokenize-images --vision-tokenizer DIR` treats
it exactly like real weights. Deterministic: the same seed and sizes give the same files.
The builder is tiny_vq_model.py (torch, transformers); this module is the subcommand, light for `--help`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmdata.errors import UserError

DEFAULT_CODEBOOK_SIZE = 512  # the tiny Emu3 tokenizer's default number of visual tokens
TINY_VQ_CONFIG = dict(
    embed_dim=4,
    latent_channels=4,
    double_latent=False,
    in_channels=3,
    out_channels=3,
    temporal_downsample_factor=4,
    base_channels=32,
    channel_multiplier=[1, 2, 2, 4],
    num_res_blocks=1,
    attn_resolutions=[3],
    hidden_size=128,
    num_attention_heads=1,
)
# Emu3's image processor settings (BAAI/Emu3-VisionTokenizer's preprocessor config).
EMU3_PROCESSOR = dict(
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    min_pixels=512 * 512,
    max_pixels=1024 * 1024,
    spatial_factor=8,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", required=True, type=Path, metavar="DIR", help="directory to write the VQ model into"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--codebook-size",
        type=int,
        default=DEFAULT_CODEBOOK_SIZE,
        help=f"number of VQ codes = visual tokens of the tokenizer (default {DEFAULT_CODEBOOK_SIZE})",
    )


def run(args: argparse.Namespace) -> int:
    from mmdata.dev.tiny_vq_model import build_tiny_vq  # CLI dispatch: the builder imports torch and transformers

    if args.codebook_size < 1:
        raise UserError(f"--codebook-size must be positive, got {args.codebook_size}")
    out = build_tiny_vq(args.output, seed=args.seed, codebook_size=args.codebook_size)
    print(f"wrote a tiny random Emu3 VQ model ({args.codebook_size} codes, seed {args.seed}) to {out}")
    return 0
