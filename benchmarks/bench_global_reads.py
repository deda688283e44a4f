"""Bytes each data-parallel rank reads per step: the global order (`data.sharding: global`) against
`data.sharding: replicated` (issue 46; Megatron-Bridge #4609 measured replicated reads growing
with DP²).

Both sides are the same loader over the same shards and steps (`build_llava_ov_loader(...,
sharding="global")`), counted by the loader itself (each batch's `global_order["bytes_read"]`:
the samples' bytes in the tars, energon's index). Replicated: every rank builds the loader as the
trainer does for `replicated`, with dp_size 1, so each rank reads every sample of the step (one
such loader measures it). Ours: DP 4 loaders, rank r of 4, each reading only the rows placed on
it. Prints, per step, the step's total and each rank's bytes (the ranks' sum must be the total),
then one line:
BENCH global_order_bytes_per_rank baseline=<replicated bytes per rank> ours=<global bytes per rank> unit=bytes/step
ratio=<baseline/ours> (about the DP size: each rank reads about total/DP)

Data: synthetic Infinity-MM records through `mmdata preprocess` with the tiny tokenizer (its
length index, exact, plans the order: no sample is carried, so no sample is read twice), read at
the tiny recipe's 30-px tiles (the bytes do not depend on the tiles).

  python -m benchmarks.bench_global_reads [--quick] [--num-samples 400] [--dp 4] [--steps 6] [--shards DIR]

`--quick` (a smoke run): 64 samples, 2 steps of 8 rows.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.train_common import synth_shards
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader

SEQ_LENGTH = 2048


def step_bytes(shards: Path, tok: Path, dp: int, global_batch: int, steps: int, workers: int) -> dict[int, list[int]]:
    """Per step, the bytes each of `dp` ranks' loaders read for it (their own counters)."""
    read: dict[int, list[int]] = defaultdict(lambda: [0] * dp)
    for rank in range(dp):
        loader = build_llava_ov_loader(
            shards,
            tok,
            seq_length=SEQ_LENGTH,
            micro_batch_size=1,
            dp_rank=rank,
            dp_size=dp,
            num_workers=workers,
            image_size=30,
            patch_size=14,
            sharding="global",
            global_batch_size=global_batch,
        )
        it = iter(loader)
        while loader.next_step < steps:
            at = next(it).global_order
            read[at["step"]][rank] += at["bytes_read"]
    return dict(read)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 samples, 2 steps of 8 rows")
    ap.add_argument("--num-samples", type=int, default=400)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--shards", help="shards with a length index (`mmdata preprocess` output); default: built here")
    args = ap.parse_args()
    if args.quick:
        args.num_samples, args.global_batch_size, args.steps, args.workers = 64, 8, 2, 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = build_tiny_qwen2_tokenizer(work / "tok")
        shards = Path(args.shards) if args.shards else synth_shards(work, args.num_samples, tokenizer=tok)
        t0 = time.perf_counter()
        replicated = step_bytes(shards, tok, 1, args.global_batch_size, args.steps, args.workers)
        t1 = time.perf_counter()
        ours = step_bytes(shards, tok, args.dp, args.global_batch_size, args.steps, args.workers)
        t2 = time.perf_counter()
    print(f"{args.steps} steps of {args.global_batch_size} rows at {SEQ_LENGTH} tokens, DP {args.dp}")
    print(f"{'step':>4} {'total (replicated: each rank)':>30}  global order: bytes per rank")
    for t in range(args.steps):
        total, per_rank = replicated[t][0], ours[t]
        if sum(per_rank) != total:
            raise SystemExit(f"step {t}: the ranks read {sum(per_rank)} bytes, the step holds {total}")
        print(f"{t:>4} {total:>30,}  {' '.join(f'{b:,}' for b in per_rank)}")
    base = sum(replicated[t][0] for t in range(args.steps)) / args.steps
    mine = sum(sum(ours[t]) for t in range(args.steps)) / (args.steps * args.dp)
    worst = max(max(ours[t]) for t in range(args.steps))
    print(f"per rank and step: replicated {base:,.0f} bytes, global {mine:,.0f} (worst rank-step {worst:,})")
    print(f"loader time: replicated (one rank) {t1 - t0:.1f}s, global ({args.dp} ranks) {t2 - t1:.1f}s")
    print(
        f"BENCH global_order_bytes_per_rank baseline={base:.0f} ours={mine:.0f} unit=bytes/step ratio={base / mine:.2f}"
    )


if __name__ == "__main__":
    main()
