"""The sample ledger of `data.sharding: global` (issue 46): a tiny run goes DP 4 -> 3 -> 2 -> 4
with `data.num_workers` 2 -> 1 -> 3 -> 2 on gloo, stopped by `train.exit_interval` once and
SIGKILLed twice (after a seeded step shows in metrics.jsonl; the next segment resumes from the
last checkpoint saved, re-running the steps after it: a segment killed before its first save leaves
the next to resume from an earlier segment's), and resumed each time at the new layout.

The ledger is metrics.jsonl at the end (its records past a resumed checkpoint are dropped, so it
holds the final run of each step). Its per-step sample sets must equal the global order's, which
the run's own recipe gives (the family's loader built from `<run_dir>/config.yaml`: its planner is
what every rank followed); the uninterrupted DP 4 run trains that order too (the first segment, and
the loader's own tests at other layouts). Every sample of the first epoch (stream positions
`< N`) trains exactly once, and the run ends where that epoch's last sample trains. LLaVA-OV and
Emu3 (whose task and caption-drop choices the order draws per sample and epoch, positionally, so
they hold at any layout); exact text lengths (`--tokenizer`), so no planned row overflows.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from mmtrain.config.load import load_recipe
from mmtrain.runtime.checkpoint.layout import checkpoints_root, read_latest
from mmtrain.registry import FAMILIES
from mmtrain.runtime.launcher import child_pids
from tests.emu3_tiny import run_tokenize_cli, tokenize_args
from tests.fixtures_loader import pack_balanced_tiny_plan
from tests.fixtures_preprocess import tokenized_shards
from tests.fixtures_training import REPO, metrics, run_overrides, train_env

pytestmark = pytest.mark.slow

#: (DP size, data.num_workers) of the four segments
SEGMENTS = ((4, 2), (3, 1), (2, 3), (4, 2))
#: global batch: divisible by every DP size above at micro-batch 1
GLOBAL_BATCH = 12
RECIPES = {"llava-ov": REPO / "recipes" / "llava-ov-tiny.yaml", "emu3": REPO / "recipes" / "emu3-tiny.yaml"}


@pytest.fixture(scope="module")
def llava_data(tmp_path_factory) -> tuple[Path, Path]:
    """60 synthetic records with exact text lengths (the tiny Qwen2 tokenizer)."""
    return tokenized_shards(tmp_path_factory.mktemp("ledger"), 60, seed=5, samples_per_tar=20, samples_per_shard=20)


@pytest.fixture(scope="module")
def emu3_data(tmp_path_factory, llava_data, tiny_vq_dir, emu3_tok_dir) -> tuple[Path, Path]:
    """Those records as Emu3 token shards, the length index counted with the tiny Emu3 tokenizer."""
    out = tmp_path_factory.mktemp("ledger_emu3") / "tokens"
    run_tokenize_cli(*tokenize_args(llava_data[0], tiny_vq_dir, out, num_cpus=2, tokenizer=emu3_tok_dir))
    return out, emu3_tok_dir


def command(family: str, run: Path, data: Path, tok: Path, *overrides: str, nproc: int) -> list[str]:
    return [
        sys.executable, "-m", "mmtrain.cli", family, str(RECIPES[family]),
        *run_overrides(run, data, tok, *overrides, nproc=nproc),
    ]  # fmt: skip


def common(seq_length: int) -> tuple[str, ...]:
    return (
        "data.sharding=global",
        f"train.seq_length={seq_length}",
        f"train.global_batch_size={GLOBAL_BATCH}",
        "train.micro_batch_size=1",
        "checkpoint.interval=1",  # every segment resumes from the one before it (the layout change logged)
        "checkpoint.keep_last=2",
        "data.balance=true",
        "data.order_window=2",  # rows placed in cost tiers over two steps; an epoch of 8 steps
    )


def planned_steps(family: str, run_overrides_: list[str], steps: int) -> tuple[list[Counter], list[list[int]], int]:
    """The global order of the recipe: per step, the keys of its samples and their stream
    positions; and the number of samples of one epoch. Built by the family's own loader (no
    worker starts: only its planner is read)."""
    recipe = load_recipe(RECIPES[family], run_overrides_)
    loader = FAMILIES[family].build_loader.resolve()(recipe, dp_rank=0, dp_size=1)
    planner = loader.planner
    (source,) = planner.sources
    keys, positions = [], []
    for planned, _ in planner.steps_from(planner.initial_state()):
        if planned.step >= steps:
            break
        members = [m for row in planned.rows for m in row.members]
        keys.append(Counter(source.key(planner.sample_of(s, p)) for s, p in members))
        positions.append([p for _, p in members])
    return keys, positions, len(source)


def epoch_end(positions: list[list[int]], n: int) -> int:
    """The step (1-based) that trains the first epoch's last sample."""
    return max(i + 1 for i, step in enumerate(positions) if any(p < n for p in step))


