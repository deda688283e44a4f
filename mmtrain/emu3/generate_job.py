"""`mmtrain generate emu3` after its options parsed (`GenerationSpec.prepare`): prompt files,
the VQ model and sizes checked before the model loads, PNG and token-grid outputs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from PIL import Image

from mmdata.folder_lock import FolderLock, fresh_folder
from mmdata.vision_tokens.vq import VQError, check_vq_dir, spatial_factor
from mmtrain.emu3.generate_cli import PROMPT_KEYS
from mmtrain.emu3.generation import KEPT_VQ, Emu3ImageGenerator, ImagePrompt, grid_shape
from mmtrain.generation.checkpoint import GenerationError, asset_dir
from mmtrain.generation.engine import GenerationJob
from mmtrain.generation.prompts import check_output, read_prompt_file, staged_file


def read_prompts(args: argparse.Namespace) -> list[Any]:
    """ImagePrompts from --prompt or --prompts; prompt i of a file samples with seed + i unless
    its line gives a seed."""
    base = dict(negative=args.negative_prompt, cfg_scale=args.cfg_scale, height=args.height, width=args.width)
    if args.prompt is not None:
        return [ImagePrompt(args.prompt, seed=args.seed, **base)]
    out = []
    for i, (where, rec) in enumerate(read_prompt_file(args.prompts, PROMPT_KEYS)):
        try:
            out.append(
                ImagePrompt(
                    rec["prompt"],
                    height=int(rec.get("height", args.height)),
                    width=int(rec.get("width", args.width)),
                    negative=str(rec.get("negative_prompt", args.negative_prompt)),
                    cfg_scale=float(rec.get("cfg_scale", args.cfg_scale)),
                    seed=int(rec.get("seed", args.seed + i)),
                )
            )
        except (ValueError, TypeError) as exc:
            raise GenerationError(f"{where}: {exc}") from None
    return out


def vq_dir(args: argparse.Namespace, ref: Any) -> Path:
    """--vq, else the checkpoint's own VQ; GenerationError when there is none (checked before
    the model loads)."""
    if args.vq is not None:
        d, where = Path(args.vq), f"--vq {args.vq}"
    elif ref.is_hf:
        d, where = ref.path, f"--checkpoint {ref.path} (an HF Emu3 dir: its vqmodel)"
    elif ref.assets is not None and (ref.assets / KEPT_VQ / "config.json").is_file():
        d, where = ref.assets / KEPT_VQ, f"the VQ model kept in {ref.assets / KEPT_VQ}"
    else:
        raise GenerationError(
            f"--checkpoint {ref.path} keeps no VQ model (no hf_assets/{KEPT_VQ}: it was not converted "
            "from an HF Emu3 dir), so generated tokens cannot become pixels; give --vq VQ_DIR "
            "(an Emu3VQVAE dir or an HF Emu3 dir)"
        )
    try:
        check_vq_dir(d)
    except VQError as exc:
        raise GenerationError(f"{where}: {exc}") from None
    return d


def check_sizes(prompts: list, vq: Path) -> None:
    """Image sizes the VQ can decode, checked before the model loads."""
    factor = spatial_factor({"channel_multiplier": [1, 2, 2, 4], **check_vq_dir(vq)[1]})  # Emu3VQVAEConfig's default
    for p in prompts:
        grid_shape(p.height, p.width, factor)


def prepare(args: argparse.Namespace, ref: Any, placement: Any) -> GenerationJob:
    """The images to generate, checked before the model loads, and how results become files."""
    prompts = read_prompts(args)
    batch = args.prompts is not None
    out = Path(args.output or ("emu3_images" if batch else "emu3.png"))
    writable = [ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE]
    check_output(out, directory=batch, overwrite=args.overwrite, suffixes=writable)
    vq = vq_dir(args, ref)
    check_sizes(prompts, vq)
    tokenizer = asset_dir(ref, args.tokenizer, "tokenizer", "tokenizer")
    generator = Emu3ImageGenerator(ref, placement, tokenizer_dir=tokenizer, vq_dir=vq)
    requests = [generator.request(p) for p in prompts]

    def finish(results: list) -> None:
        images = generator.finish(prompts, results)
        if not batch:
            with staged_file(out) as tmp:
                images[0].image.save(tmp)
            rows, cols = images[0].grid.shape
            print(
                f"wrote {out} ({images[0].image.width}x{images[0].image.height} px, {rows}x{cols} codes, "
                f"{len(images[0].tokens)} tokens)"
            )
            return
        with (
            FolderLock(out, "--output"),
            fresh_folder(out, args.overwrite, "--output") as tmp,
            open(tmp / "images.jsonl", "w", encoding="utf-8") as f,
        ):
            for i, (p, im) in enumerate(zip(prompts, images)):
                name = f"{i:06d}.png"
                im.image.save(tmp / name)
                f.write(
                    json.dumps(
                        {
                            "index": i,
                            "prompt": p.text,
                            "negative_prompt": p.negative,
                            "seed": p.seed,
                            "cfg_scale": p.cfg_scale,
                            "height": p.height,
                            "width": p.width,
                            "png": name,
                            "grid": im.grid.tolist(),
                        }
                    )
                    + "\n"
                )
        print(f"wrote {len(images)} images and images.jsonl to {out}")

    return GenerationJob(generator.model, requests, finish, unit="image")
