"""A rerun of a finished training says so and builds nothing; a save leaves no empty staging
folder; Ctrl-C says which step the last checkpoint holds and that the same command resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from tests.fixtures_training import REPO, copy_run, train, train_args, train_env


def test_a_finished_run_reruns_as_nothing_to_do_and_leaves_no_staging(base_run, tmp_path, shards_dir, tokenizer_dir):
    assert not (base_run / "checkpoints" / ".staging").exists()  # each save cleaned up after itself
    run = copy_run(base_run, tmp_path)
    before = (run / "metrics.jsonl").read_text()
    proc = train(run, shards_dir, tokenizer_dir, "train.iters=2", "checkpoint.interval=1")
    assert "already at train.iters=2 (checkpoint iter_0000002); nothing to do" in proc.stderr, proc.stderr[-3000:]
    assert "distributed: rank" not in proc.stderr  # nothing was initialised or built
    assert (run / "metrics.jsonl").read_text() == before


def test_ctrl_c_names_the_last_checkpoint_and_how_to_resume(tmp_path, shards_dir, tokenizer_dir):
    run = tmp_path / "run"
    args = train_args(run, shards_dir, tokenizer_dir, "train.iters=200", "checkpoint.interval=1")
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=train_env(),
        cwd=REPO,
        start_new_session=True,
    )
    latest = run / "checkpoints" / "latest"
    while not latest.exists():  # a first checkpoint, however loaded the machine is
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends: the whole foreground group
    _, err = proc.communicate()
    assert proc.returncode == 130, err[-4000:]
    saved = int((run / "checkpoints" / "latest").read_text())
    state = json.loads((run / "checkpoints" / f"iter_{saved:07d}" / "trainer_state.json").read_text())
    assert state["step"] == saved
    # (with a save every step the interrupt lands in a step or in a save: both name the last checkpoint)
    line = next((x for x in err.splitlines() if "interrupted in step" in x or "interrupted while saving" in x), None)
    assert line is not None, err[-4000:]
    assert (
        f"the last checkpoint holds step {saved} (" in line
        and f"iter_{saved:07d})" in line
        and "run the same command again to resume" in line
    )
