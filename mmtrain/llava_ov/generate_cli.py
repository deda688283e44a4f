"""`mmtrain generate llava-ov`: the family's options, prompt files, answers on stdout or JSONL.
Light at import (the CLI builds its parser from it); the model code loads in `prepare`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

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
    g = p.add_argument_group("llava-ov answers")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the question (with --image: about that image)")
    what.add_argument("--prompts", metavar="FILE",
                      help="one question per line, or a .jsonl file of {\"prompt\", optional \"image\" (path, "
                           "relative to the file), \"system\", \"seed\"}: one JSON answer line each")
    g.add_argument("--image", default=None, help="--prompt: the image the question is about (any format pillow reads)")
    g.add_argument("--system", default=None, help="system message (default: the chat template's own)")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="stop after this many tokens if no end-of-turn token came (default %(default)s)")
    g.add_argument("--output", default=None,
                   help="--prompts: JSONL file for the answers (default: stdout); --prompt prints the answer")


def _open_image(path: Path, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    from mmtrain.generation.checkpoint import GenerationError

    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (OSError, UnidentifiedImageError) as exc:
        raise GenerationError(f"{where}: cannot read image {path}: {exc}") from None


def read_prompts(args: argparse.Namespace) -> list[dict]:
    """[{prompt, image (PIL or None), image_path, system, seed}] from --prompt or --prompts;
    prompt i of a file samples with seed + i unless its line gives a seed."""
    from mmtrain.generation.checkpoint import GenerationError
    from mmtrain.generation.prompts import read_prompt_file

    if args.prompt is not None:
        image = _open_image(Path(args.image), "--image") if args.image else None
        return [dict(prompt=args.prompt, image=image, image_path=args.image, system=args.system, seed=args.seed)]
    if args.image is not None:
        raise GenerationError("--image goes with --prompt; in a --prompts .jsonl file give each line its \"image\"")
    out = []
    for i, (where, rec) in enumerate(read_prompt_file(args.prompts, PROMPT_KEYS)):
        image_path = rec.get("image")
        image = _open_image(Path(args.prompts).parent / image_path, where) if image_path else None
        try:
            seed = int(rec.get("seed", args.seed + i))
        except (ValueError, TypeError) as exc:
            raise GenerationError(f"{where}: seed: {exc}") from None
        out.append(dict(prompt=rec["prompt"], image=image, image_path=image_path, system=rec.get("system", args.system),
                        seed=seed))
    return out


def prepare(args: argparse.Namespace, ref: Any, placement: Any) -> Any:
    from mmtrain.generation.checkpoint import GenerationError, asset_dir
    from mmtrain.generation.engine import GenerationJob
    from mmtrain.generation.prompts import check_output
    from mmtrain.llava_ov.generation import LlavaOVChat

    if args.max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    items = read_prompts(args)
    if args.output is not None:
        if args.prompts is None:
            raise GenerationError("--output goes with --prompts (--prompt prints its answer)")
        check_output(Path(args.output), directory=False)
    chat = LlavaOVChat(ref, placement, tokenizer_dir=asset_dir(ref, args.tokenizer, "tokenizer", "tokenizer"))
    requests = [chat.request(chat.prompt(it["prompt"], it["image"], it["system"]), args.max_new_tokens, it["seed"])
                for it in items]

    def finish(results: list) -> None:
        if args.prompts is None:
            print(chat.answer(results[0]))
            return
        f = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
        try:
            for i, (it, r) in enumerate(zip(items, results)):
                f.write(json.dumps({"index": i, "prompt": it["prompt"], "image": it["image_path"], "seed": it["seed"],
                                    "answer": chat.answer(r), "tokens": r.tokens,
                                    "finish_reason": r.finish_reason}, ensure_ascii=False) + "\n")
        finally:
            if f is not sys.stdout:
                f.close()

    return GenerationJob(chat.model, requests, finish, unit="answer")
