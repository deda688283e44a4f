"""Training throughput and peak memory on CPU: the tiny Emu3 recipe trained on the same batches by

  (a) baseline: `transformers.Emu3ForConditionalGeneration` (the recipe's sizes, random init) with
      a plain PyTorch loop, the way the Emu3 reference trains (HF model + Trainer/DeepSpeed): each
      step's samples unpacked and right-padded per micro-batch (the reference pads every sample
      to the full context; padding to the longest sample is kinder to the baseline), AdamW, grad
      accumulation, loss over label tokens;
  (b) ours: `mmtrain emu3` (megatron-core GPTModel on megatron DDP and schedules, packed THD
      micro-batches, loss over the true vocabulary).

Both see exactly the same samples per step: each side builds the loader the recipe describes
(same seed, so the same task draws and CFG caption drops) and the sample ids are checked to
match. Both are timed without data loading (the baseline's batches are drawn and converted
before timing; ours logs its data wait per step and it is subtracted). Each side runs in its own
process, so its peak RSS (`ru_maxrss`) is its own.
Throughput: real (non-padding) tokens per second, the median of the per-step rates after the
warm-up; with `--repeats N` the sides run alternately N times each and each side's best median
counts (robust to other work on a shared machine; every round is printed).

  python -m benchmarks.bench_train_emu3 [--steps 12] [--warmup 2] [--repeats 2] [--threads 1] [--seq-length 1024]
         [--tokens DIR --tokenizer DIR]   (default: built here: synth -> preprocess -> tiny VQ ->
                                           tokenize-images, tiny Emu3 tokenizer)
  python -m benchmarks.bench_train_emu3 --quick    # smoke run: 3 steps, 1 warm-up, 1 round, seq 512, 40 samples
                                                   # (written as shards without the preprocess job)

The sample check compares metrics' sample keys (`DATASET#SHARD_KEY`, what the trainer logs) with
the same keys of the baseline's batches, named by the trainer's own `batch_sample_ids`.

Ends with:
  BENCH train_emu3 baseline=<x> ours=<y> unit=tokens/s ratio=<ours/baseline>
  BENCH train_emu3_peak_rss baseline=<x> ours=<y> unit=GiB ratio=<baseline/ours>
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import train_common
from benchmarks.common import REPO, tokenize_images_args
from benchmarks.sample_parity import SampleParityError, check_rounds_match
from mmdata.energon_loaders.batch import IGNORE_INDEX

RECIPE = REPO / "recipes" / "emu3-tiny.yaml"


def build_data(work: Path, num_samples: int = 200, preprocess_job: bool = True) -> tuple[Path, Path]:
    """Token shards of synthetic Infinity-MM samples (synth -> preprocess -> tiny VQ ->
    tokenize-images) and the tiny Emu3 tokenizer. `preprocess_job=False` (`--quick`): the
    generator's records written straight as shards (bench_loader.make_shards, no Ray job for them)."""
    from mmdata.dev.tiny_emu3_tokenizer import build_tiny_emu3_tokenizer
    from mmdata.dev.tiny_vq_model import build_tiny_vq

    shards, tokens = train_common.synth_shards(work, num_samples, preprocess_job), work / "tokens"
    vq = build_tiny_vq(work / "vq", seed=0)
    tokenize = tokenize_images_args(shards, vq, tokens, 4096, "--num-cpus", "2")
    train_common.run_module("mmdata.vision_tokens.cli", "--no-progress", *tokenize)
    return tokens, build_tiny_emu3_tokenizer(work / "tokenizer")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux


# ----------------------------------------------------------------------------- baseline