def run_segment(args: list[str], log: Path, kill_after: int | None) -> str:
    """One segment; with `kill_after`, SIGKILL its process group once that step is in the metrics
    (a job lost with its node), else wait for it to end on its own. Its stderr."""
    run_dir = Path(next(a for a in args if a.startswith("run_dir=")).split("=", 1)[1])
    earlier = set(_metrics_lines(run_dir))  # the earlier segments' records (a step they logged is not this one's)
    with log.open("w") as f:
        proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=f, env=train_env(), cwd=REPO, start_new_session=True
        )
        if kill_after is None:
            rc = proc.wait(timeout=600)
            assert rc == 0, log.read_text()[-6000:]
        else:
            deadline = time.monotonic() + 600
            while kill_after not in _steps_logged(run_dir, earlier):
                assert proc.poll() is None, f"ended before step {kill_after}:\n{log.read_text()[-6000:]}"
                assert time.monotonic() < deadline
                time.sleep(0.05)
            kill_job(proc.pid)
            proc.wait()
    return log.read_text()


def kill_job(root: int) -> None:
    """SIGKILL `root` and every process under it at once, as a lost node takes them (torchrun
    starts each rank in a session of its own, so the launcher's process group is not all of
    them): the tree is stopped first, so nothing forks or writes in between."""
    tree: list[int] = []
    while new := [pid for pid in [root, *_descendants(root)] if pid not in tree]:
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        tree += new
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    kids = child_pids(pid)
    return kids + [g for c in kids for g in _descendants(c)]


