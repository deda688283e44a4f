"""The one GPU check (issue 43): on one GPU (H100/H200) in 10 minutes, a verdict on the whole path.

    python benchmarks/gpu_smoke.py --budget 600 --report DIR

Each check is one line `PASS|FAIL|SKIP <name>: <detail> [<seconds> s]`, in this order; a failure
does not stop the run, and a check is not started when less than half its budget is left of
`--budget` (SKIP, saying so). `--report DIR` writes DIR/report.md and DIR/report.json.
  env          Python/torch/CUDA versions, device count; megatron-core and megatron-energon import (FAIL
               if not: review 2, N2); Transformer Engine as installed, as te_support and as megatron
               see it (te_status, HAVE_TE, te_attention is a class); flash_attn / cut_cross_entropy /
               liger_kernel present (review A2)
  device       in subprocesses: CUDA_VISIBLE_DEVICES=0 LOCAL_RANK=1 RANK=0 WORLD_SIZE=1 then
               init_distributed chooses cuda:0 (A5); the tiny recipe with parallel.backend=gloo
               while CUDA is visible is refused with a clear message (A7)
  build        both tiny families (llava-ov-tiny, emu3-tiny) built on CUDA in bf16 with one
               forward + backward, once with TE and once with TE hidden (a PYTHONPATH entry whose
               transformer_engine raises ImportError): the SDPA/varlen fallback (A2); where
               transformer_engine is not installed, only the second (the first would repeat it)
  tier         the LLaVA-OV and Emu3 core of the `gpu` tier (tests/gpu/test_gpu_train.py: both
               families train 4 bf16 steps with the distributed optimizer, with TE hidden and with TE;
               LLaVA-OV with every part trained; `make test-gpu` runs the whole tier)
  throughput   gpu_check.py's throughput(): Aquila-VL-2B at 8,192 and 12,288 x micro-batch 2,
               Emu3-8B shapes with 4 layers at 32,768: tokens/s/GPU, MFU (corrected formula,
               review B1), peak memory against the dry-run estimate
  trainer      `mmtrain llava-ov recipes/llava-ov-tiny.yaml`, bf16, distributed optimizer
               (overlap_grad_reduce on), 4 steps of 2 micro-batches (images, then text-only) on
               dev shards, with freeze [] and with freeze [vision_tower, llm] (A1): finite loss
               and grad norm, the loss goes down (freeze [])
  checkpoint   save at step 2, a new process resumes to step 4: the losses of the uninterrupted
               run (tolerance); a weights-only start with lr=0 leaves the weights unchanged (B2)
  correctness  gpu_check.py's check_varlen, check_loss, check_decoder, check_cp_layout
  sync         CUDA syncs of one decoder forward + backward under
               torch.cuda.set_sync_debug_mode("warn"): Aquila-shaped (28 layers) at 12,288
               (small with --quick) (C3, C4)
  generation   gpu_check_generate.py --layers 4 --steps 128 with TE hidden: ms/token (C6)
Then a table of the timed figures with the targets, and `GPU_SMOKE: N passed, M failed, K skipped`
(exit 1 when a check failed, else 0). Each check runs in its own subprocess under a time budget;
children keep the caller's PYTHONPATH (packages installed with `pip install --target`).

Without CUDA every check says SKIP (env runs, reporting no CUDA) and the script exits 0;
`--allow-cpu` runs at tiny sizes what a CPU can (env, device's refusal logic, build, trainer and
checkpoint on gloo/fp32 with 2 steps, correctness tiny) so this script cannot rot.

    python benchmarks/gpu_smoke.py [--quick] [--only env,device,...] [--work-dir DIR] [--report DIR]
    python benchmarks/gpu_smoke.py --allow-cpu --quick --only env,build,trainer --report DIR
    python benchmarks/gpu_smoke.py --show WORK_DIR      # an earlier run's table again
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE.parent))

RESULT_MARK = "GPU_SMOKE_RESULT "
from benchmarks.common import read_dist_ckpt  # noqa: E402

TINY_LLAVA = REPO / "recipes" / "llava-ov-tiny.yaml"
TINY_EMU3 = REPO / "recipes" / "emu3-tiny.yaml"
MFU_TARGET, MFU_AIM, PEAK_TOLERANCE = 0.45, 0.50, 0.10
CPU_BUDGET_SCALE = 4.0  # --allow-cpu on a (possibly shared) CPU: the budgets only catch hangs there


@dataclasses.dataclass
class Outcome:
    """One check's result line."""

    status: str  # PASS | FAIL | SKIP
    detail: str
    seconds: float = 0.0


@dataclasses.dataclass
class Smoke:
    """What the checks share: options, the work dir, the data, the reference training run."""

    args: argparse.Namespace
    work: Path
    cuda: bool
    deadline: float
    data: tuple[Path, Path] | None = None  # (shards, tokenizer)
    reference_run: Path | None = None  # trainer's freeze [] run (checkpoints every `half` steps)
    figures: dict[str, dict] = dataclasses.field(default_factory=dict)  # table rows by key

    @property
    def steps(self) -> int:
        return 4 if self.cuda else 2

    @property
    def half(self) -> int:
        return self.steps // 2

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


