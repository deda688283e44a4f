"""auto_tune's figures, measured: the share of the search space pruned without running, the
memory model's error against the measured per-rank peaks (before and after calibration), and the
speedup of the tuned layout over the recipe's own.

Side by side: (a) baseline = an exhaustive grid search would run every layout of the space, and
the recipe's own layout is what the user trains without tuning; (b) ours = `mmtrain FAMILY RECIPE
action=auto_tune` (memory-model pruning, trials of the real job, history pruning).

  python -m benchmarks.bench_auto_tune                       # tiny recipe, 2 CPU processes
         [--nproc 2] [--max-trials 6] [--shards DIR --tokenizer DIR] [--calibration FILE]
         [KEY=VALUE ...]                                     # more recipe overrides
  python -m benchmarks.bench_auto_tune --aquila [--max-trials 3]   # GPU: the Aquila-VL-2B shape
  python -m benchmarks.bench_auto_tune --quick                # smoke run: 2 trials of 3 steps, 40 samples

`--aquila` (prepared for a GPU machine; needs CUDA): recipes/aquila-vl-2b.yaml stage 2a from a
random init on every visible GPU, synthetic shards and the tiny tokenizer (the media token ids
pointed at its `<image>`/`<video>`), seq 12288, global batch 8 per GPU, 80% of the device
memory as the budget; 3 trials of 4 steps each by default.

Ends with three lines:
  BENCH auto_tune_trials baseline=<layouts in the space> ours=<trials run> unit=trials ratio=<x>
  BENCH auto_tune_memory_error baseline=<median error, model> ours=<median error, calibrated> unit=rel_error ratio=<x>
  BENCH auto_tune_speedup baseline=<recipe's layout tokens/s> ours=<tuned tokens/s> unit=tokens/s ratio=<x>
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_train_llava import build_data
from benchmarks.common import REPO


TINY = [
    "llava-ov",
    str(REPO / "recipes" / "llava-ov-tiny.yaml"),
    "train.seq_length=512",
    "train.global_batch_size=8",
    "data.num_workers=1",
    "auto_tune.trial_steps=5",
    "auto_tune.warmup_steps=2",
    "auto_tune.trial_timeout_s=300",
    # a per-rank grant around the recipe's own layout (CPU processes have no device memory)
    "auto_tune.device_memory_gb=0.02",
    "auto_tune.min_memory_fraction=0.6",
    "auto_tune.memory_fraction=0.7",
]

# --quick: the same search, shorter trials (a smoke run of the whole path, not a measurement)
QUICK = ["auto_tune.trial_steps=3", "auto_tune.warmup_steps=1"]
QUICK_TRIALS, QUICK_SAMPLES = 2, 40


def aquila_args(gpus: int) -> list[str]:
    import torch

    mem_gib = torch.cuda.get_device_properties(0).total_memory / 1024**3
    return [
        "llava-ov",
        str(REPO / "recipes" / "aquila-vl-2b.yaml"),
        "stage=2a",
        "checkpoint.load=null",
        "model.image_token_id=783",
        "model.video_token_id=784",
        "data.num_workers=2",
        f"train.global_batch_size={8 * gpus}",
        "auto_tune.trial_steps=4",
        "auto_tune.warmup_steps=2",
        "auto_tune.trial_timeout_s=240",
        f"auto_tune.device_memory_gb={mem_gib:.0f}",
        "auto_tune.memory_fraction=0.8",
        "auto_tune.min_memory_fraction=0.1",
    ]


def figures(history: Path) -> dict:
    rows = list(csv.DictReader(history.open()))
    status = [r["status"] for r in rows]
    ran = [r for r in rows if r["status"] == "ran"]
    errs = [abs(float(r["model_mem_gib"]) - float(r["meas_mem_gib"])) / float(r["meas_mem_gib"]) for r in ran]
    base = next((r for r in ran if r["baseline"] == "True"), None)
    best = max(ran, key=lambda r: float(r["meas_tokens_per_s"]), default=None)
    return dict(
        n=len(rows),
        pruned=status.count("pruned_memory") + status.count("pruned_history"),
        pruned_memory=status.count("pruned_memory"),
        pruned_history=status.count("pruned_history"),
        trials=len(ran) + status.count("failed"),
        failed=status.count("failed"),
        ran=ran,
        mem_err=(statistics.median(errs), max(errs)) if errs else None,
        base=base,
        best=best,
    )


def calibrated_error(ran: list[dict]) -> tuple[float, float, bool] | None:
    """(median, worst) calibrated memory error and whether it is leave-one-out (>= 3 trials;
    with fewer the fit is checked on its own points, which says little)."""
    from mmtrain.planning.calibration import calibrated_errors

    if not ran:
        return None
    col = lambda k: [float(r[k]) for r in ran]  # noqa: E731
    mem, _, loo = calibrated_errors(col("model_mem_gib"), col("meas_mem_gib"), col("model_step_s"), col("meas_step_s"))
    return mem.median, mem.worst, loo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-trials", type=int, default=None)
    ap.add_argument("--shards", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--calibration", type=Path, help="an earlier search's calibration.yaml (auto_tune.calibration)")
    ap.add_argument("--aquila", action="store_true", help="the Aquila-VL-2B shape on the visible GPUs")
    ap.add_argument("--work", type=Path, help="keep the run here (default: a temporary dir)")
    ap.add_argument("--quick", action="store_true", help="smoke run (tiny recipe): 2 trials of 3 steps, 40 samples")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_auto_tune_"))
    if args.shards and args.tokenizer:
        shards, tok = args.shards, args.tokenizer
    else:
        shards, tok = build_data(work / "data", QUICK_SAMPLES if args.quick else 200)
    if args.aquila:
        import torch

        gpus = torch.cuda.device_count()
        if not gpus:
            print("--aquila needs CUDA GPUs", file=sys.stderr)
            return 2
        base, nproc, trials = aquila_args(gpus), gpus, args.max_trials or 3
    else:
        base, nproc, trials = TINY, args.nproc, args.max_trials or (QUICK_TRIALS if args.quick else 6)
        if args.quick:
            base = [*TINY, *QUICK]
    run = work / "run"
    cmd = [
        sys.executable,
        "-m",
        "mmtrain.cli",
        *base,
        "action=auto_tune",
        f"run_dir={run}",
        f"data.paths=[{shards}]",
        f"tokenizer.path={tok}",
        f"parallel.nproc_per_node={nproc}",
        f"auto_tune.max_trials={trials}",
        *([f"auto_tune.calibration={args.calibration}"] if args.calibration else []),
        *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMTRAIN_CPU_THREADS": "1"}
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    print(proc.stdout)
    if proc.returncode != 0:
        print(proc.stderr[-6000:], file=sys.stderr)
        return proc.returncode
    f = figures(run / "auto_tune" / "history.csv")
    after = calibrated_error(f["ran"])
    print(
        f"space {f['n']} layouts; pruned without running {f['pruned']} ({f['pruned'] / f['n']:.0%}: memory model "
        f"{f['pruned_memory']}, history {f['pruned_history']}); trials {f['trials']} ({f['failed']} failed)"
    )
    if f["mem_err"]:
        print(
            f"memory model error vs measured peak: median {f['mem_err'][0]:.0%}, worst {f['mem_err'][1]:.0%}; "
            f"calibrated ({'leave-one-out' if after[2] else 'in-sample'} from {len(f['ran'])} trials): "
            f"median {after[0]:.0%}, worst {after[1]:.0%}"
        )
    print(
        f"BENCH auto_tune_trials baseline={f['n']} ours={f['trials']} unit=trials "
        f"ratio={f['n'] / max(f['trials'], 1):.2f}"
    )
    if f["mem_err"]:
        print(
            f"BENCH auto_tune_memory_error baseline={f['mem_err'][0]:.4f} ours={after[0]:.4f} unit=rel_error "
            f"ratio={f['mem_err'][0] / max(after[0], 1e-9):.2f}"
        )
    if f["base"] and f["best"]:
        b, o = float(f["base"]["meas_tokens_per_s"]), float(f["best"]["meas_tokens_per_s"])
        print(f"BENCH auto_tune_speedup baseline={b:.1f} ours={o:.1f} unit=tokens/s ratio={o / b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
