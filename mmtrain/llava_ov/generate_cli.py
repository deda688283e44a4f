"""`mmtrain generate llava-ov`: the family's options and usage. Light at import (the CLI builds its
parser from it); prompt files, the model and the answers are mmtrain/llava_ov/generate_job.py's."""

from __future__ import annotations

import argparse

from mmtrain.generation.options import add_prompt_group

#: transformers' default for LLaVA-OV: greedy
SAMPLING_DEFAULTS = {"temperature": 0.0}
DEFAULT_MAX_NEW_TOKENS = 256
PROMPT_KEYS = ("image", "system", "seed")  # besides "prompt"
USAGE = """  mmtrain generate llava-ov --checkpoint CKPT --image IMG --prompt TEXT [--max-new-tokens N]
  mmtrain generate llava-ov --checkpoint CKPT --prompts questions.jsonl [--output answers.jsonl]

The prompt is laid out by the checkpoint's own chat template and the image tiled by its own
processor config (anyres grid, image tokens), as in training. --prompt prints the answer;
--prompts writes one JSON line per question.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = add_prompt_group(
        p,
        "llava-ov answers",
        "the question (with --image: about that image)",
        'one question per line, or a .jsonl file of {"prompt", optional "image" (path, '
        'relative to the file), "system", "seed"}: one JSON answer line each',
    )
    g.add_argument("--image", default=None, help="--prompt: the image the question is about (any format pillow reads)")
    g.add_argument("--system", default=None, help="system message (default: the chat template's own)")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="stop after this many tokens if no end-of-turn token came (default %(default)s)",
    )
    g.add_argument(
        "--output",
        default=None,
        help="--prompts: JSONL file for the answers (default: stdout); --prompt prints the answer",
    )
