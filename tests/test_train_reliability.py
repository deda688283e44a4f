"""Training faults (docs/reliability.md): stopping early and resuming exactly (SIGTERM,
train.exit_interval, train.exit_duration_mins), damaged or foreign checkpoints refused with a
message naming the problem, and a dying rank ending the whole job with a non-zero status that
names it. Real `mmtrain llava-ov` subprocesses on the tiny recipe (helpers: tests/fixtures_training.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mmtrain.runtime.checkpoint.integrity import CheckpointDamagedError, check_checkpoint
from mmtrain.runtime.launcher import child_pids
from tests.fixtures_training import REPO, free_port, metrics, run_killed, train, train_args

RUN = ("train.iters=6", "checkpoint.interval=2", "checkpoint.keep_last=2")


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMTRAIN_CPU_THREADS": "1"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    """Until metrics.jsonl shows `step` (the process must still be running)."""
    f = run_dir / "metrics.jsonl"
    while not (f.exists() and any(json.loads(x)["step"] >= step for x in f.read_text().splitlines() if x.strip())):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)


def _latest(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text())


# ----------------------------------------------------------------------------- stopping early


@pytest.mark.slow
def test_stops_early_then_resumes_exactly(ref_run, tmp_path, shards_dir, tokenizer_dir):
    """exit_duration_mins, then exit_interval, then SIGTERM stop the run after a whole step with a
    checkpoint and exit 0; each rerun resumes, and every loss is the uninterrupted run's."""
    run = tmp_path / "run"
    proc = train(run, shards_dir, tokenizer_dir, *RUN, "train.exit_duration_mins=0.0001")
    assert "stopped after step 1/6 (train.exit_duration_mins reached)" in proc.stderr
    assert _latest(run) == 1
    proc = train(run, shards_dir, tokenizer_dir, *RUN, "train.exit_interval=3")
    assert "resumed from" in proc.stderr and "stopped after step 3/6 (train.exit_interval reached)" in proc.stderr
    assert _latest(run) == 3

    p = _start(train_args(run, shards_dir, tokenizer_dir, *RUN))
    _wait_for_step(run, p, 4)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate()
    assert p.returncode == 0, err[-4000:]
    stopped = _latest(run)
    assert 4 <= stopped <= 6
    if stopped < 6:  # (the signal may land after the last step: then the run just ends)
        assert "SIGTERM received: finishing the current step" in err
        assert f"stopped after step {stopped}/6 (SIGTERM received)" in err
    ref, got = metrics(ref_run), metrics(run)
    assert sorted(got) == list(range(1, stopped + 1))
    for step in got:  # steps 2-3 and 4-6 ran after a resume
        assert got[step]["loss"] == ref[step]["loss"], step
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], step


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_its_workers_cleanly(tmp_path, shards_dir, tokenizer_dir):
    """`mmtrain` with 2 workers under torchrun: SIGTERM to the launcher (what `kill PID` or a
    scheduler sends) reaches the workers, not torchrun (which would kill them and fail): they
    finish the step, save, and the launcher exits 0."""
    run = tmp_path / "run"
    p = _start(train_args(run, shards_dir, tokenizer_dir, "train.iters=30", "checkpoint.interval=0", nproc=2))
    _wait_for_step(run, p, 2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate()
    assert p.returncode == 0, err[-4000:]
    assert "SIGTERM: passed to 2 workers" in err
    stopped = _latest(run)
    assert 2 <= stopped < 30 and f"stopped after step {stopped}/30 (SIGTERM received)" in err
    assert sorted(metrics(run)) == list(range(1, stopped + 1))


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_save_keeps_the_previous_one(ref_run, tmp_path, shards_dir, tokenizer_dir):
    """SIGKILL while checkpoint 4 is saved, first with only its model part staged, then with
    everything staged but not yet renamed into place: each time `latest` stays 2 and checkpoint
    2 stays whole, and the rerun resumes from it with the uninterrupted run's losses."""
    from tests.workers import kill_in_save

    run = tmp_path / "run"
    staged = run / "checkpoints" / ".staging" / "iter_0000004"
    for point in ("model", "publish"):
        rc, err = run_killed(
            kill_in_save.command(f"4:{point}", train_args(run, shards_dir, tokenizer_dir, *RUN)),
            tmp_path / f"{point}.log",
        )
        assert rc == -signal.SIGKILL, f"{point}: not killed ({rc})\n{err[-3000:]}"
        assert _latest(run) == 2 and not (run / "checkpoints" / "iter_0000004").exists(), point
        assert any((staged / "model").iterdir()), point  # the save was under way
        assert (staged / "files.json").exists() == (point == "publish"), point
        check_checkpoint(run / "checkpoints" / "iter_0000002", "llava-ov")
    proc = train(run, shards_dir, tokenizer_dir, *RUN)
    assert "resumed from" in proc.stderr and "iter_0000002" in proc.stderr
    assert _latest(run) == 6 and not staged.exists()
    ref, got = metrics(ref_run), metrics(run)
    assert sorted(got) == list(range(1, 7))
    for step in got:  # steps 3-6 ran after the resume from checkpoint 2
        assert got[step]["loss"] == ref[step]["loss"], step
        assert got[step]["sample_ids"] == ref[step]["sample_ids"], step


def _cmdline(pid: int) -> str | None:
    """A process's command line; None when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_FORKER = """
import os, signal, sys, threading, time
from mmtrain.runtime.child_processes import forked_children_die_with_this_process

forked_children_die_with_this_process()


def fork_sleeper():
    pid = os.fork()
    if pid == 0:
        os.close(1), os.close(2)  # the test reads the parent's output to its end
        time.sleep(120)
        os._exit(0)
    return pid


from_thread = []
t = threading.Thread(target=lambda: from_thread.append(fork_sleeper()))
t.start()
t.join()
print(fork_sleeper(), from_thread[0], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_children_forked_from_the_main_thread_die_with_a_sigkilled_parent():
    """The at-fork hook of child_processes.py: a child forked from the main thread is SIGKILLed
    with its parent; one forked from another thread (whose end would kill it too early) is not."""
    p = subprocess.run([sys.executable, "-c", _FORKER], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == -signal.SIGKILL, p.stderr
    from_main, from_thread = map(int, p.stdout.split())
    try:
        deadline = time.monotonic() + 30
        while _alive(from_main) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(from_main)
        assert _alive(from_thread)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(from_thread, signal.SIGKILL)


@pytest.mark.slow
def test_a_sigkilled_run_leaves_no_process_behind(tmp_path, shards_dir, tokenizer_dir):
    """`kill -9` of a one-process run, its process alone (a user's `kill -9 PID`, not a scheduler
    taking the job's group): the processes it started end with it. A checkpoint is saved at every
    step, so the kill often lands mid-save. Before, the torch_dist writer's multiprocessing manager
    and multiprocessing's resource tracker stayed behind for good, and so did a writer forked for
    a save the kill interrupted (in about 1 run in 4)."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMTRAIN_CPU_THREADS": "1"}
    p = subprocess.Popen(
        train_args(run, shards_dir, tokenizer_dir, "train.iters=200", "checkpoint.interval=1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        _wait_for_step(run, p, 2)  # checkpoint 1 is saved: the writer's manager is running
        started = {pid: cmd for pid in _descendants(p.pid) if (cmd := _cmdline(pid)) is not None}
        assert any("multiprocessing.spawn" in cmd for cmd in started.values()), started
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 60  # torch's loader workers look for their parent every 5 s
        while (left := [pid for pid in started if _alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, {pid: started[pid] for pid in left}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- damaged checkpoints


def _copy_ckpt(ref_run: Path, dst: Path) -> Path:
    """A run dir holding a copy of the reference run's checkpoints (latest: step 6)."""
    shutil.copytree(ref_run / "checkpoints", dst / "checkpoints")
    return dst / "checkpoints" / "iter_0000006"


def _fake_ckpt(run_dir: Path) -> Path:
    """A checkpoint's files as a save leaves them (contents aside): the file list is real."""
    from mmtrain.runtime.checkpoint.integrity import write_file_list
    from mmtrain.runtime.checkpoint.layout import write_latest

    ckpt = run_dir / "checkpoints" / "iter_0000006"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "__0_0.distcp").write_bytes(os.urandom(4096))
    (ckpt / "optimizer").mkdir()
    (ckpt / "optimizer" / "common.pt").write_bytes(os.urandom(1261))
    (ckpt / "trainer_state.json").write_text(json.dumps({"format": 2, "step": 6}))
    (ckpt / "config.yaml").write_text("action: run\nfamily: llava-ov\n")
    write_file_list(ckpt)
    write_latest(ckpt.parent, 6)
    return ckpt


@pytest.mark.unit
def test_damaged_or_foreign_checkpoints_are_named(tmp_path):
    """Each damage is refused before loading, naming the file or the family (in-process)."""
    ckpt = _fake_ckpt(tmp_path / "a")
    check_checkpoint(ckpt, "llava-ov")  # whole
    with pytest.raises(CheckpointDamagedError, match="a checkpoint of a llava-ov run, not emu3"):
        check_checkpoint(ckpt, "emu3")
    shard = ckpt / "model" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointDamagedError, match="model/__0_0.distcp has 1000 bytes but was saved with 4096"):
        check_checkpoint(ckpt, "llava-ov")
    shard.unlink()
    with pytest.raises(CheckpointDamagedError, match="incomplete, model/__0_0.distcp is missing"):
        check_checkpoint(ckpt, "llava-ov")
    ckpt = _fake_ckpt(tmp_path / "b")
    (ckpt / "trainer_state.json").write_text('{"step": ')
    (ckpt / "files.json").unlink()  # (an older checkpoint without a file list: still checked)
    with pytest.raises(CheckpointDamagedError, match="trainer_state.json: unreadable"):
        check_checkpoint(ckpt, "llava-ov")


def test_truncated_checkpoint_refused_by_the_cli(tmp_path, shards_dir, tokenizer_dir):
    """A rerun whose latest checkpoint was cut short: one line naming the file, exit 2, before
    anything is built."""
    ckpt = _fake_ckpt(tmp_path / "run")
    shard = ckpt / "optimizer" / "common.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    proc = train(tmp_path / "run", shards_dir, tokenizer_dir, *RUN, expect_rc=2)
    assert "optimizer/common.pt has 100 bytes but was saved with 1261" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_checkpoint_damaged_inside_a_file_refused_at_load(ref_run, tmp_path, shards_dir, tokenizer_dir):
    """Same size, garbage content (the dist-checkpoint metadata): the loader's failure is
    reported as a damaged checkpoint, naming the part, exit 2."""
    ckpt = _copy_ckpt(ref_run, tmp_path / "run")
    meta = ckpt / "model" / ".metadata"
    meta.write_bytes(bytes(len(meta.read_bytes())))
    # train.iters past the checkpoint's step 6: a rerun at step 6 of 6 has nothing to load ("nothing to do")
    proc = train(tmp_path / "run", shards_dir, tokenizer_dir, *RUN, "train.iters=8", expect_rc=2)
    assert "iter_0000006: its model state cannot be loaded" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- a dying rank


def _descendants(pid: int) -> list[int]:
    kids = child_pids(pid)
    return kids + [g for c in kids for g in _descendants(c)]


def _worker_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"mmtrain.runtime.worker" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def _signal_rank_1_after_step_1(
    run: Path, shards_dir: Path, tokenizer_dir: Path, sig: signal.Signals, timeout_mins: float
) -> tuple[str, int]:
    """DP=2 training (50 steps); once step 1 is logged, `sig` to rank 1's worker, then wait for the
    job to end (it must, and with a non-zero status). Returns (its stderr, rank 1's pid)."""
    p = _start(
        train_args(
            run,
            shards_dir,
            tokenizer_dir,
            "train.iters=50",
            "checkpoint.interval=0",
            f"parallel.collective_timeout_mins={timeout_mins}",
            nproc=2,
        )
    )
    _wait_for_step(run, p, 1)
    victim = _worker_pid(p.pid, 1)
    assert victim is not None
    os.kill(victim, sig)
    t0 = time.monotonic()
    try:
        _, err = p.communicate(timeout=300)  # a hang guard, not a speed requirement
    except subprocess.TimeoutExpired as hung:
        p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        raise AssertionError(f"the job hung after rank 1 got {sig.name}") from hung
    print(f"job ended {time.monotonic() - t0:.1f} s after rank 1 got {sig.name}")
    assert p.returncode != 0
    return err, victim


@pytest.mark.slow
def test_a_dying_rank_ends_the_job_naming_it(tmp_path, shards_dir, tokenizer_dir):
    """DP=2: rank 1 is SIGKILLed after step 1; the whole job exits non-zero (no hang), and the
    failure summary names rank 1."""
    err, _ = _signal_rank_1_after_step_1(tmp_path / "run", shards_dir, tokenizer_dir, signal.SIGKILL, 1)
    # torchrun's failure summary: "rank      : 1 (local_rank: 1) / exitcode  : -9 ... Signal 9 (SIGKILL)"
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", err), err[-3000:]
    assert "Signal 9 (SIGKILL)" in err and "workers exited with code" in err


@pytest.mark.slow
def test_a_hanging_rank_ends_the_job_after_the_collective_timeout(tmp_path, shards_dir, tokenizer_dir):
    """DP=2: rank 1 is frozen (SIGSTOP) after step 1, alive but silent, as a rank stuck in a
    driver or on a dead file system; rank 0's next collective fails after
    `parallel.collective_timeout_mins` (here 0.2: 12 s) and the whole job exits non-zero."""
    run = tmp_path / "run"
    err, victim = _signal_rank_1_after_step_1(run, shards_dir, tokenizer_dir, signal.SIGSTOP, 0.2)
    assert max(metrics(run)) < 50, "training went on without rank 1"
    # rank 0's gradient all-reduce (on megatron's DP group) times out after 12 s, then torchrun
    # stops the frozen rank 1 (SIGTERM is not delivered to a stopped process: SIGKILL after 30 s)
    assert "Timed out waiting 12000ms" in err, err[-3000:]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", err), err[-3000:]
    assert not Path(f"/proc/{victim}").exists() or "zombie" in Path(f"/proc/{victim}/status").read_text()


# ----------------------------------------------------------------------------- two nodes


@pytest.mark.slow
def test_two_nodes_by_torchrun_on_loopback_match_one_process(ref_run, tmp_path, shards_dir, tokenizer_dir):
    """`parallel.nnodes=2`: the same command on two "nodes" (node_rank 0 and 1, one process each,
    torchrun's multi-node rendezvous on 127.0.0.1) trains DP=2 and reproduces the single-process
    run's losses on the same global batches (`data.sharding=replicated`); it stops after step 3
    (`train.exit_interval`, agreed by both ranks). The `config.yaml` both launchers write in the
    shared run dir (and hand to their workers) is the same on both: node_rank 0."""
    run = tmp_path / "run"
    port = free_port()
    nodes = [
        _start(
            train_args(
                run,
                shards_dir,
                tokenizer_dir,
                *RUN,
                "train.exit_interval=3",
                "data.sharding=replicated",
                "parallel.nnodes=2",
                f"parallel.node_rank={k}",
                "parallel.master_addr=127.0.0.1",
                f"parallel.master_port={port}",
            )
        )
        for k in (0, 1)
    ]
    for k, p in enumerate(nodes):
        _, err = p.communicate()
        assert p.returncode == 0, f"node {k}:\n{err[-6000:]}"
        assert f"--nnodes=2 --node_rank={k} --master_addr=127.0.0.1 --master_port={port}" in err
    # each launcher wrote the shared config.yaml its workers read: the same file on both nodes
    assert yaml.safe_load((run / "config.yaml").read_text())["parallel"]["node_rank"] == 0
    # both ranks agreed to stop after step 3 (train.exit_interval), with a checkpoint
    state = json.loads((run / "checkpoints" / "iter_0000003" / "trainer_state.json").read_text())
    assert state["layout"] == {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "world_size": 2}
    ref, got = metrics(ref_run), metrics(run)
    assert sorted(got) == [1, 2, 3]
    for step in got:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5, abs=1e-6), step
        assert sorted(got[step]["sample_ids"]) == sorted(ref[step]["sample_ids"]), step
