"""The longest sequence one training step fits in a memory budget, on CPU:

  (a) baseline: `transformers.Qwen2ForCausalLM` with its standard loss (`labels=` -> full
      [tokens, vocab] logits, upcast, cross entropy), SDPA attention, AdamW - how LLaVA-NeXT
      trains its language model;
  (b) ours, CP=1: mmtrain's decoder (megatron-core GPTModel on the local spec, THD attention,
      the chunked LM loss of mmtrain/models/lm_loss.py) on megatron DDP with the CPU optimizer;
  (c) ours, CP=2: the same on 2 processes (gloo), each holding half of the sequence
      (megatron's load-balanced split, K/V all-gathered per layer).

All three train the same decoder shape with the real Qwen2 vocabulary (151,936 tokens, tied
embeddings) so the loss memory is realistic: hidden 256, 4 layers, FFN 1024, 4 heads, 2 KV
groups (a tiny LLM; the layers are just wide enough that activation memory, not only the
loss, is reached on a CPU in minutes). Every (implementation, length) runs in fresh processes;
the peak RSS of each process (`ru_maxrss`, which includes the interpreter and libraries, the
same for all three) decides whether it fits the budget (default 8 GiB per process). Lengths
double until an implementation no longer fits; a length whose projected peak (linear in the
length) is far over the budget is not run, and an address-space limit of budget + 4 GiB
guards the machine.

  python -m benchmarks.bench_long_context [--quick] [--budget-gib 8] [--lengths 4096,8192,...]

Ends with (ratio > 1: ours reaches longer sequences):
  BENCH long_context_cp2 baseline=<ours CP=1 max> ours=<ours CP=2 max> unit=tokens ratio=...
  BENCH long_context baseline=<HF max len> ours=<ours CP=1 max len> unit=tokens ratio=...
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.tiny_models import tiny_llm

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
SHAPE = dict(hidden=256, ffn=1024, layers=4, heads=4, kv_groups=2, vocab=151936)
IMPLS = ("hf", "ours_cp1", "ours_cp2")
LABELS = {"hf": "HF Qwen2ForCausalLM", "ours_cp1": "ours, CP=1", "ours_cp2": "ours, CP=2 (2 procs)"}


# ----------------------------------------------------------------------------- children


def _limit_address_space(budget_gib: float) -> None:
    limit = int((budget_gib + 4) * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _tokens(length: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, SHAPE["vocab"], (1, length), generator=g)


def _llm(length: int):
    """The measured decoder (SHAPE, tied embeddings) at context `length` (4096 at least)."""
    s = SHAPE
    return tiny_llm(s["layers"], s["hidden"], s["ffn"], s["heads"], s["kv_groups"], s["vocab"], max(length, 4096))


def hf_step(length: int) -> tuple[float, float]:
    """One training step of HF Qwen2ForCausalLM: (loss, seconds of the step)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mmtrain.models.state_dict_adapter import hf_decoder_keys

    torch.manual_seed(0)
    cfg = Qwen2Config(**hf_decoder_keys(_llm(length)))
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = _tokens(length)
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return float(loss), time.perf_counter() - start


