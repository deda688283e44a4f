"""Generation throughput and peak memory on CPU, transformers `generate` against `mmtrain generate`'s
engine, on the same tiny random models (built here from configs, saved as HF dirs, converted to
megatron checkpoints for our side), same prompts, greedy:

  emu3_cfg   text-to-image with classifier-free guidance (scale 3, a negative prompt) and Emu3's
             image structure: transformers' `guidance_scale` + `negative_prompt_ids` +
             `prefix_allowed_tokens_fn` (its docs' and the Emu3 reference's way; the unconditional
             pass is a second, separate forward per step) against ours (conditional and
             unconditional rows in one forward, the structure as a tensor mask).
  llava_ov   answers about an image: transformers' `LlavaOnevisionForConditionalGeneration.generate`
             on `LlavaOnevisionProcessor` inputs against ours on the converted checkpoint.

Each side runs in its own process (so its peak RSS is its own), alternating, `--repeats` rounds;
each side's best round counts (`--quick` runs the four sides in one process: it checks that the
benchmark runs and the tokens agree, its peak RSS figures are not the sides' own). One warm-up generation per side is
not timed. Rates divide by
the side's CPU time by default (`--clock cpu`: with one torch thread per side that is the time
it computed, whatever else the machine runs; `--clock wall` for wall time; both are printed per
round). The generated tokens of both sides are compared (they must be equal: greedy on the
same weights).

  python -m benchmarks.bench_generate [--prompts 4] [--size 128] [--batch-size 1] [--repeats 2]
         [--threads 1] [--layers 4 --hidden 256] [--llava-new-tokens 48]
  python -m benchmarks.bench_generate --quick     # smoke run: 1 prompt, 64 px, 1 round, 2 x 128 Emu3, 16 new tokens,
                                                  # the four sides in one process

`--batch-size B` generates B prompts per call on both sides (transformers left-pads them).
Ends with:
  BENCH generate_emu3_cfg baseline=<x> ours=<y> unit=images/s ratio=<ours/baseline>
  BENCH generate_emu3_cfg_tokens baseline=<x> ours=<y> unit=tokens/s ratio=<ours/baseline>
  BENCH generate_emu3_cfg_peak_rss baseline=<x> ours=<y> unit=GiB ratio=<baseline/ours>
  BENCH generate_llava_ov baseline=<x> ours=<y> unit=tokens/s ratio=<ours/baseline>
  BENCH generate_llava_ov_peak_rss baseline=<x> ours=<y> unit=GiB ratio=<baseline/ours>
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.tiny_models import random_hf_emu3, text_config, vision_config

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = [
    "a red bus parked next to a tall building on a sunny day",
    "a cat sleeping on a wooden table",
    "a dog running on the grass under a blue sky",
    "a cup of coffee near the window",
    "three people walking in a park",
    "a chart of the main trend from 2019 to 2024",
    "a small boat on the sea at night",
    "a bowl of fruit on a kitchen counter",
]
NEGATIVE = "lowres, bad anatomy, blurry, worst quality"
QUESTIONS = [
    "What is shown in this picture?",
    "Describe the image in detail.",
    "What color is the car?",
    "How many people are in the photo?",
    "Where is the dog?",
    "Please read the text in the chart.",
]


def peak_rss_gib() -> float:
    """This process's peak resident memory: VmHWM (ru_maxrss would carry the driver's peak over
    the fork + exec that started this side)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / (1 << 20)  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


# ----------------------------------------------------------------------------- assets