# ----------------------------------------------------------------------------- subprocesses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_bounded(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run `cmd` in its own session with output to `log`; (exit status or None on timeout, output).
    On timeout the whole process group is killed (a trainer's workers go with it)."""
    full_env = {**os.environ, "PYTHONPATH": child_pythonpath(), **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=REPO, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return rc, log.read_text(errors="replace")


def child_pythonpath(*first: Path | str) -> str:
    """PYTHONPATH for a child: `first`, the repo, then the caller's own entries. Prepended, never
    replaced (review 2, N2): packages installed with `pip install --target DIR` or a Megatron-LM
    checkout reach Python only through PYTHONPATH, and a child without them cannot import megatron."""
    entries = [str(x) for x in (*first, REPO)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def last_error(text: str) -> str:
    """The most telling line of a failed subprocess's output (its exception, else its last line)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    for line in reversed(lines):
        if ("Error" in line or "error:" in line or "Exception" in line) and not line.startswith("File "):
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def run_child(
    smoke: Smoke, child: str, timeout: float, env: dict[str, str] | None = None, log_name: str | None = None
) -> dict[str, Any]:
    """This script's `--child CHILD` in a subprocess; its result dict (status, detail, ...)."""
    cmd = [sys.executable, str(HERE), "--child", child, "--work-dir", str(smoke.work)]
    cmd += ["--quick"] if smoke.args.quick else []
    cmd += ["--allow-cpu"] if smoke.args.allow_cpu else []
    log = smoke.work / "logs" / f"{log_name or child.replace(':', '-')}.log"
    rc, out = run_bounded(cmd, log, timeout, env)
    if rc is None:
        return {"status": "FAIL", "detail": f"timed out after {timeout:.0f} s (log {log})"}
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    return {"status": "FAIL", "detail": f"exit {rc}: {last_error(out)} (log {log})"}


def hidden_te_dir(work: Path) -> Path:
    """A PYTHONPATH entry whose `transformer_engine` raises ImportError (TE hidden, review A2)."""
    pkg = work / "hide_te" / "transformer_engine"
    pkg.mkdir(parents=True, exist_ok=True)
    # ModuleNotFoundError (an ImportError), as `sys.modules["transformer_engine"] = None` gives: megatron
    # 0.16's tensor_parallel/random.py catches only that one, a plain ImportError breaks `import megatron.core`
    (pkg / "__init__.py").write_text('raise ModuleNotFoundError("transformer_engine hidden by gpu_smoke.py")\n')
    return pkg.parent


def hidden_te_env(work: Path) -> dict[str, str]:
    return {"PYTHONPATH": child_pythonpath(hidden_te_dir(work))}


def emit(result: dict[str, Any]) -> None:
    """A child's result, the last line the parent reads."""
    print(RESULT_MARK + json.dumps(result, default=str), flush=True)


# ----------------------------------------------------------------------------- data


def build_smoke_data(root: Path) -> tuple[Path, Path]:
    """Dev shards (images alternating with text-only samples, so that with packing off and 2
    micro-batches per step the last one is text-only) and the tiny Qwen2 tokenizer, as the tests
    build them (mmdata.dev.shards, tiny_tokenizer); (shards, tokenizer)."""
    import io

    import numpy as np
    from PIL import Image

    from mmdata.dev.shards import DevSample, write_dev_shards
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    def png(h: int, w: int, seed: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    def qa(q: str, a: str) -> list[dict]:
        return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]

    sizes = [(20, 30), (90, 40), (28, 28), (12, 200), (150, 60), (33, 47)]
    samples = []
    for i in range(48):
        if i % 2 == 0:
            samples.append(
                DevSample(
                    f"img-{i}",
                    qa("<image>\nWhat is shown?", f"Answer number {i}: a picture."),
                    [("png", png(*sizes[i // 2 % len(sizes)], i))],
                )
            )
        else:
            samples.append(DevSample(f"txt-{i}", qa("Tell me a fact.", f"Fact {i}: the sea is salty.") * 2))
    shards = write_dev_shards(root / "shards", samples, samples_per_shard=48)
    tokenizer = build_tiny_qwen2_tokenizer(root / "tokenizer")
    return shards, tokenizer


def ensure_data(smoke: Smoke) -> tuple[Path, Path]:
    if smoke.data is None:
        shutil.rmtree(smoke.work / "data", ignore_errors=True)
        smoke.data = build_smoke_data(smoke.work / "data")
    return smoke.data


# ----------------------------------------------------------------------------- training runs


def train_cli(
    smoke: Smoke, run_dir: Path, timeout: float, *overrides: str, fresh: bool = True
) -> tuple[int | None, str]:
    """`mmtrain llava-ov recipes/llava-ov-tiny.yaml` on the smoke data: the GPU configuration (bf16,
    distributed optimizer) on CUDA, gloo/fp32 on a CPU. `fresh`: remove what an earlier smoke run
    left in `run_dir` (a run dir with checkpoints would be resumed)."""
    shards, tok = ensure_data(smoke)
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    device = (
        ["parallel.precision=bf16", "parallel.distributed_optimizer=true"]
        if smoke.cuda
        else ["parallel.backend=gloo", "parallel.precision=fp32"]
    )
    cmd = [
        sys.executable,
        "-m",
        "mmtrain.cli",
        "llava-ov",
        str(TINY_LLAVA),
        f"run_dir={run_dir}",
        f"data.paths=[{shards}]",
        f"tokenizer.path={tok}",
        "data.num_workers=1",
        "data.packing=false",
        "data.shuffle_buffer_size=1",
        "train.seq_length=1024",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "logging.tensorboard=false",
        "parallel.nproc_per_node=1",
        f"parallel.master_port={free_port()}",
        *device,
        *overrides,
    ]
    env = {"OMP_NUM_THREADS": "1", "MMTRAIN_CPU_THREADS": "1"}
    return run_bounded(cmd, run_dir.parent / f"{run_dir.name}.log", timeout, env)


def metrics(run_dir: Path) -> dict[int, dict]:
    """The last record of each step of a run's metrics.jsonl."""
    f = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []
    return {r["step"]: r for r in rows}


def _is_text_sample(sample_id: str) -> bool:
    """build_smoke_data's odd keys are its text-only samples (ids are `<shards>#<key>`)."""
    key = str(sample_id).rpartition("#")[2]
    return key.isdigit() and int(key) % 2 == 1


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def train_and_read(smoke: Smoke, run_dir: Path, timeout: float, *overrides: str, fresh: bool = True) -> dict[int, dict]:
    """One training run; its metrics, or RuntimeError naming why it failed."""
    rc, out = train_cli(smoke, run_dir, timeout, *overrides, fresh=fresh)
    if rc is None:
        raise RuntimeError(f"timed out after {timeout:.0f} s (log {run_dir}.log)")
    if rc != 0:
        raise RuntimeError(f"exit {rc}: {last_error(out)} (log {run_dir}.log)")
    return metrics(run_dir)


def ckpt_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"iter_{step:07d}"


# ----------------------------------------------------------------------------- checks (parent side)


def check_env(smoke: Smoke, budget: float) -> Outcome:
    r = run_child(smoke, "env", budget)
    return Outcome(r["status"], r["detail"])


def check_device(smoke: Smoke, budget: float) -> Outcome:
    """A5 and A7 in subprocesses (on a CPU: the decision functions, in a subprocess)."""
    if not smoke.cuda:
        r = run_child(smoke, "device-logic", budget)
        return Outcome(r["status"], r["detail"])
    start = time.monotonic()
    env = {
        "CUDA_VISIBLE_DEVICES": "0",
        "LOCAL_RANK": "1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    a5 = run_child(smoke, "a5", budget / 2, env=env)
    problems = [] if a5["status"] == "PASS" else [f"A5: {a5['detail']}"]
    run_dir = smoke.work / "device" / "gloo"
    rc, out = train_cli(
        smoke,
        run_dir,
        max(5.0, budget - (time.monotonic() - start)),
        "parallel.backend=gloo",
        "train.iters=1",
        "parallel.precision=fp32",
    )
    refused = rc is not None and rc != 0 and "CUDA_VISIBLE_DEVICES" in out and "parallel.backend=gloo" in out
    if not refused:
        problems.append(f"A7: gloo with CUDA visible not refused clearly (exit {rc}: {last_error(out)})")
    elif "Traceback" in out:
        problems.append(f"A7: refused, but with a traceback (log {run_dir}.log)")
    if problems:
        return Outcome("FAIL", "; ".join(problems))
    return Outcome("PASS", f"A5: {a5['detail']}; A7: gloo refused (exit {rc}): {last_error(out)[:120]}")


def check_build(smoke: Smoke, budget: float) -> Outcome:
    """Both families built with TE as installed and with TE hidden. Where no `transformer_engine`
    is installed at all the first build would be the second one again: it is not run."""
    hidden = run_child(smoke, "build:hidden", budget / 2, env=hidden_te_env(smoke.work), log_name="build-te-hidden")
    if importlib.util.find_spec("transformer_engine") is None:
        with_te = {"status": "PASS", "detail": "transformer_engine not installed: the TE-hidden build is that build"}
    else:
        with_te = run_child(smoke, "build:te", budget / 2, log_name="build-te")
    status = "PASS" if with_te["status"] == hidden["status"] == "PASS" else "FAIL"
    return Outcome(status, f"with TE: {with_te['detail']} | TE hidden: {hidden['detail']}")


def check_trainer(smoke: Smoke, budget: float) -> Outcome:
    """Two real training runs (freeze [] and freeze [vision_tower, llm]); the first is check 5's
    uninterrupted reference (a checkpoint every `half` steps)."""
    start, parts, failed = time.monotonic(), [], False
    for name, freeze in (("trainable", "freeze=[]"), ("frozen", "freeze=[vision_tower, llm]")):
        run_dir = smoke.work / "trainer" / name
        left = max(5.0, budget - (time.monotonic() - start)) if name == "frozen" else budget * 0.55
        try:
            m = train_and_read(
                smoke,
                run_dir,
                left,
                freeze,
                f"train.iters={smoke.steps}",
                f"checkpoint.interval={smoke.half}",
                "checkpoint.keep_last=0",
            )
        except RuntimeError as e:
            parts.append(f"{freeze}: {e}")
            failed = True
            continue
        losses = [m[s]["loss"] for s in sorted(m)]
        norms = [m[s].get("grad_norm") for s in sorted(m)]
        text_last = sum(1 for s in m if _is_text_sample((m[s].get("sample_ids") or ["?"])[-1]))
        ok = sorted(m) == list(range(1, smoke.steps + 1)) and all(map(finite, losses + norms))
        down = len(losses) > 1 and losses[-1] < losses[0]
        if name == "trainable" and smoke.cuda and not down:
            ok = False
        if name == "trainable" and ok:
            smoke.reference_run = run_dir
        failed |= not ok
        parts.append(
            f"{freeze}: {len(m)} steps, loss {' '.join(f'{x:.3f}' for x in losses)}"
            f" ({'down' if down else 'not down'}), grad_norm finite {all(map(finite, norms))}, "
            f"last micro-batch text-only in {text_last}/{len(m)} steps"
        )
    return Outcome("FAIL" if failed else "PASS", "; ".join(parts))


def check_checkpoint(smoke: Smoke, budget: float) -> Outcome:
    """Resume from step `half` to `steps` in a new process against the uninterrupted run; then a
    weights-only start from step `half` with lr=0 must leave every weight as loaded (B2)."""
    start = time.monotonic()
    ref = smoke.reference_run
    if ref is None:  # `--only checkpoint`, or the trainer check failed: its own reference
        ref = smoke.work / "checkpoint" / "reference"
        train_and_read(
            smoke,
            ref,
            budget * 0.4,
            f"train.iters={smoke.steps}",
            f"checkpoint.interval={smoke.half}",
            "checkpoint.keep_last=0",
        )
    full = metrics(ref)
    half, steps = smoke.half, smoke.steps
    resumed_dir = smoke.work / "checkpoint" / "resumed"
    shutil.rmtree(resumed_dir, ignore_errors=True)
    shutil.copytree(ref, resumed_dir)
    for d in (resumed_dir / "checkpoints").glob("iter_*"):
        if int(d.name[5:]) > half:
            shutil.rmtree(d)
    (resumed_dir / "checkpoints" / "latest").write_text(f"{half}\n")
    lines = (resumed_dir / "metrics.jsonl").read_text().splitlines()
    (resumed_dir / "metrics.jsonl").write_text(
        "".join(x + "\n" for x in lines if x.strip() and json.loads(x)["step"] <= half)
    )
    left = budget - (time.monotonic() - start)
    got = train_and_read(
        smoke,
        resumed_dir,
        left * 0.5,
        f"train.iters={steps}",
        f"checkpoint.interval={half}",
        "checkpoint.keep_last=0",
        fresh=False,
    )
    tol = 2e-2 if smoke.cuda else 1e-5
    diffs = {
        s: abs(got[s]["loss"] - full[s]["loss"]) / max(abs(full[s]["loss"]), 1e-12)
        for s in range(half + 1, steps + 1)
        if s in got and s in full
    }
    problems = []
    if sorted(diffs) != list(range(half + 1, steps + 1)):
        problems.append(f"resumed steps {sorted(got)}, expected up to {steps}")
    elif max(diffs.values()) > tol:
        problems.append(f"resumed losses differ: max rel {max(diffs.values()):.2e} > {tol:g}")
    lr0 = smoke.work / "checkpoint" / "lr0"
    train_and_read(
        smoke,
        lr0,
        budget - (time.monotonic() - start),
        f"checkpoint.load={ckpt_dir(ref, half)}",
        "checkpoint.weights_only=true",
        "optimizer.lr=0.0",
        "optimizer.min_lr=0.0",
        "train.iters=1",
        "checkpoint.interval=1",
        "checkpoint.keep_last=0",
    )
    before, after = read_dist_ckpt(ckpt_dir(ref, half) / "model"), read_dist_ckpt(ckpt_dir(lr0, 1) / "model")
    changed = [k for k in before if k not in after or not bool((before[k] == after[k]).all())]
    if changed or not before:
        problems.append(f"lr=0 start changed {len(changed)}/{len(before)} tensors (e.g. {changed[:2]})")
    detail = (
        f"resume {half}->{steps}: max rel loss diff {max(diffs.values(), default=float('nan')):.1e} "
        f"(tolerance {tol:g}); lr=0 weights-only start: {len(before) - len(changed)}/{len(before)} tensors "
        "unchanged"
    )
    return Outcome("FAIL" if problems else "PASS", "; ".join(problems) + (" | " if problems else "") + detail)


#: the LLaVA-OV and Emu3 core of the gpu tier: both families train on CUDA (bf16, distributed
#: optimizer, nccl), with TE hidden and, where installed, with TE; of the LLaVA-OV freeze sets only
#: "all" (one training each: the other two are `make test-gpu`'s)
TIER_CORE = ("tests/gpu/test_gpu_train.py", "-k", "not projector-only and not frozen-vision")


def check_tier(smoke: Smoke, budget: float) -> Outcome:
    """`pytest -m gpu` on TIER_CORE with CUDA visible; its counts from the junit report."""
    import xml.etree.ElementTree as ET

    junit = smoke.work / "tier.xml"
    junit.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "--junitxml",
        str(junit),
        "--basetemp",
        str(smoke.work / "tier"),
        *TIER_CORE,
    ]
    log = smoke.work / "logs" / "tier.log"
    rc, out = run_bounded(cmd, log, budget, {"MMTRAIN_GPU_TESTS": "1"})
    if not junit.exists():
        return Outcome("FAIL", f"{'timed out' if rc is None else f'exit {rc}'}: {last_error(out)} (log {log})")
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    bad = [
        c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None
    ]
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    detail = (
        f"{passed} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped of {n['tests']}"
        + (f"; failed: {', '.join(bad[:6])}" if bad else "")
        + (" (timed out)" if rc is None else "")
        + f" (log {log})"
    )
    return Outcome("FAIL" if bad or rc is None or passed == 0 else "PASS", detail)


def check_correctness(smoke: Smoke, budget: float) -> Outcome:
    r = run_child(smoke, "correctness", budget)
    return Outcome(r["status"], r["detail"])


def check_sync(smoke: Smoke, budget: float) -> Outcome:
    if not smoke.cuda:
        return Outcome("SKIP", "needs CUDA (sync debug mode)")
    r = run_child(smoke, "sync", budget)
    return Outcome(r["status"], r["detail"])


THROUGHPUT_RUNS = (  # (table key, family, seq, micro-batch, recompute, --quick seq)
    ("aquila-8k", "aquila-vl-2b", 8192, 2, "none", 4096),
    ("aquila-12k", "aquila-vl-2b", 12288, 2, "none", 8192),
    ("emu3-32k", "emu3-8b", 32768, 1, "full", 8448),
)


def check_throughput(smoke: Smoke, budget: float) -> Outcome:
    if not smoke.cuda:
        return Outcome("SKIP", "needs CUDA (timings)")
    out = smoke.work / "throughput.json"
    out.unlink(missing_ok=True)
    r = run_child(smoke, "throughput", budget)
    rows = json.loads(out.read_text()) if out.exists() else {}
    smoke.figures.update(rows)
    parts = [f"{k}: {v['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, MFU {_pct(v['mfu'])}" for k, v in rows.items()]
    return Outcome(r["status"], r["detail"] + (" | " + "; ".join(parts) if parts else ""))


def check_generation(smoke: Smoke, budget: float) -> Outcome:
    if not smoke.cuda:
        return Outcome("SKIP", "needs CUDA (an 8B-shaped model)")
    layers, steps = (2, 32) if smoke.args.quick else (4, 128)
    cmd = [sys.executable, str(HERE.parent / "gpu_check_generate.py"), "--layers", str(layers), "--steps", str(steps)]
    log = smoke.work / "logs" / "generation.log"
    rc, out = run_bounded(cmd, log, budget, hidden_te_env(smoke.work))
    if rc != 0:
        return Outcome("FAIL", f"{'timed out' if rc is None else f'exit {rc}'}: {last_error(out)} (log {log})")
    parsed = parse_generation(out)
    smoke.figures["generation"] = parsed
    nan = float("nan")
    return Outcome(
        "PASS",
        f"{layers} layers, {steps} steps: ours {parsed.get('ms_ours', nan):.2f} ms/token, "
        f"transformers {parsed.get('ms_hf', nan):.2f} ms/token; {parsed.get('prefill', '?')}; "
        f"{parsed.get('tokens', '?')}",
    )


def parse_generation(out: str) -> dict[str, Any]:
    """gpu_check_generate.py's figures from its output."""
    got: dict[str, Any] = {}
    for line in out.splitlines():
        s = line.strip()
        if s.startswith("{") and '"ours"' in s:
            d = json.loads(s)
            got["ms_ours"], got["ms_hf"] = d["ours"]["ms_per_token"], d["transformers"]["ms_per_token"]
        elif s.startswith("prefill logits:"):
            got["prefill"] = s
        elif s.startswith("tokens:"):
            got["tokens"] = s
        elif s.startswith("peak GPU memory"):
            got["peak_gib"] = float(s.split()[3])
    return got


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    name: str
    run: Callable[[Smoke, float], Outcome]
    budget_s: float  # its share of the 10 minutes (the review's estimate, with margin)
    cpu: bool  # runs under --allow-cpu without CUDA


#: in the order of issue 43's one GPU check: env, device, build, the gpu tier's core, the throughput
#: table; then the rest of the review's section E while the budget lasts
CHECKS = (
    CheckSpec("env", check_env, 45, True),
    CheckSpec("device", check_device, 60, True),
    CheckSpec("build", check_build, 90, True),
    CheckSpec("tier", check_tier, 180, False),
    CheckSpec("throughput", check_throughput, 210, False),
    CheckSpec("trainer", check_trainer, 150, True),
    CheckSpec("checkpoint", check_checkpoint, 120, True),
    CheckSpec("correctness", check_correctness, 120, True),
    CheckSpec("sync", check_sync, 120, False),
    CheckSpec("generation", check_generation, 180, False),
)
#: a check starts only with at least this share of its budget left (else SKIP, saying so)
MIN_SHARE = 0.5


# ----------------------------------------------------------------------------- children


def _import_problem(module: str) -> str | None:
    """Why `module` does not import here (its exception, one line), or None when it does."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure is the answer (a broken TE raises ImportError/OSError)
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


def child_env(args: argparse.Namespace) -> dict[str, Any]:
    """Versions and what imports. FAIL when megatron-core or megatron-energon does not import (every
    later check needs them; review 2, N2) or when TE's two views disagree."""
    import torch

    cuda = torch.cuda.is_available()
    parts = [
        f"python {sys.version.split()[0]}",
        f"torch {torch.__version__}",
        f"CUDA {torch.version.cuda}",
        f"devices {torch.cuda.device_count() if cuda else 0}"
        + (f" ({torch.cuda.get_device_name(0)})" if cuda else " (no CUDA)"),
    ]
    missing = {m: p for m in ("megatron.core", "megatron.energon") if (p := _import_problem(m))}
    if missing:
        parts += [f"{m} does not import: {p}" for m, p in missing.items()]
        parts.append(f"PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}")
        return {"status": "FAIL", "detail": "; ".join(parts)}
    from megatron.core import __version__ as mcore_version
    from megatron.energon import __version__ as energon_version

    from mmtrain.models.te_support import te_status

    parts += [f"megatron-core {mcore_version}", f"megatron-energon {energon_version}"]
    st = te_status()
    installed = importlib.util.find_spec("transformer_engine") is not None
    te_problem = _import_problem("megatron.core.extensions.transformer_engine")
    have_te: Any = (
        getattr(sys.modules["megatron.core.extensions.transformer_engine"], "HAVE_TE", None)
        if te_problem is None
        else f"import failed: {te_problem}"
    )
    have = {m: importlib.util.find_spec(m) is not None for m in ("flash_attn", "cut_cross_entropy", "liger_kernel")}
    parts += [
        f"transformer_engine {'installed' if installed else 'not installed'}",
        f"TE usable={st.available} version={st.version} reason={st.reason or '-'}",
        f"megatron HAVE_TE={have_te}",
        ", ".join(f"{m} {'yes' if v else 'no'}" for m, v in have.items()),
    ]
    status = "PASS"
    if st.available:
        from mmtrain.models.layer_specs import te_attention

        is_class = isinstance(te_attention(on_cuda=True), type)
        parts.append(f"te_attention(on_cuda=True) is a class: {is_class}")
        status = "PASS" if is_class and have_te is True else "FAIL"
    elif have_te is True:
        status, parts[-1] = "FAIL", parts[-1] + "; megatron HAVE_TE=True but te_status says unusable"
    elif te_problem is not None:  # megatron's TE module must import (it binds mocks) whatever TE's state
        status = "FAIL"
    return {"status": status, "detail": "; ".join(parts)}


def child_device_logic(args: argparse.Namespace) -> dict[str, Any]:
    """CPU stand-in for check 2: the same decision functions the GPU run takes."""
    from mmtrain.runtime.distributed import UnsupportedLayout, cuda_device_index, resolve_backend

    index = cuda_device_index(1, 1)
    try:
        resolve_backend("gloo", cuda_visible=True)
        a7 = None
    except UnsupportedLayout as e:
        a7 = str(e)
    ok = index == 0 and a7 is not None and "CUDA_VISIBLE_DEVICES" in a7
    return {
        "status": "PASS" if ok else "FAIL",
        "detail": f"(CPU: decision logic only) A5: LOCAL_RANK=1 with 1 visible device -> cuda:{index}; "
        f"A7: gloo with CUDA visible -> {a7[:90] + '...' if a7 else 'NOT refused'}",
    }


def child_a5(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from mmtrain.config.schema import ParallelConfig
    from mmtrain.runtime.distributed import destroy_distributed, init_distributed

    ctx = init_distributed(ParallelConfig(precision="bf16", distributed_optimizer=False), seed=1234)
    try:
        x = torch.ones(4, device=ctx.device).sum().item()
        ok = ctx.device == torch.device("cuda", 0) and torch.cuda.current_device() == 0 and x == 4
        return {
            "status": "PASS" if ok else "FAIL",
            "detail": f"LOCAL_RANK=1 with CUDA_VISIBLE_DEVICES=0 -> {ctx.device} (backend {ctx.backend})",
        }
    finally:
        destroy_distributed()


def _core_attention_classes(model: Any) -> set[str]:
    return {type(m.core_attention).__name__ for m in model.modules() if hasattr(m, "core_attention")}


def _in_vocab(batch: Any, model_cfg: Any) -> Any:
    """gpu_check's LLaVA-OV batch draws text ids from Qwen2.5's vocabulary: fold them below the tiny
    recipe's media ids (the image positions keep theirs)."""
    import torch

    top = min(model_cfg.image_token_id, model_cfg.video_token_id)
    image = batch.input_ids == model_cfg.image_token_id
    batch.input_ids = torch.where(image, batch.input_ids, batch.input_ids % top)
    batch.labels = torch.where(batch.labels >= 0, batch.labels % top, batch.labels)
    return batch


def child_build(args: argparse.Namespace, te_mode: str) -> dict[str, Any]:
    """Both tiny families on this device (bf16 on CUDA, fp32 on a CPU): build, one forward +
    backward on a synthetic packed batch (gpu_check's), finite loss; which core attention."""
    import torch

    import gpu_check
    from mmtrain.config import load_recipe
    from mmtrain.emu3.spec import EMU3
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.models.te_support import te_status
    from mmtrain.runtime.distributed import compute_device, ensure_model_parallel
    from mmtrain.runtime.loss import loss_mask, masked_loss_sum

    ensure_model_parallel(1, 1)
    device = compute_device()
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    st = te_status()
    parts, ok = [f"TE available={st.available}"], True
    if te_mode == "hidden" and st.available:
        return {"status": "FAIL", "detail": "TE still usable with transformer_engine hidden"}
    seqs = (4096, 2048) if device.type == "cuda" else (1024, 512)  # a CPU builds the same models, smaller batches
    for family, spec, recipe_path, seq in (
        ("llava-ov", LLAVA_OV, TINY_LLAVA, seqs[0]),
        ("emu3", EMU3, TINY_EMU3, seqs[1]),
    ):
        recipe = load_recipe(recipe_path, [])
        torch.manual_seed(0)
        opts = ParallelOptions(params_dtype=dtype, on_cuda=device.type == "cuda")
        model = spec.build_model(recipe.model, options=opts).to(device)
        if family == "llava-ov":
            batch = _in_vocab(gpu_check.synthetic_batch(recipe.model, 1, seq, torch.device("cpu")), recipe.model).to(
                device
            )
        else:
            batch = gpu_check.emu3_batch(recipe.model.llm.vocab_size, 1, seq, device)
        loss_sum, count, _ = masked_loss_sum(model(batch), loss_mask(batch))
        loss = loss_sum / count.clamp(min=1)
        loss.backward()
        grads = [p.grad if p.grad is not None else getattr(p, "main_grad", None) for p in model.parameters()]
        attn = _core_attention_classes(model)
        expect_te = device.type == "cuda" and st.available
        good = (
            math.isfinite(float(loss))
            and any(g is not None for g in grads)
            and (any("TE" in a for a in attn) == expect_te)
        )
        ok &= good
        parts.append(
            f"{family} {dtype} loss {float(loss):.3f} attention {','.join(sorted(attn))}" + ("" if good else " (WRONG)")
        )
        del model, batch
    return {"status": "PASS" if ok else "FAIL", "detail": "; ".join(parts)}


def _init_world_of_one() -> Any:
    import torch

    from mmtrain.config.schema import ParallelConfig
    from mmtrain.runtime.distributed import init_distributed

    precision = "bf16" if torch.cuda.is_available() else "fp32"
    return init_distributed(ParallelConfig(precision=precision, distributed_optimizer=False), seed=1234)


def child_correctness(args: argparse.Namespace) -> dict[str, Any]:
    """gpu_check.py's correctness section; each of its PASS/FAIL lines counted."""
    import contextlib
    import io

    import gpu_check

    ctx = _init_world_of_one()
    tiny = args.quick or not ctx.on_cuda
    errors = []
    calls: list[tuple[str, Callable[[], None]]] = [
        ("check_varlen", lambda: gpu_check.check_varlen(ctx.device, tiny)),
        ("check_loss", lambda: gpu_check.check_loss(ctx.device, tiny)),
        ("check_decoder", lambda: gpu_check.check_decoder(ctx.device, tiny)),
    ]
    if ctx.on_cuda:
        calls.append(("check_cp_layout", gpu_check.check_cp_layout))
    printed = io.StringIO()
    for name, call in calls:
        try:
            with contextlib.redirect_stdout(printed):  # gpu_check's own lines, echoed to the log below
                call()
        except Exception as e:  # noqa: BLE001 - one failing function, the others still run
            errors.append(f"{name} raised {type(e).__name__}: {str(e)[:150]}")
    print(printed.getvalue(), flush=True)
    notes = [
        x.strip().rstrip(")").lstrip("(")
        for x in printed.getvalue().splitlines()
        if "fused loss kernel" in x or "skipped" in x
    ]
    results = gpu_check.RESULTS
    failed = [f"{n}: {d}" for n, ok, d in results if not ok] + errors
    detail = (
        f"{sum(ok for _, ok, _ in results)}/{len(results)} sub-checks passed "
        f"({'tiny' if tiny else 'full'} sizes, {ctx.device.type}); " + "; ".join(notes)
    )
    return {
        "status": "FAIL" if failed or not results else "PASS",
        "detail": detail + ("; failed: " + " | ".join(failed) if failed else ""),
    }


def child_sync(args: argparse.Namespace) -> dict[str, Any]:
    """CUDA syncs of one Aquila-shaped decoder micro-batch, forward and backward, after a warm-up."""
    import collections
    import warnings

    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.utils import get_model_config

    import gpu_check
    from mmtrain.models.lm_loss import resolve_loss_impl
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.runtime.loss import loss_mask, masked_loss_sum

    ctx = _init_world_of_one()
    seq = 4096 if args.quick else 12288
    ns = argparse.Namespace(seq_length=seq, micro_batch=1, tiny=args.quick)
    work = gpu_check.aquila_workload(ns, with_vision=False)
    lm_loss = resolve_loss_impl("auto", tp=1, dtype=ctx.params_dtype, on_cuda=True)
    opts = ParallelOptions(params_dtype=ctx.params_dtype_name, lm_loss=lm_loss, on_cuda=True)
    module = work.build(opts).to(ctx.device)
    config = get_model_config(module)
    config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module=module,
    )
    batch = work.batch(1, seq, ctx.device)

    def micro_batch() -> Any:
        loss_sum, _, _ = masked_loss_sum(ddp(batch), loss_mask(batch))
        return loss_sum

    micro_batch().backward()  # warm-up: first-call setup is not the steady state
    torch.cuda.synchronize()
    counts, sites = {}, collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = micro_batch()
            counts["forward"] = len([w for w in caught if "synchroniz" in str(w.message)])
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    counts["backward"] = len(syncs) - counts["forward"]
    sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    top = ", ".join(f"{s} x{n}" for s, n in sites.most_common(3)) or "-"
    layers = work.recipe.model.llm.num_layers
    return {
        "status": "PASS",
        "detail": f"{len(syncs)} syncs per micro-batch (forward {counts['forward']}, backward {counts['backward']}; "
        f"decoder {layers} layers, seq {seq}, LM loss {lm_loss}); top sites: {top}",
    }


def child_throughput(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """gpu_check.throughput() for each of THROUGHPUT_RUNS; figures written after each one."""
    import gpu_check

    ctx = _init_world_of_one()
    rows: dict[str, dict] = {}
    errors = []
    for key, family, seq, mb, recompute, quick_seq in THROUGHPUT_RUNS:
        ns = argparse.Namespace(
            seq_length=quick_seq if args.quick else seq,
            micro_batch=mb,
            recompute=recompute,
            warmup=1 if args.quick else 2,
            steps=2 if args.quick else 3,
            tiny=False,
            emu3_layers=2 if args.quick else 4,
            decoder_only=False,
        )
        before, n_errors = len(gpu_check.FIGURES), len(errors)
        try:
            if family == "aquila-vl-2b":
                gpu_check.throughput(ns, ctx, gpu_check.aquila_workload(ns, with_vision=gpu_check.installed("PIL")))
            else:
                gpu_check.throughput(ns, ctx, gpu_check.emu3_workload(ns))
        except Exception as e:  # noqa: BLE001 - the next workload still runs
            errors.append(f"{key}: {type(e).__name__}: {str(e)[:150]}")
        new = gpu_check.FIGURES[before:]
        if new:
            rows[key] = dataclasses.asdict(new[-1])
        elif len(errors) == n_errors:
            errors.append(f"{key}: not timed (its dry-run estimate is above 92% of the device)")
        out.write_text(json.dumps(rows))
    failed = [f"{n}: {d}" for n, ok, d in gpu_check.RESULTS if not ok] + errors
    detail = f"{len(rows)}/{len(THROUGHPUT_RUNS)} workloads timed" + ("; " + " | ".join(failed) if failed else "")
    return {"status": "FAIL" if failed else "PASS", "detail": detail}


def run_as_child(args: argparse.Namespace) -> int:
    name, _, mode = args.child.partition(":")
    work = Path(args.work_dir)
    try:
        if name == "env":
            result = child_env(args)
        elif name == "device-logic":
            result = child_device_logic(args)
        elif name == "a5":
            result = child_a5(args)
        elif name == "build":
            result = child_build(args, mode or "te")
        elif name == "correctness":
            result = child_correctness(args)
        elif name == "sync":
            result = child_sync(args)
        elif name == "throughput":
            result = child_throughput(args, work / "throughput.json")
        else:
            result = {"status": "FAIL", "detail": f"unknown child {args.child!r}"}
    except Exception as e:  # noqa: BLE001 - the parent prints it as the check's error
        import traceback

        traceback.print_exc()
        result = {"status": "FAIL", "detail": f"{type(e).__name__}: {str(e)[:300]}"}
    emit(result)
    return 0


# ----------------------------------------------------------------------------- table and main


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def _layout(fig: dict) -> str:
    """What was timed, as the table's row label says it (quick sizes differ from the titles)."""
    import re

    layers = re.search(r"(\d+ of \d+ layers)", fig.get("title", ""))
    return ", ".join(
        [f"seq {fig['seq_length']} x {fig['micro_batch']}", f"recompute {fig.get('recompute', '?')}"]
        + (["decoder only"] if "decoder only" in fig.get("title", "") else [])
        + ([layers.group(1)] if layers else [])
    )


def table(figures: dict[str, dict]) -> list[str]:
    """The timed figures with the targets line."""
    gib = 2**30
    header = ("workload", "tokens/s/GPU", "MFU %", "peak GiB", "dry-run GiB", "ratio")
    rows = []
    for key, label in (
        ("aquila-8k", "Aquila-VL-2B 8K"),
        ("aquila-12k", "Aquila-VL-2B 12K"),
        ("emu3-32k", "Emu3 8B-shaped 4 layers 32K"),
    ):
        f = figures.get(key)
        if f is None:
            rows.append((label, "not run", "-", "-", "-", "-"))
            continue
        peak, est = f["peak_bytes"] / gib, f["estimate_bytes"] / gib
        rows.append(
            (
                f"{label} ({_layout(f)})",
                f"{f['tokens_per_s_per_gpu']:,.0f}",
                _pct(f["mfu"]),
                f"{peak:.1f}",
                f"{est:.1f}",
                f"{peak / est:.2f}" if est else "-",
            )
        )
    g = figures.get("generation")
    if g and "ms_ours" in g:
        rows.append(
            (
                "generation (ours, 1 image)",
                f"{1e3 / g['ms_ours']:,.1f}",
                "-",
                f"{g['peak_gib']:.1f}" if "peak_gib" in g else "-",
                "-",
                "-",
            )
        )
    else:
        rows.append(("generation", "not run", "-", "-", "-", "-"))
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in (header, *rows)
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("(ratio = peak / dry-run estimate; MFU by the corrected formula, models/flops.py step_flops)")
    lines.append(targets_line(figures))
    return lines


def targets_line(figures: dict[str, dict]) -> str:
    a8 = figures.get("aquila-8k")
    if a8 is None or a8.get("mfu") is None:
        mfu = "not run"
    else:
        mfu = (
            ("met" if a8["mfu"] >= MFU_TARGET else "not met")
            + f" ({_pct(a8['mfu'])}%"
            + (", aim reached)" if a8["mfu"] >= MFU_AIM else ")")
        )
    timed = [f for k, f in figures.items() if k != "generation" and f.get("estimate_bytes") and f.get("peak_bytes")]
    if not timed:
        peak = "not run"
    else:
        worst = max(abs(f["peak_bytes"] - f["estimate_bytes"]) / f["estimate_bytes"] for f in timed)
        peak = ("met" if worst <= PEAK_TOLERANCE else "not met") + f" (worst {worst:.0%})"
    return f"targets: MFU target >= 45% (aim 50%) for Aquila 8K: {mfu}; peak within 10% of dry run: {peak}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ",".join(c.name for c in CHECKS)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes: tiny correctness shapes, a tiny 2-layer decoder for the sync probe at 4,096, "
        "throughput at 4,096/8,192 and 2 Emu3 layers at 8,448, generation with 2 layers and 32 steps",
    )
    ap.add_argument("--only", default=None, help=f"comma-separated subset of the checks to run ({names})")
    ap.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA, run what a CPU can at tiny sizes (env, device's decision logic, build, "
        "trainer and checkpoint with 2 steps on gloo/fp32, correctness tiny) instead of skipping",
    )
    ap.add_argument(
        "--work-dir", default=None, help="where data, runs and each check's log go (default: a new temporary dir, kept)"
    )
    ap.add_argument(
        "--budget",
        "--total-budget",
        dest="total_budget",
        type=float,
        default=None,
        help="seconds for the whole run (default 600 on CUDA; under --allow-cpu on a CPU 4x that, and "
        "4x each check's budget: a CPU is not what is timed); a check gets min(its budget, what is "
        "left); a check whose budget is more than twice what is left is not started (SKIP, "
        "saying so)",
    )
    ap.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="write DIR/report.md and DIR/report.json (every check's status, detail and seconds, "
        "the table); the work dir defaults to DIR/work",
    )
    ap.add_argument(
        "--show",
        default=None,
        metavar="WORK_DIR",
        help="run nothing: print the table and targets of an earlier run from WORK_DIR/figures.json "
        "(every run writes it), the generation figures re-read from WORK_DIR/logs/generation.log",
    )
    ap.add_argument(
        "--child", default=None, help="internal: run one check's in-process part (the subprocess the parent starts)"
    )
    return ap


def report(work: Path) -> int:
    """`--show WORK_DIR`: the table of an earlier run, from its saved figures and logs."""
    try:
        figures = json.loads((work / "figures.json").read_text())
    except (OSError, ValueError) as e:
        print(f"gpu_smoke: --show: cannot read {work / 'figures.json'}: {e}", file=sys.stderr)
        return 2
    log = work / "logs" / "generation.log"
    if log.is_file():
        figures["generation"] = parse_generation(log.read_text(errors="replace"))
    print(f"generation: {json.dumps(figures.get('generation'), sort_keys=True)}")
    for line in table(figures):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return run_as_child(args)
    if args.show:
        return report(Path(args.show))
    selected = [c for c in CHECKS if args.only is None or c.name in args.only.split(",")]
    unknown = set(args.only.split(",")) - {c.name for c in CHECKS} if args.only else set()
    if unknown:
        print(
            f"gpu_smoke: --only: unknown check(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(c.name for c in CHECKS)})",
            file=sys.stderr,
        )
        return 2
    import torch

    if args.work_dir:
        work = Path(args.work_dir)
    elif args.report:
        work = Path(args.report) / "work"
    else:
        work = Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    work.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    scale = 1.0 if cuda else CPU_BUDGET_SCALE
    if args.total_budget is None:
        args.total_budget = 600.0 * scale
    smoke = Smoke(args=args, work=work, cuda=cuda, deadline=time.monotonic() + args.total_budget)
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    results: list[tuple[str, Outcome]] = []
    started = time.monotonic()
    for spec in selected:
        start = time.monotonic()
        if not cuda and not (args.allow_cpu and spec.cpu) and spec.name != "env":
            outcome = Outcome(
                "SKIP",
                "no CUDA device" + ("" if spec.cpu else " (a GPU-only check)") if args.allow_cpu else "no CUDA device",
            )
        elif smoke.remaining() < max(5.0, MIN_SHARE * spec.budget_s * scale):
            outcome = Outcome(
                "SKIP",
                f"not started: {max(0.0, smoke.remaining()):.0f} s left of the "
                f"{args.total_budget:.0f} s budget, it needs about {spec.budget_s * scale:.0f} s",
            )
        else:
            try:
                outcome = spec.run(smoke, min(spec.budget_s * scale, smoke.remaining()))
            except Exception as e:  # noqa: BLE001 - one line, and on to the next check
                outcome = Outcome("FAIL", f"{type(e).__name__}: {str(e)[:300]}")
        outcome.seconds = time.monotonic() - start
        counts[outcome.status] += 1
        results.append((spec.name, outcome))
        print(f"{outcome.status} {spec.name}: {outcome.detail} [{outcome.seconds:.1f} s]", flush=True)
    print(f"\nlogs and runs: {work}")
    (work / "figures.json").write_text(json.dumps(smoke.figures, indent=1, default=str))
    lines = table(smoke.figures)
    for line in lines:
        print(line)
    summary = f"GPU_SMOKE: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
    if args.report:
        write_report(Path(args.report), smoke, results, lines, summary, time.monotonic() - started)
        print(f"report: {Path(args.report) / 'report.md'} and report.json")
    print(summary, flush=True)
    return 1 if counts["FAIL"] else 0


def write_report(
    out: Path, smoke: Smoke, results: list[tuple[str, Outcome]], table_lines: list[str], summary: str, seconds: float
) -> None:
    """DIR/report.json (machine-readable) and DIR/report.md (for docs/gpu.md and a note)."""
    import platform

    import torch

    device = torch.cuda.get_device_name(0) if smoke.cuda else f"CPU ({platform.processor() or platform.machine()})"
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "device": device,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "budget_s": smoke.args.total_budget,
        "seconds": round(seconds, 1),
        "work_dir": str(smoke.work),
        "checks": [
            {"name": n, "status": o.status, "detail": o.detail, "seconds": round(o.seconds, 1)} for n, o in results
        ],
        "figures": smoke.figures,
        "summary": summary,
    }
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    md = [
        f"# gpu_smoke report: {device}",
        "",
        f"torch {torch.__version__}, Python {data['python']}; {seconds:.0f} s of the {smoke.args.total_budget:.0f} s "
        f"budget; logs in `{smoke.work}`.",
        "",
        "| check | status | seconds | detail |",
        "|---|---|---|---|",
    ]
    md += [f"| {n} | {o.status} | {o.seconds:.1f} | {o.detail.replace('|', '/')} |" for n, o in results]
    md += ["", "```", *table_lines, "```", "", summary, ""]
    (out / "report.md").write_text("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
