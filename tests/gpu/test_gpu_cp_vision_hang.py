"""Review N8 on 4 GPUs: does the vision tower's own layout (`parallel.vision.tp=1`) hang under
context parallelism with `CUDA_DEVICE_MAX_CONNECTIONS=1`?

The separate layout's gather issues a synchronous CP all-reduce inside the backward
(`models/encoder_parallel.py`), while megatron's overlapped DDP issues the DP x CP gradient
reduce-scatters from backward hooks. With one hardware queue (tp > 1 sets
`CUDA_DEVICE_MAX_CONNECTIONS=1`), ranks that issue these in different orders deadlock. The
reading (gpu-path-review-2.md, N8; docs/gpu.md) argues that the order matches on every rank,
CP ranks with and without media alike; nothing has measured it.

This runs the smallest layout that has all three: TP 2 x CP 2 on 4 GPUs, the tower's own layout,
bf16 with the distributed optimizer (overlapped grad reduce), 8 steps over image and text-only
samples alternating (CP ranks with and without media), with a wall-clock bound. A run that does
not exit within the bound, or that NCCL's watchdog aborts, fails as a hang; its output tail is in
the failure. CP on CUDA needs Transformer Engine's attention, so the check skips without TE.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.gpu import runs

pytestmark = pytest.mark.gpu

#: wall-clock bound of the 4-rank run: start-up (4 imports, build, NCCL init) takes about a
#: minute, 8 tiny steps seconds; a run still going after this has hung
HANG_TIMEOUT_S = 360
#: NCCL's own watchdog (parallel.collective_timeout_mins) aborts a collective stuck this long
WATCHDOG_MINS = 4
STEPS = 8
OVERRIDES = (
    f"train.iters={STEPS}",
    "checkpoint.interval=0",
    "data.sharding=replicated",
    "train.global_batch_size=4",
    *runs.LLAVA_ORDERED,
    *runs.GPU,
    "parallel.nproc_per_node=4",
    "parallel.tp=2",
    "parallel.cp=2",
    "parallel.vision.tp=1",
    f"parallel.collective_timeout_mins={WATCHDOG_MINS}",
)
HANG_SIGNS = ("Watchdog caught collective operation timeout", "ProcessGroupNCCL", "timed out")


def train_bounded(run_dir, data, tokenizer, *overrides: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`runs.train` with a wall-clock bound: past it the run's process group (torchrun and its
    ranks) is killed and the test fails as a hang, with the output tail."""
    cmd = runs.train_args("llava-ov", run_dir, data, tokenizer, *overrides)
    env = runs.run_env({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=runs.REPO, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"HANG: TP2 x CP2 with parallel.vision.tp=1 did not exit within {timeout_s:.0f} s "
            f"(review N8); output tail:\n{out[-2000:]}\n{err[-6000:]}"
        )
    took = time.monotonic() - start
    if proc.returncode != 0:
        hang = any(sign in err for sign in HANG_SIGNS)
        pytest.fail(
            f"{'HANG (NCCL watchdog)' if hang else 'FAILED'}: exit {proc.returncode} after {took:.0f} s "
            f"(review N8):\n{out[-2000:]}\n{err[-8000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_vision_own_layout_under_cp_does_not_hang(request, tmp_path):
    """TP 2 x CP 2 on 4 GPUs with the tower's own layout and CUDA_DEVICE_MAX_CONNECTIONS=1 trains
    its 8 steps to the end (no deadlock between the gather's CP all-reduce and DDP's overlapped
    reduce-scatters), with finite losses. Skips before any fixture is built."""
    runs.need_gpus(4)
    te = runs.te_probe()
    if not te["available"]:
        pytest.skip(f"CP on CUDA needs Transformer Engine: {te['reason']}")
    shards, tok, start = (request.getfixturevalue(name) for name in ("llava_shards", "qwen_tok", "llava_hf_start"))
    run = tmp_path / "run"
    proc = train_bounded(run, shards, tok, *OVERRIDES, f"checkpoint.load={start}", timeout_s=HANG_TIMEOUT_S)
    assert "vision tower: its own layout, TP 1" in proc.stderr
    assert "backend=nccl" in proc.stderr
    runs.assert_finite(runs.metrics(run), range(1, STEPS + 1))
