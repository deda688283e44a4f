"""`mmtrain generate emu3`: the family's options and usage. Light at import (the CLI builds its
parser from it); prompt files, the model and the outputs are mmtrain/emu3/generate_job.py's."""

from __future__ import annotations

import argparse

from mmtrain.generation.options import add_prompt_group

#: the Emu3 reference's text-to-image sampling: top-k 2048 at temperature 1
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 2048}
DEFAULT_CFG_SCALE = 3.0
DEFAULT_SIZE = 512
PROMPT_KEYS = ("negative_prompt", "seed", "height", "width", "cfg_scale")  # besides "prompt"
USAGE = """  mmtrain generate emu3 --checkpoint CKPT --prompt TEXT [--negative-prompt TEXT] --cfg-scale 3.0
                        --height 512 --width 512 --seed S --output out.png
  mmtrain generate emu3 --checkpoint CKPT --prompts prompts.txt|prompts.jsonl --output DIR

Each step runs the conditional and unconditional rows of every prompt in one forward and mixes
them on log-probs (uncond + s * (cond - uncond)); the Emu3 image structure (size header, W codes
then end-of-line per row, end-of-frame/image) is enforced while sampling, so every result is a
decodable grid. --prompts writes DIR/NNNNNN.png and DIR/images.jsonl (prompt, seed, token grid).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = add_prompt_group(
        p,
        "emu3 text-to-image",
        "the caption of the image to generate",
        'one prompt per line, or a .jsonl file of {"prompt", optional "negative_prompt", '
        '"seed", "height", "width", "cfg_scale"}: one PNG each, and DIR/images.jsonl '
        "with the token grids",
    )
    g.add_argument(
        "--negative-prompt",
        default="",
        help="caption of the unconditional (guidance) row; default empty, the caption drop training uses",
    )
    g.add_argument(
        "--cfg-scale",
        type=float,
        default=DEFAULT_CFG_SCALE,
        help="classifier-free guidance: uncond + s * (cond - uncond) on log-probs; 1 = none, "
        "0 = the negative prompt alone; a guided prompt adds its negative row to the --batch-size batch "
        "(default %(default)s)",
    )
    g.add_argument(
        "--height",
        type=int,
        default=DEFAULT_SIZE,
        help="image height in pixels, a multiple of the VQ's spatial factor (8) (default %(default)s)",
    )
    g.add_argument("--width", type=int, default=DEFAULT_SIZE, help="image width in pixels (default %(default)s)")
    g.add_argument(
        "--output",
        default=None,
        help="--prompt: the PNG to write (default emu3.png); --prompts: the directory for "
        "NNNNNN.png and images.jsonl (default emu3_images)",
    )
    g.add_argument(
        "--vq",
        metavar="DIR",
        default=None,
        help="VQ model (an Emu3VQVAE dir or an HF Emu3 dir); default: the checkpoint's own "
        "(an HF dir's, or a converted checkpoint's hf_assets/vq)",
    )