def ours_step(length: int) -> tuple[float, float]:
    """One training step of mmtrain's decoder (CP size = this torchrun world, or 1): (loss,
    seconds of the step)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mmtrain.models.context_parallel import current_layout
    from mmtrain.models.language_model import build_language_model
    from mmtrain.models.lm_config import padded_vocab_size
    from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config
    from mmtrain.runtime.distributed import ensure_model_parallel

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    ensure_model_parallel(1, 1, cp=cp)
    llm = _llm(length)
    config = language_transformer_config(llm, "float32", ParallelOptions())
    config.calculate_per_token_loss = True
    model = build_language_model(llm, config, vocab_size=padded_vocab_size(llm.vocab_size, 64), loss_impl="chunked")
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True),
        module=model,
    )
    ddp.broadcast_params()
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.0, clip_grad=1.0
        ),
        [ddp],
    )
    ids = _tokens(length)[0]
    labels = torch.cat([ids[1:], torch.full((1,), -100)])  # shifted, like the loaders' batches
    if cp > 1:
        dist.barrier()
    start = time.perf_counter()
    layout = current_layout(torch.tensor([0, length], dtype=torch.int32))
    local_ids, local_labels = layout.split(ids), layout.split(labels, fill=-100)
    loss = ddp(
        input_ids=local_ids[None],
        position_ids=None,
        attention_mask=None,
        labels=local_labels[None],
        packed_seq_params=layout.packed_seq_params(),
    )
    loss_sum = loss.sum()
    loss_sum.backward()
    count = torch.tensor((local_labels >= 0).sum().item())
    finalize_model_grads([ddp], num_tokens=count.clone())  # DP x CP grad reduction, / all label tokens
    opt.step()
    seconds = time.perf_counter() - start
    total = torch.stack([loss_sum.detach(), count.float()])
    if cp > 1:
        dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
    return float(total[0] / total[1]), seconds


def child(args: argparse.Namespace) -> None:
    import torch

    _limit_address_space(args.budget_gib)
    torch.set_num_threads(args.threads)
    try:
        loss, seconds = (hf_step if args.child == "hf" else ours_step)(args.length)
        error = None
    except (MemoryError, RuntimeError) as err:  # the address-space guard tripped
        loss, seconds, error = None, 0.0, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    rank = int(os.environ.get("RANK", "0"))
    out = {
        "loss": loss,
        "seconds": seconds,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "error": error,
    }
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))


# ----------------------------------------------------------------------------- parent


def run_one(impl: str, length: int, budget_gib: float, threads: int, work: Path) -> dict:
    out = work / f"{impl}_{length}.json"
    procs = 2 if impl == "ours_cp2" else 1
    script = [
        str(Path(__file__).resolve()),
        "--child",
        "hf" if impl == "hf" else "ours",
        "--length",
        str(length),
        "--budget-gib",
        str(budget_gib),
        "--threads",
        str(max(1, threads // procs)),
        "--out",
        str(out),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, threads // procs)),
        "PYTHONPATH": str(REPO),
        "MALLOC_MMAP_THRESHOLD_": "131072",
    }  # RSS follows live memory (no heap fragmentation)
    if procs > 1:
        from mmtrain.runtime.distributed import free_port

        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={procs}",
            f"--master_port={free_port()}",
            *script,
        ]
    else:
        cmd = [sys.executable, *script]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    ranks = []
    for r in range(procs):
        f = Path(f"{out}.rank{r}")
        ranks.append(json.loads(f.read_text()) if f.exists() else None)
    if proc.returncode != 0 or any(r is None or r["error"] for r in ranks):
        why = next((r["error"] for r in ranks if r and r["error"]), None) or proc.stderr.strip().splitlines()[-1:]
        return {
            "ok": False,
            "peak_rss": max((r["peak_rss"] for r in ranks if r), default=0),
            "why": str(why),
            "wall": wall,
        }
    seconds = max(r["seconds"] for r in ranks)
    return {
        "ok": True,
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "seconds": seconds,
        "tokens_per_s": length / seconds,
        "loss": ranks[0]["loss"],
        "wall": wall,
    }


def sweep(impl: str, lengths: list[int], budget: float, threads: int, work: Path) -> list[tuple[int, dict]]:
    rows, seen = [], []  # seen: (length, peak) of the runs so far
    for length in lengths:
        if len(seen) >= 2:  # peak memory is linear in the length: extrapolate the last two runs
            (l1, p1), (l2, p2) = seen[-2:]
            projected = p2 + (p2 - p1) / (l2 - l1) * (length - l2)
            if projected > 1.25 * budget * GIB:
                rows.append(
                    (length, {"ok": False, "peak_rss": projected, "why": "not run: projected peak", "projected": True})
                )
                break
        res = run_one(impl, length, budget, threads, work)
        rows.append((length, res))
        print(
            f"  {LABELS[impl]:<24} {length:>8} tokens: "
            + (
                f"peak {res['peak_rss'] / GIB:6.2f} GiB/process, {res['tokens_per_s']:8.0f} tokens/s, loss "
                f"{res['loss']:.3f}"
                if res["ok"]
                else f"failed ({res['why']})"
            ),
            flush=True,
        )
        if not res["ok"] or res["peak_rss"] > budget * GIB:
            break
        seen.append((length, res["peak_rss"]))
    return rows


def longest_fitting(rows: list[tuple[int, dict]], budget: float) -> int:
    fits = [n for n, r in rows if r["ok"] and r["peak_rss"] <= budget * GIB]
    return max(fits, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="lengths 512 and 1024 and a 1.8 GiB budget (a smoke run: HF fits 512 only, ours both)",
    )
    ap.add_argument("--budget-gib", type=float, default=8.0, help="peak RSS allowed per process (default 8)")
    ap.add_argument(
        "--lengths",
        default="4096,8192,16384,32768,65536,131072,262144",
        help="comma-separated sequence lengths, doubling",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="CPU threads per implementation (CP=2 splits them over its 2 processes)",
    )
    ap.add_argument("--child", choices=("hf", "ours"), help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.budget_gib, args.lengths = min(args.budget_gib, 1.8), "512,1024"
    lengths = [int(x) for x in args.lengths.split(",")]
    print(
        f"long-context training step on CPU: decoder {SHAPE}, budget {args.budget_gib:g} GiB per process, "
        f"{args.threads} thread(s) per implementation"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for impl in IMPLS:
            results[impl] = sweep(impl, lengths, args.budget_gib, args.threads, Path(tmp))
    print()
    print(f"{'length':>8}  " + "  ".join(f"{LABELS[i]:>30}" for i in IMPLS))
    for length in lengths:
        cells = []
        for impl in IMPLS:
            r = dict(results[impl]).get(length)
            if r is None:
                cells.append("-")
            elif r.get("projected"):
                cells.append(f">{r['peak_rss'] / GIB:.1f} GiB (projected)")
            elif not r["ok"]:
                cells.append("failed (over budget)")
            else:
                flag = "" if r["peak_rss"] <= args.budget_gib * GIB else " OVER"
                cells.append(f"{r['peak_rss'] / GIB:.2f} GiB {r['tokens_per_s']:.0f} tok/s{flag}")
        if any(c != "-" for c in cells):
            print(f"{length:>8}  " + "  ".join(f"{c:>30}" for c in cells))
    best = {impl: longest_fitting(results[impl], args.budget_gib) for impl in IMPLS}
    print()
    for impl in IMPLS:
        capped = best[impl] == lengths[-1]
        print(
            f"longest length within {args.budget_gib:g} GiB/process: {LABELS[impl]:<24} {best[impl]:>8}"
            + (" (the longest length tried)" if capped else "")
        )
    hf, cp1, cp2 = best["hf"], best["ours_cp1"], best["ours_cp2"]
    print(f"BENCH long_context_cp2 baseline={cp1} ours={cp2} unit=tokens ratio={cp2 / max(cp1, 1):.2f}")
    print(f"BENCH long_context baseline={hf} ours={cp1} unit=tokens ratio={cp1 / max(hf, 1):.2f}")


if __name__ == "__main__":
    main()
