"""`mmtrain generate llava-ov` after its options parsed (`GenerationSpec.prepare`): prompt files
and images read before the model loads, answers on stdout or as JSONL."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from mmtrain.generation.checkpoint import GenerationError, asset_dir
from mmtrain.generation.engine import GenerationJob
from mmtrain.generation.prompts import check_output, read_prompt_file, staged_file
from mmtrain.llava_ov.generate_cli import PROMPT_KEYS
from mmtrain.llava_ov.generation import LlavaOVChat


def _open_image(path: Path, where: str) -> Any:
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (OSError, UnidentifiedImageError) as exc:
        raise GenerationError(f"{where}: cannot read image {path}: {exc}") from None


def read_prompts(args: argparse.Namespace) -> list[dict]:
    """[{prompt, image (PIL or None), image_path, system, seed}] from --prompt or --prompts;
    prompt i of a file samples with seed + i unless its line gives a seed."""
    if args.prompt is not None:
        image = _open_image(Path(args.image), "--image") if args.image else None
        return [dict(prompt=args.prompt, image=image, image_path=args.image, system=args.system, seed=args.seed)]
    if args.image is not None:
        raise GenerationError('--image goes with --prompt; in a --prompts .jsonl file give each line its "image"')
    out = []
    for i, (where, rec) in enumerate(read_prompt_file(args.prompts, PROMPT_KEYS)):
        image_path = rec.get("image")
        image = _open_image(Path(args.prompts).parent / image_path, where) if image_path else None
        try:
            seed = int(rec.get("seed", args.seed + i))
        except (ValueError, TypeError) as exc:
            raise GenerationError(f"{where}: seed: {exc}") from None
        out.append(
            dict(
                prompt=rec["prompt"],
                image=image,
                image_path=image_path,
                system=rec.get("system", args.system),
                seed=seed,
            )
        )
    return out


def prepare(args: argparse.Namespace, ref: Any, placement: Any) -> GenerationJob:
    """The questions, checked before the model loads, and how answers are written."""
    if args.max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    items = read_prompts(args)
    if args.output is not None:
        if args.prompts is None:
            raise GenerationError("--output goes with --prompts (--prompt prints its answer)")
        check_output(Path(args.output), directory=False, overwrite=args.overwrite)
    chat = LlavaOVChat(ref, placement, tokenizer_dir=asset_dir(ref, args.tokenizer, "tokenizer", "tokenizer"))
    requests = [
        chat.request(chat.prompt(it["prompt"], it["image"], it["system"]), args.max_new_tokens, it["seed"])
        for it in items
    ]

    def finish(results: list) -> None:
        if args.prompts is None:
            print(chat.answer(results[0]))
            return
        lines = [
            json.dumps(
                {
                    "index": i,
                    "prompt": it["prompt"],
                    "image": it["image_path"],
                    "seed": it["seed"],
                    "answer": chat.answer(r),
                    "tokens": r.tokens,
                    "finish_reason": r.finish_reason,
                },
                ensure_ascii=False,
            )
            + "\n"
            for i, (it, r) in enumerate(zip(items, results))
        ]
        if args.output is None:
            sys.stdout.writelines(lines)
            return
        with staged_file(Path(args.output)) as tmp:
            tmp.write_text("".join(lines), encoding="utf-8")

    return GenerationJob(chat.model, requests, finish, unit="answer")
