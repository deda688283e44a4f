"""Loader throughput of the global order (`data.sharding: global`, packing planned from the length
index, rows read by random access) against today's online packer (energon's stream and a
256-sample packing buffer), on bench_loader's mix (issue 46: "throughput no worse than today's
online packer; print both side by side").

Same shards (synthetic Infinity-MM records through `mmdata preprocess` with the tiny tokenizer:
the length index the global order plans from), same worker count, DP 1, packing at SEQ_LENGTH
with LLaVA-OV's 384-px tiles. Each side is timed from building its loader until it has delivered
twice as many samples as the shards hold (start-up included: worker spawn, tokenizer load, the
online buffer's fill, the global order's planning), with bench_loader's counters: samples per
CPU-second of the main process plus its workers (robust on a shared machine) and wall-clock
samples/s, and each loader's own packing efficiency (real tokens / row slots). Ends with:
BENCH global_order_loader baseline=<online samples/CPU-s> ours=<global> unit=samples/cpu-s ratio=<ours/baseline>

  python -m benchmarks.bench_global_throughput [--quick] [--num-samples 256] [--workers 1] [--shards DIR]

`--quick` (a smoke run): 64 samples, 128 timed per side, no workers.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.bench_loader import run_ours
from benchmarks.train_common import synth_shards
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

SEQ_LENGTH = 8192
GLOBAL_BATCH = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 samples, 128 timed per side, no workers")
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--shards", help="shards with a length index (`mmdata preprocess` output); default: built here")
    args = ap.parse_args()
    if args.quick:
        args.num_samples, args.workers = 64, 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = build_tiny_qwen2_tokenizer(work / "tok")
        shards = Path(args.shards) if args.shards else synth_shards(work, args.num_samples, tokenizer=tok)
        count = 2 * args.num_samples
        online = run_ours(shards, tok, args.workers, count, SEQ_LENGTH)
        ours = run_ours(shards, tok, args.workers, count, SEQ_LENGTH, sharding="global", global_batch_size=GLOBAL_BATCH)
    print(f"{count} samples per side, packing at {SEQ_LENGTH}, {args.workers} worker(s), DP 1")
    print(
        f"{'':14s} {'samples':>8s} {'wall s':>8s} {'cpu s':>8s} {'samples/s':>10s} {'samples/cpu-s':>14s} {'fill':>6s}"
    )
    for name, r in (("online packer", online), ("global order", ours)):
        print(
            f"{name:14s} {r.samples:8d} {r.wall_s:8.1f} {r.cpu_s:8.1f} {r.samples / r.wall_s:10.2f} "
            f"{r.per_core:14.2f} {r.packing_efficiency:6.3f}"
        )
    print(
        f"BENCH global_order_loader baseline={online.per_core:.3f} ours={ours.per_core:.3f} unit=samples/cpu-s "
        f"ratio={ours.per_core / online.per_core:.3f}"
    )


if __name__ == "__main__":
    main()
