"""GPU check of `mmtrain generate emu3`: the 8B-shaped Emu3 (random weights) generating a 512x512
image with classifier-free guidance, transformers' `generate` against our engine, same weights.

Requirements (and nothing else): a CUDA GPU with ~40 GB free; torch with CUDA; transformers >= 5
(Emu3); numpy and pyyaml (transformers' own dependencies); megatron-core 0.16 - only its Python
code runs, so the wheel can be carried and installed without dependencies:
    pip download megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 -d wheels/          (here, once)
    pip install --no-deps wheels/megatron_core-0.16.1-*.whl  (on the GPU machine)
and this repository on PYTHONPATH. Not needed: megatron-energon, Ray, Transformer Engine, apex.

    PYTHONPATH=. python benchmarks/gpu_check_generate.py [--steps 256] [--layers 32] [--size 512] [--full]

1. builds transformers' `Emu3ForConditionalGeneration` with `Emu3TextConfig()`'s 8B shape (32
   layers, hidden 4096, 32 heads / 8 KV heads, vocab 184622; random init, bf16, on the GPU) and a
   small VQ (the VQ is not timed);
2. copies its text weights into our megatron `Emu3Model` through the conversion adapter (in
   memory, no files);
3. the same prompt and negative prompt ids, greedy, guidance scale 3, the image structure of a
   `--size`^2 image (512: 64x64 codes, 4163 tokens): transformers' `guidance_scale` +
   `negative_prompt_ids` + `prefix_allowed_tokens_fn` (its docs' way; the allowed visual ids are
   handed over as a GPU tensor, kinder to it than the docs' list) against ours (conditional and
   unconditional rows in one forward). Each side generates 16 and then `--steps` tokens after a
   warm-up; the difference gives ms/token, and the seconds per image are EXTRAPOLATED as
   prefill + tokens_per_image x ms/token (later tokens attend to a longer cache on both sides, so
   both extrapolations are optimistic). `--full` generates whole images instead (at 32 layers
   about 2-4 minutes in all);
4. prints the first logits' difference and where the two sides' tokens first differ (bf16 kernels
   differ, so a late divergence is expected; the CPU tests check exact float32 parity).

Total runtime without --full: model build ~1 min, timing well under a minute. Ends with
    BENCH generate_emu3_cfg_gpu baseline=<s/image> ours=<s/image> unit=s/image ratio=<baseline/ours>
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from mmtrain.emu3.hf_reference import emu3_prefix_constraint

# Emu3's vocabulary layout (ids of the released tokenizer; only their roles matter with random weights)
PAD, EOL, EOF, BOS, EOS, IMG, BOI, EOI, FIRST_VISUAL = (
    151643,
    151846,
    151847,
    151849,
    151850,
    151851,
    151852,
    151853,
    151854,
)


def build_hf(args, device):
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3TextConfig

    text = Emu3TextConfig(attention_dropout=0.0)
    if args.layers:
        text.num_hidden_layers = args.layers
    if args.hidden:  # shrunk shapes: a CPU smoke test of this script
        text.hidden_size, text.intermediate_size, text.num_attention_heads = (
            args.hidden,
            2 * args.hidden,
            max(2, args.hidden // 128),
        )
        text.num_key_value_heads = max(1, text.num_attention_heads // 4)
    visual = {f"<|visual token {i:06d}|>": FIRST_VISUAL + i for i in range(text.vocab_size - FIRST_VISUAL)}
    specials = {
        "<|endoftext|>": PAD,
        "<|extra_200|>": EOL,
        "<|extra_201|>": EOF,
        "<|extra_203|>": BOS,
        "<|extra_204|>": EOS,
        "<|image token|>": IMG,
        "<|image start|>": BOI,
        "<|image end|>": EOI,
    }
    vq = dict(
        codebook_size=text.vocab_size - FIRST_VISUAL,
        base_channels=32,
        channel_multiplier=[1, 2, 2, 4],
        embed_dim=4,
        latent_channels=4,
        num_res_blocks=1,
        attn_resolutions=[],
        hidden_size=32,
        num_attention_heads=1,
    )
    config = Emu3Config(text_config=text.to_dict(), vq_config=vq, vocabulary_map={**visual, **specials})
    torch.manual_seed(0)
    with torch.device(device):
        model = Emu3ForConditionalGeneration._from_config(config, dtype=args.dtype)
    return model.eval()


def build_ours(hf, args):
    """Our Emu3Model with the HF model's text weights (the conversion's adapter, in memory)."""
    from mmtrain.emu3.model import Emu3Model
    from mmtrain.emu3.state_dict_adapter import Emu3StateDictAdapter, emu3_config_from_hf, normalize_emu3_hf_key
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.models.model_io import load_canonical
    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1)
    cfg = emu3_config_from_hf(hf.config.to_dict())
    cfg = replace(cfg, params_dtype={torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(args.dtype, "float32"))
    tensors = {normalize_emu3_hf_key(k): v for k, v in hf.state_dict().items()}
    adapter = Emu3StateDictAdapter(cfg)
    model = Emu3Model(cfg, options=ParallelOptions(perform_initialization=False))
    load_canonical(model, lambda name: adapter.mcore_tensor(name, tensors.__getitem__))
    return model.to(hf.device).eval(), cfg


def prompts(rows: int, cols: int):
    g = torch.Generator().manual_seed(1)
    header = [BOI, 21, 19, 9, 21, 19, IMG]  # "[boi] 64*64 [img]" (any ids will do with random weights)
    cond = [BOS, *torch.randint(0, PAD, (24,), generator=g).tolist(), *header]
    uncond = [BOS, *torch.randint(0, PAD, (12,), generator=g).tolist(), *header]
    return cond, uncond


def hf_side(hf, cond, uncond, rows, cols, device):
    visual = torch.arange(FIRST_VISUAL, hf.config.text_config.vocab_size, device=device)

    allowed = emu3_prefix_constraint(rows, cols, IMG, EOL, EOF, EOI, EOS, PAD, visual)

    ids = torch.tensor([cond], device=device)
    neg = torch.tensor([uncond], device=device)

    def run(n: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(
                ids,
                max_new_tokens=n,
                do_sample=False,
                guidance_scale=3.0,
                negative_prompt_ids=neg,
                prefix_allowed_tokens_fn=allowed,
                pad_token_id=PAD,
                eos_token_id=EOS,
            )
        return out[0, ids.shape[1] :].tolist()

    return run


def our_side(model, cfg, cond, uncond, rows, cols, device):
    from mmdata.energon_loaders.emu3.serialize import Emu3Vocab
    from mmtrain.emu3.generation import ImageStructure
    from mmtrain.generation.engine import GenerationModel, GenerationRequest, generate
    from mmtrain.generation.sampling import SamplingParams

    vocab = Emu3Vocab(
        bos=BOS,
        eos=EOS,
        pad=PAD,
        img=IMG,
        boi=BOI,
        eoi=EOI,
        eol=EOL,
        eof=EOF,
        placeholder=151646,
        visual=np.arange(FIRST_VISUAL, cfg.llm.vocab_size),
    )
    mask = torch.zeros(cfg.llm.vocab_size, dtype=torch.bool, device=device)
    mask[FIRST_VISUAL:] = True
    gm = GenerationModel(decoder=model.language_model, vocab_size=cfg.llm.vocab_size)

    def run(n: int) -> list[int]:
        req = GenerationRequest(
            prompt=cond,
            negative_prompt=uncond,
            guidance_scale=3.0,
            max_new_tokens=n,
            stop_token_ids=(EOS,),
            logits_processor=ImageStructure(rows, cols, vocab, mask),
        )
        return generate(gm, [req], SamplingParams())[0].tokens

    return run


def timed(run, n: int, sync) -> tuple[float, list[int]]:
    sync()
    t = time.perf_counter()
    tokens = run(n)
    sync()
    return time.perf_counter() - t, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=256, help="tokens timed per side (after 16 that time the prefill)")
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (8x8 codes per pixel block)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: Emu3's 32)")
    ap.add_argument("--hidden", type=int, default=None, help="shrink the hidden size (CPU smoke test of this script)")
    ap.add_argument("--full", action="store_true", help="generate whole images on both sides instead of extrapolating")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    args.dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    hf = build_hf(args, device)
    ours, cfg = build_ours(hf, args)
    rows = cols = args.size // 8
    per_image = (cols + 1) * rows + 3
    cond, uncond = prompts(rows, cols)
    steps = min(args.steps, per_image - 16)
    if not args.full and steps < 1:
        raise SystemExit(f"--size {args.size} gives {per_image} tokens per image: too few to time; use --full")
    print(
        f"built both models ({cfg.llm.num_layers} layers, hidden {cfg.llm.hidden_size}, vocab {cfg.llm.vocab_size}, "
        f"{args.dtype}) in {time.perf_counter() - t0:.0f} s; {args.size}x{args.size} = {per_image} tokens per image",
        flush=True,
    )
    with torch.no_grad():  # the first step's logits, conditional prompt
        ref = hf(input_ids=torch.tensor([cond], device=device)).logits[0, -1].float()
        from mmtrain.generation.decoder import CachedDecoder

        dec = CachedDecoder(ours.language_model, cfg.llm.vocab_size)
        got = dec.prefill([dec.embed(torch.tensor(cond))], 1)[0]
    print(
        f"prefill logits: max |ours - transformers| = {(got - ref).abs().max().item():.4f} "
        f"(logits scale {ref.abs().max().item():.2f})",
        flush=True,
    )
    results = {}
    for name, run in (
        ("transformers", hf_side(hf, cond, uncond, rows, cols, device)),
        ("ours", our_side(ours, cfg, cond, uncond, rows, cols, device)),
    ):
        run(4)  # warm-up
        if args.full:
            seconds, tokens = timed(run, per_image, sync)
            results[name] = dict(per_image=seconds, tokens=tokens, ms_per_token=1e3 * seconds / per_image)
            print(f"{name:>12}: {seconds:.1f} s for a whole image ({len(tokens)} tokens)", flush=True)
            continue
        short, _ = timed(run, 16, sync)
        long, tokens = timed(run, 16 + steps, sync)
        per_token = (long - short) / steps
        if per_token <= 0:  # a noisy clock (a shared CPU in a smoke run): the extrapolation means nothing
            raise SystemExit(
                f"{name}: {steps} more tokens took no longer than 16 ({long:.2f} s vs {short:.2f} s); "
                "rerun with a larger --steps, or --full"
            )
        prefill = max(0.0, short - 16 * per_token)
        results[name] = dict(per_image=prefill + per_image * per_token, tokens=tokens, ms_per_token=1e3 * per_token)
        print(
            f"{name:>12}: {1e3 * per_token:.2f} ms/token, prefill+setup {1e3 * prefill:.0f} ms -> "
            f"{results[name]['per_image']:.1f} s per image (extrapolated)",
            flush=True,
        )
    a, b = results["transformers"]["tokens"], results["ours"]["tokens"]
    first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(
        f"tokens: {len(a)} vs {len(b)}, identical for the first "
        f"{first_diff if first_diff is not None else min(len(a), len(b))}"
    )
    if device.type == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    base, mine = results["transformers"]["per_image"], results["ours"]["per_image"]
    print(
        json.dumps({k: {"s_per_image": v["per_image"], "ms_per_token": v["ms_per_token"]} for k, v in results.items()})
    )
    kind = "measured" if args.full else "extrapolated"
    print(
        f"BENCH generate_emu3_cfg_gpu baseline={base:.2f} ours={mine:.2f} unit=s/image({kind}) ratio={base / mine:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
