"""Packed (THD) attention on CPU, forward + backward:

  (a) baseline: one causal SDPA call per packed sequence, slicing the stream (what
      `SDPACoreAttention` did before: a Python loop over `cu_seqlens` in every layer);
  (b) ours: `mmtrain.models.attention.grouped_varlen_sdpa` - sequences of (nearly) equal length
      stacked into one batch per SDPA call, one gather in and one out (the plan is built once
      per micro-batch and shared by all layers; its cost is included here).

Both compute exactly the same numbers (checked). Packings: many short samples, mixed lengths,
one long sequence, equal rows; head shapes of the tiny test model and of Qwen2-1.5B. Time: CPU
time of this process (`time.process_time`, single-threaded by default, so other load on a
shared machine does not count), the median of interleaved repetitions.

  python -m benchmarks.bench_varlen_attention [--quick] [--threads 1] [--reps 3]

Ends with: BENCH varlen_attention baseline=<loop ms> ours=<grouped ms> unit=ms ratio=<loop/grouped>
(summed over all cases).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from mmtrain.models.attention import VarlenPlan, grouped_varlen_sdpa


def per_sequence_loop(q, k, v, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """The previous implementation: one SDPA call per `cu_seqlens` segment."""
    bounds = cu.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        qq, kk, vv = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        outs.append(
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        )
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def grouped(q, k, v, cu: torch.Tensor, scale: float) -> torch.Tensor:
    return grouped_varlen_sdpa(q, k, v, VarlenPlan.build(cu.tolist()), causal=True, scale=scale)


def packing(total: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    lens = []
    while sum(lens) < total:
        lens.append(rng.randint(lo, hi))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def timed(fn, q, k, v, cu, scale) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    for x in (q, k, v):
        x.grad = None
    start = time.process_time()
    out = fn(q, k, v, cu, scale)
    out.backward(torch.ones_like(out))
    return time.process_time() - start, out.detach(), [x.grad.clone() for x in (q, k, v)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4K-token streams, tiny heads only")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (training on CPU uses 1 per rank)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    total = 4096 if args.quick else 8192
    cases = {
        "many short (20-200)": packing(total, 20, 200, rng),
        "mixed (50-2000)": packing(total, 50, 2000, rng),
        "one sequence": [total],
        "4 equal rows": [total // 4] * 4,
    }
    heads = [("tiny 4/2x16", 4, 2, 16)] + ([] if args.quick else [("Qwen2-1.5B 12/2x128", 12, 2, 128)])
    print(
        f"packed causal attention, forward + backward, {total} tokens, {args.threads} thread(s), "
        f"CPU ms, median of {args.reps} interleaved runs"
    )
    print(f"{'heads':<22}{'packing':<22}{'segments':>9}{'calls':>7}{'loop ms':>10}{'grouped ms':>12}{'speedup':>9}")
    sums = [0.0, 0.0]
    for hname, h, g, d in heads:
        for cname, lens in cases.items():
            torch.manual_seed(0)
            t = sum(lens)
            q = torch.randn(t, h, d, requires_grad=True)
            k = torch.randn(t, g, d, requires_grad=True)
            v = torch.randn(t, g, d, requires_grad=True)
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
            times: dict[str, list[float]] = {"loop": [], "grouped": []}
            for _ in range(args.reps):
                t_loop, ref, ref_grads = timed(per_sequence_loop, q, k, v, cu, d**-0.5)
                t_grp, out, grads = timed(grouped, q, k, v, cu, d**-0.5)
                times["loop"].append(t_loop)
                times["grouped"].append(t_grp)
            torch.testing.assert_close(out, ref)
            for a, b in zip(grads, ref_grads):
                torch.testing.assert_close(a, b)
            loop_ms, grp_ms = (statistics.median(times[x]) * 1e3 for x in ("loop", "grouped"))
            sums[0] += loop_ms
            sums[1] += grp_ms
            calls = len(VarlenPlan.build(cu.tolist()).groups)
            print(
                f"{hname:<22}{cname:<22}{len(lens):>9}{calls:>7}"
                f"{loop_ms:>10.1f}{grp_ms:>12.1f}{loop_ms / grp_ms:>8.2f}x",
                flush=True,
            )
    print(f"BENCH varlen_attention baseline={sums[0]:.1f} ours={sums[1]:.1f} unit=ms ratio={sums[0] / sums[1]:.2f}")


if __name__ == "__main__":
    main()