def unpack_to_hf(batch) -> dict:
    """One packed Emu3Batch -> HF inputs for the same samples, one per row, right-padded."""
    ids, labels, segments = train_common.sample_segments(batch)
    longest = max(end - start for start, end in segments)
    out = {
        "input_ids": torch.zeros(len(segments), longest, dtype=torch.long),
        "attention_mask": torch.zeros(len(segments), longest, dtype=torch.long),
        "labels": torch.full((len(segments), longest), IGNORE_INDEX, dtype=torch.long),
    }
    for i, (start, end) in enumerate(segments):
        n = end - start
        out["input_ids"][i, :n], out["labels"][i, :n], out["attention_mask"][i, :n] = (
            ids[start:end],
            labels[start:end],
            1,
        )
    return out


def hf_emu3(recipe, vocabulary_map: dict):
    """Emu3ForConditionalGeneration with the recipe's decoder (no dropout, as ours) and a small
    VQ config (unused here: images arrive as visual tokens)."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    from mmtrain.emu3.state_dict_adapter import hf_config_from_emu3
    from mmdata.dev.tiny_vq import TINY_VQ_CONFIG

    cfg = hf_config_from_emu3(recipe.model)
    text = {k: v for k, v in cfg["text_config"].items() if k not in ("attention_bias", "mlp_bias", "model_type")}
    torch.manual_seed(recipe.seed)
    config = Emu3Config(
        text_config={**text, "attention_dropout": 0.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        vq_config={**TINY_VQ_CONFIG, "codebook_size": 512},
        vocabulary_map=vocabulary_map,
    )
    return Emu3ForConditionalGeneration(config).train()


def run_baseline(recipe, steps: list[list], threads: int) -> list[float]:
    torch.set_num_threads(threads)
    from transformers import AutoTokenizer

    model = hf_emu3(recipe, AutoTokenizer.from_pretrained(recipe.tokenizer.path).get_vocab())
    params = [p for n, p in model.named_parameters() if "vqmodel" not in n]  # the reference trains the LM
    prepared = [[unpack_to_hf(mb) for mb in step] for step in steps]
    return train_common.train_baseline(model, params, recipe.optimizer, prepared)


# ----------------------------------------------------------------------------- one side


def side(name: str, overrides: list[str], steps_n: int, threads: int, out: Path) -> None:
    from mmtrain import registry
    from mmtrain.config import load_recipe

    from mmtrain.runtime.train_data import batch_sample_ids

    recipe = load_recipe(RECIPE, overrides, family="emu3")
    result: dict = {}
    if name == "baseline":
        spec = registry.get_family("emu3")
        per_step = recipe.train.global_batch_size // recipe.train.micro_batch_size
        loader = spec.build_loader(recipe, dp_rank=0, dp_size=1)
        it = iter(loader)
        steps = [[next(it) for _ in range(per_step)] for _ in range(steps_n)]
        del it, loader
        result["real_tokens"] = [sum(int(mb.num_real_tokens) for mb in step) for step in steps]
        # named as the trainer names them in metrics.jsonl (the unique sample keys): like with like
        result["sample_ids"] = [[sid for mb in step for sid in batch_sample_ids(mb)] for step in steps]
        result["tasks"] = [[t for mb in step for row in mb.tasks for t in row] for step in steps]
        result["times"] = run_baseline(recipe, steps, threads)
    else:
        os.environ["MMTRAIN_CPU_THREADS"] = str(threads)
        from mmtrain.registry import get_family
        from mmtrain.runtime.logs import setup_logging
        from mmtrain.runtime.training import train

        setup_logging()
        train(recipe, get_family(recipe.family))
        records = [json.loads(x) for x in (Path(recipe.run_dir) / "metrics.jsonl").read_text().splitlines()]
        result["times"], result["waits"] = train_common.our_step_times(records)
        result["sample_ids"] = [r["sample_ids"] for r in records]
        result["loss"] = [records[0]["loss"], records[-1]["loss"]]
    result["peak_rss_gib"] = peak_rss_gib()
    out.write_text(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per side; the best median counts")
    ap.add_argument("--tokens", help="token shards (mmdata tokenize-images output)")
    train_common.add_run_args(ap, seq_length=1024, data_help="the token shards")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 3 steps, 1 warm-up, 1 round, seq 512, 40 samples written without the preprocess job",
    )
    ap.add_argument("--side", choices=["baseline", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats, args.seq_length, args.num_samples = 3, 1, 1, 512, 40

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-train-emu3-"))
    if args.side is None and not (args.tokens and args.tokenizer):
        print("building synthetic shards -> tiny VQ token shards + tiny Emu3 tokenizer ...", flush=True)
        args.tokens, args.tokenizer = map(str, build_data(work, args.num_samples, preprocess_job=not args.quick))
    overrides = train_common.recipe_overrides(
        work / (args.side or "run"), args.tokens, args.tokenizer, args.steps, args.seq_length
    )
    if args.side is not None:
        side(args.side, overrides, args.steps, args.threads, Path(args.out))
        return 0

    runs: dict[str, list[dict]] = {"baseline": [], "ours": []}
    what = {"baseline": "HF Emu3ForConditionalGeneration, plain PyTorch loop", "ours": "mmtrain emu3 (megatron-core)"}
    for rnd in range(args.repeats):
        for name in ("baseline", "ours") if rnd % 2 == 0 else ("ours", "baseline"):
            print(f"round {rnd + 1}: {name}: {what[name]}, {args.steps} steps", flush=True)
            out, run_work = work / f"{name}.json", work / f"round{rnd}"  # a fresh run dir: no resume
            cmd = [
                sys.executable,
                __file__,
                "--side",
                name,
                "--out",
                str(out),
                "--work",
                str(run_work),
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
                "--seq-length",
                str(args.seq_length),
                "--tokens",
                args.tokens,
                "--tokenizer",
                args.tokenizer,
            ]
            subprocess.run(
                cmd,
                check=True,
                env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            runs[name].append(json.loads(out.read_text()))
    real_tokens = runs["baseline"][0]["real_tokens"]
    try:
        check_rounds_match(runs)
    except SampleParityError as e:
        raise SystemExit(str(e)) from None

    w = args.warmup
    tokens = sum(real_tokens[w:])
    rate = lambda times: statistics.median(n / t for n, t in zip(real_tokens[w:], times[w:]))  # noqa: E731
    for name in runs:
        runs[name].sort(key=lambda r: -rate(r["times"]))  # best first
    base, ours = runs["baseline"][0], runs["ours"][0]
    b_rate, o_rate = rate(base["times"]), rate(ours["times"])
    tasks = [t for step in base["tasks"] for t in step]
    train_common.print_step_table(real_tokens, base["times"], ours["times"], w, note="   (each side's best round)")
    for name in runs:
        print(f"{name} median tokens/s per round: " + ", ".join(f"{rate(r['times']):.1f}" for r in runs[name]))
    print(
        f"\nCPU, {args.threads} thread(s), seq {args.seq_length}; samples: {tasks.count('understanding')} "
        f"understanding, "
        f"{tasks.count('generation')} generation; median tokens/s over steps {w + 1}..{args.steps} "
        f"(totals: baseline {tokens / sum(base['times'][w:]):.1f}, ours {tokens / sum(ours['times'][w:]):.1f}); "
        f"ours' data wait left out (mean {statistics.mean(ours['waits'][w:]):.3f} s/step)"
    )
    print(
        f"peak RSS: baseline {base['peak_rss_gib']:.2f} GiB, ours {ours['peak_rss_gib']:.2f} GiB "
        "(whole process: Python, torch, the model, its optimizer, activations)"
    )
    print(f"loss ours: {ours['loss'][0]:.3f} -> {ours['loss'][1]:.3f}")
    print(f"BENCH train_emu3 baseline={b_rate:.1f} ours={o_rate:.1f} unit=tokens/s ratio={o_rate / b_rate:.2f}")
    print(
        f"BENCH train_emu3_peak_rss baseline={base['peak_rss_gib']:.2f} ours={ours['peak_rss_gib']:.2f} unit=GiB "
        f"ratio={base['peak_rss_gib'] / ours['peak_rss_gib']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