def build_assets(work: Path, layers: int, hidden: int) -> dict:
    """Tiny random HF Emu3 and LLaVA-OV dirs (with tokenizers) and their megatron conversions."""
    import torch
    from transformers import (
        AutoTokenizer,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
    )

    from mmdata.dev.tiny_emu3_tokenizer import build_tiny_emu3_tokenizer
    from mmdata.energon_loaders.llava_ov import anyres
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from mmdata.dev.tiny_vq_model import build_tiny_vq
    from mmtrain.cli import main as mmtrain

    torch.manual_seed(0)
    # Emu3: the tiny tokenizer + tiny VQ, a decoder of the requested size
    tok_dir, vq_dir = build_tiny_emu3_tokenizer(work / "emu3_tok"), build_tiny_vq(work / "vq", seed=0)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    heads = max(2, hidden // 64)
    shape = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=max(1, heads // 2), max_positions=8192)
    emu3 = random_hf_emu3(tok, vq_dir, **shape, noise=0.05)
    emu3_hf = _save(emu3, work / "emu3_hf", [tok_dir.iterdir(), [vq_dir / "preprocessor_config.json"]])
    # LLaVA-OV: the tiny Qwen2 tokenizer, a 2-layer Qwen2 and a 2-layer SigLIP at 30 px
    qtok_dir = build_tiny_qwen2_tokenizer(work / "qwen2_tok")
    qtok = AutoTokenizer.from_pretrained(qtok_dir)
    cfg = LlavaOnevisionConfig(
        text_config=text_config(vocab_size=len(qtok)),
        vision_config=vision_config(),
        image_token_index=qtok.convert_tokens_to_ids("<image>"),
        video_token_index=qtok.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints(30, 6)],
        tie_word_embeddings=True,
    )
    llava = LlavaOnevisionForConditionalGeneration(cfg).eval()
    _perturb(llava, "vision", 0.3)
    llava_hf = _save(llava, work / "llava_hf", [qtok_dir.iterdir()])
    out = {"emu3_hf": str(emu3_hf), "llava_hf": str(llava_hf)}
    for name, family in (("emu3", "emu3"), ("llava", "llava-ov")):
        dst = work / f"{name}_mcore"
        if mmtrain(["convert", "hf-to-mcore", "--model", family, "--src", out[f"{name}_hf"], "--dst", str(dst)]) != 0:
            raise SystemExit(f"conversion of {name} failed")
        out[f"{name}_mcore"] = str(dst)
    return out


def _perturb(model, skip: str, scale: float) -> None:
    """Random non-trivial weights (norms included), so greedy outputs vary."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if skip not in name:
                p.add_(torch.randn_like(p) * scale)


def _save(model, out: Path, extra_files) -> Path:
    model.save_pretrained(out)
    for files in extra_files:
        for f in files:
            shutil.copy2(f, out / f.name)
    return out


def test_image(i: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(i)
    h, w = [(47, 95), (120, 61), (30, 30), (64, 64)][i % 4]
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


# ----------------------------------------------------------------------------- one side


def run_side(side: str, assets: dict, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    fn = {"hf_emu3": hf_emu3, "ours_emu3": ours_emu3, "hf_llava": hf_llava, "ours_llava": ours_llava}[side]
    run, n_outputs = fn(assets, args)
    run(warmup=True)
    t, cpu = time.perf_counter(), time.process_time()
    tokens = run(warmup=False)
    return {
        "wall": time.perf_counter() - t,
        "cpu": time.process_time() - cpu,
        "outputs": n_outputs,
        "tokens": tokens,
        "n_tokens": sum(len(x) for x in tokens),
        "peak_rss_gib": peak_rss_gib(),
    }


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def hf_emu3(assets: dict, args):
    import torch
    from transformers import AutoTokenizer, Emu3ForConditionalGeneration, Emu3ImageProcessor, Emu3Processor

    from mmtrain.emu3.hf_reference import emu3_prefix_constraint

    model = Emu3ForConditionalGeneration.from_pretrained(assets["emu3_hf"]).eval()
    tok = AutoTokenizer.from_pretrained(assets["emu3_hf"], padding_side="left")
    proc = Emu3Processor(Emu3ImageProcessor.from_pretrained(assets["emu3_hf"]), tok, chat_template=None)
    vmap = model.model.vocabulary_mapping
    visual, eol = vmap.image_tokens, vmap.vocab_map["<|extra_200|>"]
    eof, eoi, img = vmap.vocab_map["<|extra_201|>"], vmap.vocab_map["<|image end|>"], vmap.vocab_map["<|image token|>"]
    eos, pad = model.config.text_config.eos_token_id, model.config.text_config.pad_token_id

    def run(warmup: bool):
        prompts = CAPTIONS[: 1 if warmup else args.prompts]
        out = []
        for chunk in _batches(prompts, args.batch_size):
            kw = dict(
                return_for_image_generation=True, image_area=args.size * args.size, padding=True, return_tensors="pt"
            )
            inputs = proc(text=chunk, **kw)
            neg = proc(text=[NEGATIVE] * len(chunk), **kw)
            rows, cols = (int(x) for x in inputs.pop("image_sizes")[0])

            allowed = emu3_prefix_constraint(rows, cols, img, eol, eof, eoi, eos, pad, visual)

            with torch.no_grad():
                seq = model.generate(
                    **inputs,
                    max_new_tokens=(cols + 1) * rows + 3,
                    do_sample=False,
                    guidance_scale=3.0,
                    negative_prompt_ids=neg.input_ids,
                    negative_prompt_attention_mask=neg.attention_mask,
                    prefix_allowed_tokens_fn=allowed,
                    pad_token_id=pad,
                )
            out += [row.tolist() for row in seq[:, inputs.input_ids.shape[1] :]]
        return out

    return run, args.prompts


def ours_emu3(assets: dict, args):
    from mmtrain.emu3.generation import Emu3ImageGenerator, ImagePrompt
    from mmtrain.generation.checkpoint import Placement, resolve_checkpoint
    from mmtrain.generation.engine import generate
    from mmtrain.generation.sampling import SamplingParams

    ref = resolve_checkpoint(assets["emu3_mcore"], "emu3")
    gen = Emu3ImageGenerator(
        ref, Placement.resolve("cpu"), tokenizer_dir=ref.assets, vq_dir=ref.assets / "vq", decode_images=False
    )

    def run(warmup: bool):
        prompts = [
            ImagePrompt(c, args.size, args.size, negative=NEGATIVE) for c in CAPTIONS[: 1 if warmup else args.prompts]
        ]
        results = generate(gen.model, [gen.request(p) for p in prompts], SamplingParams(), batch_size=args.batch_size)
        return [r.tokens for r in results]

    return run, args.prompts


def hf_llava(assets: dict, args):
    import torch
    from transformers import AutoTokenizer, LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessorPil
    from transformers import LlavaOnevisionProcessor

    from mmdata.energon_loaders.llava_ov import anyres

    class Processor(LlavaOnevisionProcessor):  # images only: no (torchvision) video processor
        def check_argument_for_proper_class(self, name, argument):
            return (
                None
                if name == "video_processor" and argument is None
                else super().check_argument_for_proper_class(name, argument)
            )

    model = LlavaOnevisionForConditionalGeneration.from_pretrained(assets["llava_hf"]).eval()
    tok = AutoTokenizer.from_pretrained(assets["llava_hf"], padding_side="left")
    image_proc = LlavaOnevisionImageProcessorPil(
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"height": 30, "width": 30},
        image_grid_pinpoints=[list(p) for p in anyres.grid_pinpoints(30, 6)],
    )
    proc = Processor(
        image_processor=image_proc,
        tokenizer=tok,
        video_processor=None,
        num_image_tokens=4,
        vision_feature_select_strategy="full",
    )

    def run(warmup: bool):
        out = []
        n = 1 if warmup else args.prompts
        for i in range(n):
            text = tok.apply_chat_template(
                [{"role": "user", "content": "<image>\n" + QUESTIONS[i % len(QUESTIONS)]}],
                tokenize=False,
                add_generation_prompt=True,
            )
            inputs = proc(images=[test_image(i)], text=[text], return_tensors="pt")
            with torch.no_grad():
                seq = model.generate(
                    **inputs,
                    max_new_tokens=args.llava_new_tokens,
                    do_sample=False,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            out.append(seq[0, inputs.input_ids.shape[1] :].tolist())
        return out

    return run, args.prompts


def ours_llava(assets: dict, args):
    from mmtrain.generation.checkpoint import Placement, resolve_checkpoint
    from mmtrain.generation.sampling import SamplingParams
    from mmtrain.llava_ov.generation import LlavaOVChat

    ref = resolve_checkpoint(assets["llava_mcore"], "llava-ov")
    chat = LlavaOVChat(ref, Placement.resolve("cpu"), tokenizer_dir=ref.assets)

    def run(warmup: bool):
        out = []
        for i in range(1 if warmup else args.prompts):
            prompt = chat.prompt(QUESTIONS[i % len(QUESTIONS)], test_image(i))
            out.append(chat.generate([prompt], SamplingParams(), max_new_tokens=args.llava_new_tokens)[0].tokens)
        return out

    return run, args.prompts


# ----------------------------------------------------------------------------- driver


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts (images / questions) per side and round")
    ap.add_argument("--size", type=int, default=128, help="Emu3 image side in pixels (128 -> 16x16 codes, 275 tokens)")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per generate call, both sides")
    ap.add_argument("--repeats", type=int, default=2, help="rounds per side (alternating); each side's best counts")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per side")
    ap.add_argument("--layers", type=int, default=4, help="tiny Emu3 decoder layers")
    ap.add_argument("--hidden", type=int, default=256, help="tiny Emu3 hidden size (heads of 64)")
    ap.add_argument("--llava-new-tokens", type=int, default=48, help="LLaVA-OV max new tokens per answer")
    ap.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="what the rates divide by: the side's CPU seconds (default: single-threaded sides on a "
        "shared machine are timed by the CPU time they got) or wall seconds",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 prompt, 64x64 images, 1 round, a 2-layer x 128 Emu3, 16 LLaVA-OV new tokens, "
        "the four sides in one process (peak RSS not per side)",
    )
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--assets", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.size, args.repeats, args.layers, args.hidden, args.llava_new_tokens = 1, 64, 1, 2, 128, 16
    if args.side:  # one or more sides (comma-separated), in this process: {side: result}
        assets = json.loads(args.assets)
        res = {side: run_side(side, assets, args) for side in args.side.split(",")}
        Path(args.result).write_text(json.dumps(res))
        return 0

    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        work = Path(tmp)
        print(f"building tiny models (Emu3 {args.layers} layers x {args.hidden}, LLaVA-OV 2 x 64) ...", flush=True)
        assets = build_assets(work, args.layers, args.hidden)
        sides = ["hf_emu3", "ours_emu3", "hf_llava", "ours_llava"]
        groups = [",".join(sides)] if args.quick else sides  # --quick: one process, its imports paid once
        best: dict[str, dict] = {}
        for r in range(args.repeats):
            for group in groups:
                out = work / "result.json"
                cmd = [sys.executable, __file__, "--side", group, "--assets", json.dumps(assets), "--result", str(out)]
                cmd += [
                    f"--{k.replace('_', '-')}={v}"
                    for k, v in vars(args).items()
                    if k not in ("side", "assets", "result", "quick") and v is not None
                ]
                subprocess.run(cmd, check=True, cwd=REPO)
                for side, res in json.loads(out.read_text()).items():
                    print(
                        f"round {r + 1} {side:>10}: {res['wall']:.2f} s wall, {res['cpu']:.2f} s CPU, "
                        f"{res['outputs']} outputs, {res['n_tokens']} tokens, peak RSS {res['peak_rss_gib']:.2f} GiB",
                        flush=True,
                    )
                    if side not in best or res[args.clock] < best[side][args.clock]:
                        best[side] = res
    return report(best, args.clock)


def report(best: dict, clock: str) -> int:
    equal = {fam: best[f"hf_{fam}"]["tokens"] == best[f"ours_{fam}"]["tokens"] for fam in ("emu3", "llava")}
    rate = lambda side, key: best[side][key] / best[side][clock]  # noqa: E731
    rows = [
        ("emu3 CFG images/s", rate("hf_emu3", "outputs"), rate("ours_emu3", "outputs")),
        ("emu3 CFG tokens/s", rate("hf_emu3", "n_tokens"), rate("ours_emu3", "n_tokens")),
        ("emu3 peak RSS GiB", best["hf_emu3"]["peak_rss_gib"], best["ours_emu3"]["peak_rss_gib"]),
        ("llava-ov tokens/s", rate("hf_llava", "n_tokens"), rate("ours_llava", "n_tokens")),
        ("llava-ov peak RSS GiB", best["hf_llava"]["peak_rss_gib"], best["ours_llava"]["peak_rss_gib"]),
    ]
    print(f"\n{'metric (' + clock + ' time)':<24}{'transformers':>14}{'ours':>12}")
    for name, b, o in rows:
        print(f"{name:<24}{b:>14.3f}{o:>12.3f}")
    print(f"tokens equal to transformers' (greedy): emu3 {equal['emu3']}, llava-ov {equal['llava']}")
    (_, bi, oi), (_, bt, ot), (_, br, orr), (_, lb, lo), (_, lbr, lor) = rows
    print(f"BENCH generate_emu3_cfg baseline={bi:.3f} ours={oi:.3f} unit=images/s ratio={oi / bi:.2f}")
    print(f"BENCH generate_emu3_cfg_tokens baseline={bt:.1f} ours={ot:.1f} unit=tokens/s ratio={ot / bt:.2f}")
    print(f"BENCH generate_emu3_cfg_peak_rss baseline={br:.2f} ours={orr:.2f} unit=GiB ratio={br / orr:.2f}")
    print(f"BENCH generate_llava_ov baseline={lb:.1f} ours={lo:.1f} unit=tokens/s ratio={lo / lb:.2f}")
    print(f"BENCH generate_llava_ov_peak_rss baseline={lbr:.2f} ours={lor:.2f} unit=GiB ratio={lbr / lor:.2f}")
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
