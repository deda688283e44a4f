"""`mmtrain generate emu3`: the family's options, prompt files, PNG and token-grid outputs.
Light at import (the CLI builds its parser from it); the model code loads in `prepare`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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
    g = p.add_argument_group("emu3 text-to-image")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the caption of the image to generate")
    what.add_argument("--prompts", metavar="FILE",
                      help="one prompt per line, or a .jsonl file of {\"prompt\", optional \"negative_prompt\", "
                           "\"seed\", \"height\", \"width\", \"cfg_scale\"}: one PNG each, and DIR/images.jsonl "
                           "with the token grids")
    g.add_argument("--negative-prompt", default="",
                   help="caption of the unconditional (guidance) row; default empty, the caption drop training uses")
    g.add_argument("--cfg-scale", type=float, default=DEFAULT_CFG_SCALE,
                   help="classifier-free guidance: uncond + s * (cond - uncond) on log-probs; 1 = none, "
                        "0 = the negative prompt alone; a guided prompt adds its negative row to the --batch-size batch "
                        "(default %(default)s)")
    g.add_argument("--height", type=int, default=DEFAULT_SIZE,
                   help="image height in pixels, a multiple of the VQ's spatial factor (8) (default %(default)s)")
    g.add_argument("--width", type=int, default=DEFAULT_SIZE, help="image width in pixels (default %(default)s)")
    g.add_argument("--output", default=None,
                   help="--prompt: the PNG to write (default emu3.png); --prompts: the directory for "
                        "NNNNNN.png and images.jsonl (default emu3_images)")
    g.add_argument("--vq", metavar="DIR", default=None,
                   help="VQ model (an Emu3VQVAE dir or an HF Emu3 dir); default: the checkpoint's own "
                        "(an HF dir's, or a converted checkpoint's hf_assets/vq)")


def read_prompts(args: argparse.Namespace) -> list[Any]:
    """ImagePrompts from --prompt or --prompts; prompt i of a file samples with seed + i unless
    its line gives a seed."""
    from mmtrain.emu3.generation import ImagePrompt
    from mmtrain.generation.checkpoint import GenerationError
    from mmtrain.generation.prompts import read_prompt_file

    base = dict(negative=args.negative_prompt, cfg_scale=args.cfg_scale, height=args.height, width=args.width)
    if args.prompt is not None:
        return [ImagePrompt(args.prompt, seed=args.seed, **base)]
    out = []
    for i, (where, rec) in enumerate(read_prompt_file(args.prompts, PROMPT_KEYS)):
        try:
            out.append(ImagePrompt(
                rec["prompt"], height=int(rec.get("height", args.height)), width=int(rec.get("width", args.width)),
                negative=str(rec.get("negative_prompt", args.negative_prompt)),
                cfg_scale=float(rec.get("cfg_scale", args.cfg_scale)), seed=int(rec.get("seed", args.seed + i))))
        except (ValueError, TypeError) as exc:
            raise GenerationError(f"{where}: {exc}") from None
    return out


def vq_dir(args: argparse.Namespace, ref: Any) -> Path:
    """--vq, else the checkpoint's own VQ; GenerationError when there is none (checked before
    the model loads)."""
    from mmdata.vision_tokens.vq import VQError, check_vq_dir
    from mmtrain.emu3.generation import KEPT_VQ
    from mmtrain.generation.checkpoint import GenerationError

    if args.vq is not None:
        d, where = Path(args.vq), f"--vq {args.vq}"
    elif ref.is_hf:
        d, where = ref.path, f"--checkpoint {ref.path} (an HF Emu3 dir: its vqmodel)"
    elif ref.assets is not None and (ref.assets / KEPT_VQ / "config.json").is_file():
        d, where = ref.assets / KEPT_VQ, f"the VQ model kept in {ref.assets / KEPT_VQ}"
    else:
        raise GenerationError(f"--checkpoint {ref.path} keeps no VQ model (no hf_assets/{KEPT_VQ}: it was not converted "
                              "from an HF Emu3 dir), so generated tokens cannot become pixels; give --vq VQ_DIR "
                              "(an Emu3VQVAE dir or an HF Emu3 dir)")
    try:
        check_vq_dir(d)
    except VQError as exc:
        raise GenerationError(f"{where}: {exc}") from None
    return d


def check_sizes(prompts: list, vq: Path) -> None:
    """Image sizes the VQ can decode, checked before the model loads."""
    from mmdata.vision_tokens.vq import check_vq_dir, spatial_factor
    from mmtrain.emu3.generation import grid_shape

    factor = spatial_factor({"channel_multiplier": [1, 2, 2, 4], **check_vq_dir(vq)[1]})  # Emu3VQVAEConfig's default
    for p in prompts:
        grid_shape(p.height, p.width, factor)


def prepare(args: argparse.Namespace, ref: Any, placement: Any) -> Any:
    from PIL import Image

    from mmtrain.emu3.generation import Emu3ImageGenerator
    from mmtrain.generation.checkpoint import asset_dir
    from mmtrain.generation.engine import GenerationJob
    from mmtrain.generation.prompts import check_output

    prompts = read_prompts(args)
    batch = args.prompts is not None
    out = Path(args.output or ("emu3_images" if batch else "emu3.png"))
    writable = [ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE]
    check_output(out, directory=batch, suffixes=writable)
    vq = vq_dir(args, ref)
    check_sizes(prompts, vq)
    tokenizer = asset_dir(ref, args.tokenizer, "tokenizer", "tokenizer")
    generator = Emu3ImageGenerator(ref, placement, tokenizer_dir=tokenizer, vq_dir=vq)
    requests = [generator.request(p) for p in prompts]

    def finish(results: list) -> None:
        images = generator.finish(prompts, results)
        if not batch:
            out.parent.mkdir(parents=True, exist_ok=True)
            images[0].image.save(out)
            rows, cols = images[0].grid.shape
            print(f"wrote {out} ({images[0].image.width}x{images[0].image.height} px, {rows}x{cols} codes, "
                  f"{len(images[0].tokens)} tokens)")
            return
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "images.jsonl", "w", encoding="utf-8") as f:
            for i, (p, im) in enumerate(zip(prompts, images)):
                name = f"{i:06d}.png"
                im.image.save(out / name)
                f.write(json.dumps({"index": i, "prompt": p.text, "negative_prompt": p.negative, "seed": p.seed,
                                    "cfg_scale": p.cfg_scale, "height": p.height, "width": p.width, "png": name,
                                    "grid": im.grid.tolist()}) + "\n")
        print(f"wrote {len(images)} images and images.jsonl to {out}")

    return GenerationJob(generator.model, requests, finish, unit="image")