def _metrics_lines(run_dir: Path) -> list[str]:
    try:
        return (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []


def _steps_logged(run_dir: Path, earlier: set[str]) -> set[int]:
    """The steps of metrics.jsonl's records other than the `earlier` ones (a rerun step's record
    differs: its timings)."""
    steps = set()
    for line in set(_metrics_lines(run_dir)) - earlier:
        try:
            steps.add(json.loads(line)["step"])
        except ValueError:  # a line being written
            pass
    return steps


def ledger_run(family: str, tmp_path: Path, data: Path, tok: Path, seq_length: int, seed: int) -> None:
    run = tmp_path / "run"
    base = list(run_overrides(run, data, tok, *common(seq_length)))
    keys, positions, n = planned_steps(family, base, steps=64)
    iters = epoch_end(positions, n)
    assert iters >= 5, f"the epoch ends at step {iters}: too few steps for four segments"
    # the first epoch's samples, each once (positions < n), and with them every key once
    assert sorted(p for step in positions[:iters] for p in step if p < n) == list(range(n))
    stops = sorted(random.Random(seed).sample(range(1, iters), 3))  # exit, kill, kill
    logs, saved_by = [], []  # saved_by[i]: (step, segment) of the checkpoint segment i resumes from
    latest = (0, -1)
    for i, (dp, workers) in enumerate(SEGMENTS):
        saved_by.append(latest)
        args = command(
            family, run, data, tok, *common(seq_length), f"train.iters={iters}", f"data.num_workers={workers}",
            *([f"train.exit_interval={stops[0]}"] if i == 0 else []), nproc=dp,
        )  # fmt: skip
        logs.append(run_segment(args, tmp_path / f"segment{i}.log", kill_after=stops[i] if i in (1, 2) else None))
        # (a segment killed before its first save leaves `latest` as it was: the next resumes from an earlier one)
        if (step := read_latest(checkpoints_root(run)) or 0) != latest[0]:
            latest = (step, i)
    for i in (1, 2, 3):  # each resumed from the last saved checkpoint, the data order continuing, not restarting
        step, by = saved_by[i]
        line = next((x for x in logs[i].splitlines() if "data order continues at step" in x), None)
        assert line is not None and f"continues at step {step} " in line, (step, logs[i][-4000:])
        (dp_was, w_was), (dp, w) = SEGMENTS[by], SEGMENTS[i]  # the layout that saved it, logged as changed
        same = (dp_was, w_was) == (dp, w)
        assert "same layout" in line if same else f"DP {dp_was} -> {dp}" in line, line
        assert same or f"data.num_workers {w_was} -> {w}" in line, line
    got = metrics(run)
    assert sorted(got) == list(range(1, iters + 1))
    for step in range(1, iters + 1):  # the ledger: the final run of each step trained its planned samples
        mine = Counter(sid.rsplit("#", 1)[-1] for sid in got[step]["sample_ids"])
        assert mine == keys[step - 1], (step, mine - keys[step - 1], keys[step - 1] - mine)
        assert got[step]["num_skipped"] == 0, got[step]["skipped"]
        assert len(got[step]["bytes_read_per_rank"]) in {dp for dp, _ in SEGMENTS} and got[step]["bytes_read"] > 0
        assert got[step]["shares"] == {data.name: 1.0}
    assert len(set().union(*keys[:iters])) == n  # so every key of the epoch trained, none lost


def test_llava_ov_ledger_across_dp_and_worker_changes_and_kills(tmp_path, llava_data):
    shards, tok = llava_data
    ledger_run("llava-ov", tmp_path, shards, tok, seq_length=256, seed=46)


def test_emu3_ledger_across_dp_and_worker_changes_and_kills(tmp_path, emu3_data):
    tokens, tok = emu3_data
    ledger_run("emu3", tmp_path, tokens, tok, seq_length=416, seed=47)  # its longest sample: 403


def test_a_packing_plans_order_resumes_at_another_layout_across_an_epoch(tmp_path, llava_data):
    """`data.packing: plan` in global order with a plan balanced for another step shape (DP 4, G 4):
    2 steps at DP 2 (micro-batch 1, a worker), resumed at DP 1 (micro-batch 2, no worker) to step 4
    (the plan's 8 sequences: steps 3 and 4 are its second epoch); every step trained the plan's
    sequences of that step (`PlanSteps`)."""
    shards = tmp_path / "shards"
    shutil.copytree(llava_data[0], shards)  # (the plan file beside the shared fixture's shards: a copy)
    tok, run = llava_data[1], tmp_path / "run"
    pack_balanced_tiny_plan(shards, 1024, dp=4, micro_batch_size=1, global_batch=4)
    plan = ("data.sharding=global", "data.packing=plan", "data.balance=true", "train.global_batch_size=4")
    plan += ("train.seq_length=1024", "checkpoint.interval=1", "checkpoint.keep_last=2")
    segments = (
        (2, ("train.micro_batch_size=1", "data.num_workers=1", "train.iters=2")),
        (1, ("train.micro_batch_size=2", "data.num_workers=0", "train.iters=4")),
    )
    for i, (dp, extra) in enumerate(segments):
        log = run_segment(command("llava-ov", run, shards, tok, *plan, *extra, nproc=dp), tmp_path / f"s{i}.log", None)
    assert "data order continues at step 2 (global order), layout changed: DP 2 -> 1, micro-batch 1 -> 2" in log
    recipe = load_recipe(RECIPES["llava-ov"], run_overrides(run, shards, tok, *plan, "train.iters=4"))
    steps = FAMILIES["llava-ov"].build_loader.resolve()(recipe, dp_rank=0, dp_size=1).planner
    assert steps.plan.num_sequences == 8
    got = metrics(run)
    for _, (planned, _) in zip(range(4), steps.resume(steps.document(0, 0))):
        want = Counter(steps.sample_at(m)[2] for m in planned.members())
        assert Counter(s.rsplit("#", 1)[-1] for s in got[planned.step + 1]["sample_ids"]) == want, planned.step
