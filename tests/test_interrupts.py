"""Ctrl-C of a training says where to resume wherever it lands (issue 45: one during a checkpoint
save said nothing useful and left `checkpoints/.staging/iter_N`), and the next start removes
what an interrupted save left, with one line."""

from __future__ import annotations

import logging

import pytest

from mmtrain.runtime.checkpoint.manager import CheckpointManager
from mmtrain.runtime.interrupts import resume_hint, saying_where_to_resume
from tests.fixtures_training import REPO, dp_context, train_args, train_env


@pytest.mark.unit
def test_a_start_removes_an_interrupted_saves_staging_with_one_line(tmp_path, caplog):
    staged = tmp_path / "checkpoints" / ".staging" / "iter_0000004"
    (staged / "model").mkdir(parents=True)
    (staged / "model" / "shard.distcp").write_bytes(b"half")
    CheckpointManager(tmp_path, dp_context(1, dp=2), keep_last=0, resolved_yaml="")
    assert staged.exists()  # rank 0's job alone
    with caplog.at_level(logging.INFO, logger="mmtrain.runtime.checkpoint.manager"):
        CheckpointManager(tmp_path, dp_context(0, dp=2), keep_last=0, resolved_yaml="")
    assert not (tmp_path / "checkpoints" / ".staging").exists()
    lines = [r.getMessage() for r in caplog.records if "staging" in r.getMessage()]
    assert lines == [
        f"removed {tmp_path / 'checkpoints' / '.staging'}: an interrupted checkpoint save's unfinished iter_0000004"
    ], lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mmtrain.runtime.checkpoint.manager"):
        CheckpointManager(tmp_path, dp_context(0, dp=2), keep_last=0, resolved_yaml="")  # nothing left: nothing said
    assert not caplog.records


@pytest.mark.unit
def test_every_interrupt_says_where_the_run_resumes(tmp_path, caplog):
    where = "while saving the checkpoint of step 4/6"
    assert resume_hint(tmp_path, where) == (
        f"interrupted {where} before any checkpoint of this run was saved; the "
        "same command starts again from its starting point"
    )
    saved = tmp_path / "checkpoints" / "iter_0000002"
    saved.mkdir(parents=True)
    (saved / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text("2\n")
    expected = (
        f"interrupted {where}: the last checkpoint holds step 2 ({saved}); run the same command again to resume from it"
    )
    assert resume_hint(tmp_path, where) == expected
    with caplog.at_level(logging.WARNING, logger="mmtrain.runtime.interrupts"), pytest.raises(KeyboardInterrupt):
        with saying_where_to_resume(tmp_path, lambda: where, say=True):
            raise KeyboardInterrupt
    assert [r.getMessage() for r in caplog.records] == [expected]
    caplog.clear()
    with pytest.raises(KeyboardInterrupt), saying_where_to_resume(tmp_path, lambda: where, say=False):  # rank > 0
        raise KeyboardInterrupt
    assert not caplog.records


@pytest.fixture(scope="module")
def qwen2_tok(tmp_path_factory):
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok") / "qwen2")


@pytest.mark.slow  # two training processes (~35 s on a busy 2-core machine); the unit tests above cover the parts
def test_ctrl_c_during_a_save_says_where_to_resume_and_the_rerun_clears_staging(tmp_path, shards_dir, qwen2_tok):
    """A one-process run gets Ctrl-C (SIGINT to its group) while checkpoint 2 is staged: exit 130
    with the resume line naming checkpoint 1; the rerun removes the staging, resumes and finishes."""
    import subprocess

    from tests.workers import kill_in_save

    run = tmp_path / "run"

    def args() -> list[str]:
        return train_args(run, shards_dir, qwen2_tok, "train.iters=3", "checkpoint.interval=1")

    env = train_env()
    proc = subprocess.run(
        kill_in_save.command("2:model:int", args()),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    line = next((x for x in proc.stderr.splitlines() if "interrupted while saving" in x), None)
    assert line is not None, proc.stderr[-3000:]
    assert (
        "interrupted while saving the checkpoint of step 2/3 (its unfinished copy in checkpoints/.staging is "
        "removed at the next start): the last checkpoint holds step 1 ("
    ) in line, line
    assert "run the same command again to resume from it" in line, line
    staging = run / "checkpoints" / ".staging"
    assert (staging / "iter_0000002").is_dir()
    proc = subprocess.run(args(), capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"removed {staging}: an interrupted checkpoint save's unfinished iter_0000002" in proc.stderr
    assert "resumed from" in proc.stderr and not staging.exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "3"
