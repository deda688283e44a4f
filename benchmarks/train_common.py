"""What the two training benchmarks (bench_train_llava, bench_train_emu3) share: their synthetic
shards, their command line and recipe overrides, the baseline's unpacking of packed rows and its
plain PyTorch training loop, and the per-step table they print."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_loader import make_shards
from benchmarks.common import ray_job_env
from mmdata.energon_loaders.batch import IGNORE_INDEX


def synth_shards(work: Path, num_samples: int, preprocess_job: bool = True, tokenizer: Path | None = None) -> Path:
    """Shards of `num_samples` synthetic Infinity-MM samples: `mmdata synth` + `mmdata preprocess`
    in child processes (`tokenizer`: its length index counts text tokens with it, exactly), or
    (`preprocess_job=False`, the `--quick` runs) the generator's records written straight as
    shards (bench_loader.make_shards: the shard format preprocess writes, without starting Ray)."""
    raw, shards = work / "raw", work / "shards"
    if not preprocess_job:
        return make_shards(shards, num_samples, seed=0)
    synth = ["mmdata.cli", "synth", "--dataset", "infinity-mm", "--output", str(raw)]
    preprocess = ["mmdata.preprocess.cli", "--no-progress", "--dataset", "infinity-mm", "--input", str(raw)]
    run_module(*synth, "--num-samples", str(num_samples), "--seed", "0")
    per_shard = str(max(1, num_samples // 4))
    exact = ["--tokenizer", str(tokenizer)] if tokenizer is not None else []
    run_module(
        *preprocess, "--output", str(shards), "--seed", "0", "--samples-per-shard", per_shard, "--num-cpus", "2", *exact
    )
    return shards


def run_module(*cmd: str) -> None:
    """`python -m CMD...` in the measured processes' environment; raises if it fails."""
    subprocess.run([sys.executable, "-m", *cmd], check=True, env=ray_job_env(), capture_output=True)


def add_run_args(ap: argparse.ArgumentParser, seq_length: int, data_help: str) -> None:
    """The options both benchmarks take; the data directory (`--shards` or `--tokens`) is each one's own."""
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokenizer", help=f"the tokenizer of {data_help}")
    ap.add_argument("--seq-length", type=int, default=seq_length)
    ap.add_argument("--num-samples", type=int, default=200, help=f"synthetic samples when {data_help} are built here")


def recipe_overrides(run_dir: Path, data: str | Path, tokenizer: str | Path, steps: int, seq_length: int) -> list[str]:
    """The tiny recipe's overrides of a measured run: `steps` steps, no checkpoints or tensorboard."""
    return [
        f"run_dir={run_dir}",
        f"data.paths=[{data}]",
        f"tokenizer.path={tokenizer}",
        f"train.iters={steps}",
        f"train.seq_length={seq_length}",
        "checkpoint.interval=0",
        "checkpoint.keep_last=1",
        "logging.tensorboard=false",
        "data.num_workers=1",
    ]


def sample_segments(batch) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """A packed batch's flat input ids and labels, and each real sample's (start, end) in them,
    row by row (a row's padding segment left out)."""
    _, s = batch.input_ids.shape
    ids, labels = batch.input_ids.reshape(-1), batch.labels.reshape(-1)
    cu = batch.cu_seqlens.tolist()
    by_row: dict[int, list[tuple[int, int]]] = {}
    for start, end in zip(cu[:-1], cu[1:]):
        if end > start:
            by_row.setdefault(start // s, []).append((start, end))
    return ids, labels, [seg for r, row in enumerate(batch.sample_ids) for seg in by_row.get(r, [])[: len(row)]]


def train_baseline(model, params: list, opt, prepared: list[list[dict]]) -> list[float]:
    """The baseline's plain PyTorch loop over `prepared` steps of HF inputs (labels already
    shifted, megatron's convention: position t predicts labels[t]): AdamW with the recipe's
    settings `opt`, grad accumulation, loss over label tokens, clipping; per-step seconds."""
    optimizer = torch.optim.AdamW(
        params, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, weight_decay=opt.weight_decay
    )
    times = []
    for micro_batches in prepared:
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
        for mb in micro_batches:
            logits = model(**{k: v for k, v in mb.items() if k not in ("labels", "real_tokens")}).logits
            flat = logits.float().reshape(-1, logits.shape[-1])
            loss = torch.nn.functional.cross_entropy(
                flat, mb["labels"].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            (loss / total).backward()
        torch.nn.utils.clip_grad_norm_(params, opt.clip_grad)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return times


def our_step_times(records: list[dict]) -> tuple[list[float], list[float]]:
    """Our steps' compute seconds (the logged data wait subtracted, like the baseline, whose
    batches were drawn and converted before timing) and those data waits, from metrics.jsonl."""
    waits = [r.get("data_wait_s", 0.0) for r in records]
    return [r["step_time_s"] - wait for r, wait in zip(records, waits)], waits


def print_step_table(real_tokens: list[int], base_times: list[float], our_times: list[float], warmup: int, note=""):
    print()
    print(f"{'step':>4} {'real tokens':>11} {'baseline s':>10} {'ours s':>8}{note}")
    for i, (n, a, b) in enumerate(zip(real_tokens, base_times, our_times), 1):
        print(f"{i:>4} {n:>11} {a:>10.3f} {b:>8.3f}{'  (warm-up)' if i <= warmup else ''}")
