"""Training throughput on CPU: the tiny LLaVA-OV recipe trained on the same batches by

  (a) baseline: `transformers.LlavaOnevisionForConditionalGeneration` (same tiny config, random
      init) with a plain PyTorch loop, the way LLaVA-NeXT trains: each step's samples unpacked
      and right-padded per micro-batch, AdamW, grad accumulation, loss over label tokens;
  (b) ours: `mmtrain llava-ov` (megatron-core GPTModel + SigLIP on megatron DDP, schedules,
      packed THD micro-batches), in this process.

Both see exactly the same samples per step: the batches are drawn once from the energon loader
the recipe builds (ours draws the same stream itself; the sample ids are checked to match).
Both are timed without data loading (the baseline's batches are converted before timing; ours
logs its data wait per step and it is subtracted).
Throughput: real (non-padding) tokens per second, the median of the per-step rates after the
warm-up (robust to a stalled step on a shared machine; the totals are printed too).

  python -m benchmarks.bench_train_llava [--quick] [--steps 12] [--warmup 2] [--threads 1]
         [--shards DIR --tokenizer DIR]    (default: built here from `mmdata synth`)

`--quick` (a smoke run, seconds of training): 3 steps, 1 warm-up, seq 512, 40 synthetic samples
written as shards in this process (no preprocess job: not what is measured).
The sample check compares metrics' sample keys (`DATASET#SHARD_KEY`, what the trainer logs) with
the same keys of the baseline's batches, named by the trainer's own `batch_sample_ids`.

Ends with: BENCH train_llava baseline=<x> ours=<y> unit=tokens/s ratio=<ours/baseline>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import train_common
from benchmarks.common import REPO
from benchmarks.sample_parity import SampleParityError, check_logged_steps_match
from mmdata.energon_loaders.batch import IGNORE_INDEX

RECIPE = REPO / "recipes" / "llava-ov-tiny.yaml"


def build_data(work: Path, num_samples: int = 200, ray_job: bool = True) -> tuple[Path, Path]:
    """Synthetic Infinity-MM shards made by `mmdata synth` + `mmdata preprocess`, and the tiny
    tokenizer. `ray_job=False` (`--quick`): the same generator's records written straight as shards
    (train_common.synth_shards)."""
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    shards = train_common.synth_shards(work, num_samples, preprocess_job=ray_job)
    return shards, build_tiny_qwen2_tokenizer(work / "tokenizer")


# ----------------------------------------------------------------------------- baseline inputs


def unpack_to_hf(batch, cfg) -> dict:
    """One packed LlavaOVBatch -> HF inputs for the same samples, unpacked and right-padded."""
    from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES

    ids, labels, segments = train_common.sample_segments(batch)
    media_tokens = batch.num_media_tokens.tolist()
    tile_starts = [0] + torch.cumsum(batch.tiles_per_media, 0).tolist()
    is_media = (ids == cfg.image_token_id) | (ids == cfg.video_token_id)
    samples, media_i = [], 0
    for start, end in segments:
        need, images = int(is_media[start:end].sum()), []
        while need > 0:
            kind = int(batch.media_kind[media_i])
            if kind not in (0, 1):
                raise SystemExit("baseline: video samples are not supported by this benchmark")
            tiles = batch.pixel_values[tile_starts[media_i] : tile_starts[media_i + 1]]
            images.append((tiles, batch.image_sizes[media_i].tolist(), kind == MEDIA_ANYRES))
            need -= media_tokens[media_i]
            media_i += 1
        samples.append((ids[start:end], labels[start:end], images))
    max_len = max(len(x[0]) for x in samples)
    input_ids = torch.zeros(len(samples), max_len, dtype=torch.long)
    hf_labels = torch.full((len(samples), max_len), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros(len(samples), max_len, dtype=torch.long)
    pixel, sizes, per_sample = [], [], []
    for i, (sid, slab, images) in enumerate(samples):
        n = len(sid)
        input_ids[i, :n], hf_labels[i, :n], attention[i, :n] = sid, slab, 1
        per_sample.append(len(images))
        for tiles, size, _anyres in images:
            pixel.append(tiles)
            sizes.append(size)
    out = {"input_ids": input_ids, "attention_mask": attention, "labels": hf_labels}
    if pixel:
        max_tiles = max(t.shape[0] for t in pixel)
        pv = torch.zeros(len(pixel), max_tiles, *pixel[0].shape[1:])
        for i, t in enumerate(pixel):
            pv[i, : t.shape[0]] = t
        out.update(pixel_values=pv, image_sizes=torch.tensor(sizes), batch_num_images=torch.tensor(per_sample))
    out["real_tokens"] = int(attention.sum())
    return out


def run_baseline(recipe, steps: list[list], threads: int) -> list[float]:
    """Plain PyTorch loop on HF LLaVA-OV; returns per-step seconds."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    from mmtrain.llava_ov.state_dict_adapter import hf_config_from_llava

    torch.set_num_threads(threads)
    cfg = hf_config_from_llava(recipe.model)
    cfg.pop("model_type", None)
    cfg.pop("architectures", None)
    torch.manual_seed(recipe.seed)
    model = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(**cfg)).train()
    prepared = [[unpack_to_hf(mb, recipe.model) for mb in step] for step in steps]
    return train_common.train_baseline(model, list(model.parameters()), recipe.optimizer, prepared)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards")
    train_common.add_run_args(ap, seq_length=2048, data_help="the shards")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 3 steps, 1 warm-up, seq 512, 40 samples written without the preprocess job",
    )
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.seq_length, args.num_samples = 3, 1, 512, 40

    from mmtrain import registry
    from mmtrain.config import load_recipe

    work = Path(tempfile.mkdtemp(prefix="bench-train-llava-"))
    if args.shards and args.tokenizer:
        shards, tokenizer = Path(args.shards), Path(args.tokenizer)
    else:
        print("building synthetic shards + tiny tokenizer ...", flush=True)
        shards, tokenizer = build_data(work, args.num_samples, ray_job=not args.quick)
    overrides = train_common.recipe_overrides(work / "run", shards, tokenizer, args.steps, args.seq_length)
    recipe = load_recipe(RECIPE, overrides, family="llava-ov")
    spec = registry.get_family("llava-ov")
    t = recipe.train
    per_step = t.global_batch_size // t.micro_batch_size

    # the exact micro-batches the training run will draw (same loader, same seed)
    loader = spec.build_loader(recipe, dp_rank=0, dp_size=1)
    it = iter(loader)
    steps = [[next(it) for _ in range(per_step)] for _ in range(args.steps)]
    del it, loader
    real_tokens = [sum(int(mb.num_real_tokens) for mb in step) for step in steps]

    print(
        f"baseline: HF LlavaOnevisionForConditionalGeneration, {args.steps} steps x {per_step} micro-batches",
        flush=True,
    )
    base_times = run_baseline(recipe, steps, args.threads)

    print("ours: mmtrain llava-ov (megatron-core) in this process", flush=True)
    os.environ["MMTRAIN_CPU_THREADS"] = str(args.threads)
    from mmtrain.runtime.logs import setup_logging
    from mmtrain.runtime.training import train

    setup_logging()
    train(recipe, spec)
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    try:
        check_logged_steps_match(records, steps)
    except SampleParityError as e:
        raise SystemExit(str(e)) from None
    our_times, our_waits = train_common.our_step_times(records)

    w = args.warmup
    tokens = sum(real_tokens[w:])
    # the median of per-step rates: robust to a stalled step on a shared machine
    baseline = statistics.median(n / t for n, t in zip(real_tokens[w:], base_times[w:]))
    ours = statistics.median(n / t for n, t in zip(real_tokens[w:], our_times[w:]))
    train_common.print_step_table(real_tokens, base_times, our_times, w)
    print(
        f"\nCPU, {args.threads} thread(s); median tokens/s over steps {w + 1}..{args.steps} "
        f"(totals: baseline {tokens / sum(base_times[w:]):.1f}, ours {tokens / sum(our_times[w:]):.1f}); "
        f"ours' data wait left out (mean {statistics.mean(our_waits[w:]):.3f} s/step)"
    )
    print(f"loss ours: {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    print(f"BENCH train_llava baseline={baseline:.1f} ours={ours:.1f} unit=tokens/s ratio={ours / baseline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
