"""One writer per folder (mmdata/folder_lock.py): a second job on a training's run_dir, a
preprocess --output or a conversion's --dst exits 2 at once naming the holder and writes nothing;
a lock whose holder died is taken over with a message; a conversion refuses a non-empty --dst
without --overwrite and, with it, replaces the folder whole (no stale shard stays behind).

The holder is always another process (a child started here, or this test process against a
real `mmtrain` / `mmdata` subprocess): `flock` conflicts between processes, not within one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mmdata.errors import UserError
from mmdata.folder_lock import FolderLock, fresh_folder, lock_path
from tests.fixtures_preprocess import run_preprocess
from tests.fixtures_convert import convert_cli
from tests.fixtures_training import train

HOST = socket.gethostname()

HOLDER = textwrap.dedent("""
    import os, signal, sys
    from mmdata.folder_lock import FolderLock
    with FolderLock(sys.argv[1], "run_dir"):
        print("held", flush=True)
        if sys.argv[2] == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up: the record stays, the flock goes
        sys.stdin.read()
""")


def _holder(folder: Path, mode: str = "wait") -> subprocess.Popen:
    """A child process holding `folder`'s lock (until its stdin closes, or killed at once)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


# ----------------------------------------------------------------------------- the lock itself


def test_second_holder_is_refused_naming_the_first(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    child = _holder(run_dir)
    try:
        with pytest.raises(UserError) as err:
            with FolderLock(run_dir, "run_dir"):
                pytest.fail("two holders")
        msg = str(err.value)
        assert f"run_dir {run_dir} is in use by another job: pid {child.pid} on {HOST} since " in msg
        assert "choose another run_dir" in msg and "\n" not in msg
        record = json.loads(lock_path(run_dir).read_text())
        assert (record["pid"], record["host"]) == (child.pid, HOST)  # the holder's record is left as it was
    finally:
        child.stdin.close()
        child.wait()
    assert not lock_path(run_dir).exists()  # the holder removed it on release
    with FolderLock(run_dir, "run_dir"):  # free again
        assert json.loads(lock_path(run_dir).read_text())["pid"] == os.getpid()
    assert not run_dir.exists()  # a lock creates nothing inside (or as) the folder


def test_lock_of_a_dead_holder_is_taken_over_with_a_message(tmp_path, capsys):
    run_dir = tmp_path / "run"
    child = _holder(run_dir, "die")
    assert child.wait() == -signal.SIGKILL
    assert json.loads(lock_path(run_dir).read_text())["pid"] == child.pid  # the stale record
    with FolderLock(run_dir, "run_dir"):
        assert json.loads(lock_path(run_dir).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert f"taking over the lock of pid {child.pid} on {HOST} (no longer running)" in err
    assert not lock_path(run_dir).exists()


FORKING_HOLDER = textwrap.dedent("""
    import os, signal, sys, time
    from mmdata.folder_lock import FolderLock
    with FolderLock(sys.argv[1], "run_dir"):
        ready_r, ready_w = os.pipe()
        child = os.fork()  # like a loader worker: it outlives the holder's kill -9 here
        if child == 0:
            os.write(ready_w, b"x")  # fork's after-in-child hooks have run by now
            time.sleep(600)
            os._exit(0)
        os.read(ready_r, 1)  # a worker that has started (under load the kill could otherwise come first)
        print(child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_forked_child_does_not_keep_its_dead_parents_lock(tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    orphan = int(holder.stdout.readline())
    try:
        assert holder.wait() == -signal.SIGKILL
        os.kill(orphan, 0)  # still running
        with FolderLock(run_dir, "run_dir"):
            pass
        assert f"taking over the lock of pid {holder.pid} on {HOST} (no longer running)" in capsys.readouterr().err
    finally:
        os.kill(orphan, signal.SIGKILL)


@pytest.mark.unit
def test_record_of_another_host_is_not_taken_over(tmp_path):
    """Its holder may still run there (with client-local locks, its flock would not show here)."""
    out = tmp_path / "shards"
    lock_path(out).write_text(json.dumps({"pid": 1, "host": "node-elsewhere", "started": "then", "command": "x"}))
    with pytest.raises(
        UserError,
        match=rf"locked by pid 1 on node-elsewhere since then \(x\), on another host.*"
        rf"delete {lock_path(out)}",
    ):
        with FolderLock(out, "--output"):
            pass
    assert lock_path(out).exists()


def test_one_process_may_take_its_own_lock_again_and_a_refusal_leaves_no_folders(tmp_path):
    run_dir = tmp_path / "new" / "deep" / "run"
    with FolderLock(run_dir, "run_dir"):
        with FolderLock(run_dir, "run_dir"):  # e.g. auto-tune's --launch trains in the same process
            pass
        assert lock_path(run_dir).exists()  # still held after the inner block
        child = subprocess.run(
            [sys.executable, "-c", HOLDER, str(run_dir), "wait"], capture_output=True, text=True, input=""
        )
        assert child.returncode == 1 and f"in use by another job: pid {os.getpid()}" in child.stderr
    assert not (tmp_path / "new").exists()  # the parents made for the lock file are removed again


# ----------------------------------------------------------------------------- replacing a folder


@pytest.mark.unit
def test_fresh_folder_refuses_non_empty_and_replaces_whole(tmp_path):
    dst = tmp_path / "export"
    dst.mkdir()
    (dst / "model-00007-of-00009.safetensors").write_text("stale")
    with pytest.raises(
        UserError,
        match=r"--dst .*export is not empty \(1 entry, e.g. 'model-00007-of-00009.sa"
        r"fetensors'\).*pass --overwrite",
    ):
        with fresh_folder(dst, overwrite=False):
            pytest.fail("a non-empty --dst accepted")
    with pytest.raises(RuntimeError):
        with fresh_folder(dst, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_text("half")
            raise RuntimeError("crash midway")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing half-written is left
    assert [p.name for p in dst.iterdir()] == ["model-00007-of-00009.safetensors"]  # the old one intact
    with fresh_folder(dst, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert [p.name for p in dst.iterdir()] == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


@pytest.mark.unit
def test_fresh_folder_puts_back_what_an_interrupted_replacement_moved_aside(tmp_path, capsys):
    dst = tmp_path / "export"
    old = tmp_path / ".export.old-4242"  # killed between its two renames
    old.mkdir()
    (old / "config.json").write_text("{}")
    (tmp_path / ".export.tmp-4242").mkdir()
    with pytest.raises(UserError, match="is not empty"):
        with fresh_folder(dst, overwrite=False):
            pass
    assert "restored the folder an interrupted replacement had moved to .export.old-4242" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and (dst / "config.json").is_file()


# ----------------------------------------------------------------------------- the real commands


def test_a_second_training_into_a_held_run_dir_exits_2_and_writes_nothing(tmp_path, shards_dir, tokenizer_dir):
    run_dir = tmp_path / "run"
    with FolderLock(run_dir, "run_dir"):
        proc = train(run_dir, shards_dir, tokenizer_dir, "train.iters=2", expect_rc=2)
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith(
        f"mmtrain llava-ov: error: run_dir {run_dir} is in use by another job: pid {os.getpid()} on {HOST} since "
    ), proc.stderr[-2000:]
    assert not run_dir.exists()  # no config.yaml, no metrics.jsonl, no checkpoints


# The launcher holds the run_dir while its torchrun workers train under it (and releases it):
# tests/test_train_runtime.py::test_resume_on_pipeline_parallel_layout (PP=2, 2 workers).


def test_a_second_preprocess_into_a_held_output_exits_2_and_writes_nothing(tmp_path, synth_raw_dir):
    out = tmp_path / "shards"
    child = _holder(out)
    try:
        proc = run_preprocess(synth_raw_dir, out, num_cpus=1, check=False)
    finally:
        child.stdin.close()
        child.wait()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"mmdata preprocess: error: --output {out} is in use by another job: pid {child.pid} on {HOST}")
    )
    assert not out.exists()


def test_conversion_into_a_held_dst_exits_2(converted, tmp_path, capsys):
    dst = tmp_path / "hf"
    child = _holder(dst)
    try:
        assert convert_cli("mcore-to-hf", "--model", "llava-ov", "--src", str(converted), "--dst", str(dst)) == 2
    finally:
        child.stdin.close()
        child.wait()
    assert f"--dst {dst} is in use by another job: pid {child.pid}" in capsys.readouterr().err
    assert not dst.exists()


def test_export_into_a_non_empty_dst_needs_overwrite_and_then_replaces_it(hf_dir, converted, tmp_path, capsys):
    from safetensors.torch import load_file

    src, _ = hf_dir
    dst = tmp_path / "hf"
    dst.mkdir()
    stale = ["model-00002-of-00003.safetensors", "notes.txt"]  # an earlier, bigger export; a user's file
    for name in stale:
        (dst / name).write_text("old")
    args = ("mcore-to-hf", "--model", "llava-ov", "--src", str(converted), "--dst", str(dst))
    assert convert_cli(*args) == 2
    assert f"--dst {dst} is not empty (2 entries" in capsys.readouterr().err
    assert sorted(p.name for p in dst.iterdir()) == stale  # nothing written next to them
    assert convert_cli(*args, "--overwrite") == 0
    names = {p.name for p in dst.iterdir()}
    assert not names & set(stale) and {"config.json", "model.safetensors"} <= names
    a, b = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert set(a) == set(b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or old folder, no lock file


def test_import_into_a_non_empty_dst_needs_overwrite(hf_dir, converted, tmp_path, capsys):
    from mmtrain.runtime.checkpoint.layout import find_latest_iteration

    src, _ = hf_dir
    dst = tmp_path / "ckpt"
    (dst / "iter_0000005").mkdir(parents=True)  # a stale iteration a loader would pick over ours
    args = ("hf-to-mcore", "--model", "llava-ov", "--src", str(src), "--dst", str(dst))
    assert convert_cli(*args) == 2
    assert f"--dst {dst} is not empty" in capsys.readouterr().err
    assert convert_cli(*args, "--overwrite") == 0
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in converted.iterdir())
    assert find_latest_iteration(dst) == 0
    # a source inside the folder --overwrite would replace is refused
    assert (
        convert_cli("mcore-to-hf", "--model", "llava-ov", "--src", str(dst), "--dst", str(tmp_path), "--overwrite") == 2
    )
    assert f"--dst {tmp_path} holds the source {dst}" in capsys.readouterr().err
