"""Resuming a run whose recipe changed (issue 30): other data is refused before the old loader
state is fed into it, `checkpoint.reset_data` allows it with the data started fresh, other
changes are announced, and a loader worker that raises fails the job.

Every run is the real `mmtrain llava-ov recipes/llava-ov-tiny.yaml ...` in a subprocess
(tests/fixtures_training.py's `train`), two steps with a checkpoint each, on CPU.
"""

from __future__ import annotations

import json
import re
import shutil

import yaml

from tests.fixtures_training import BASE_RUN as TINY
from tests.fixtures_training import REPO, copy_run, metrics, train


def refusal_line(stderr: str) -> str:
    """The one stderr line that names the reset switch."""
    lines = [line for line in stderr.splitlines() if "checkpoint.reset_data=true" in line]
    assert len(lines) == 1, stderr[-6000:]
    return lines[0]


def test_a_resume_with_other_data_is_refused_naming_each_key(base_run, tmp_path, shards_dir, tokenizer_dir):
    run = copy_run(base_run, tmp_path)
    other = tmp_path / "other_shards"
    shutil.copytree(shards_dir, other)
    proc = train(
        run,
        other,
        tokenizer_dir,
        "train.iters=3",
        "checkpoint.interval=1",
        "train.seq_length=512",
        "data.packing_buffer_size=32",
        expect_rc=2,
    )
    line = refusal_line(proc.stderr)
    assert "train.seq_length 1024 -> 512" in line
    assert "data.packing_buffer_size 64 -> 32" in line
    assert re.search(r"data\.paths \[\S*shards\S*\] -> \[\S*other_shards\S*\]", line), line
    assert "packed samples exceed" not in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "2"
    assert sorted(d.name for d in ckpts.glob("iter_*")) == ["iter_0000001", "iter_0000002"]
    assert max(metrics(run)) == 2


def test_a_refused_resume_leaves_config_yaml_describing_the_checkpoints(base_run, tmp_path, shards_dir, tokenizer_dir):
    """Needs the check in the launcher's preflight (data_identity.resume_data_problems), which runs
    before `config.yaml` is rewritten."""
    run = copy_run(base_run, tmp_path)
    train(run, shards_dir, tokenizer_dir, *TINY, "train.seq_length=512", expect_rc=2)
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["seq_length"] == 1024


def test_reset_data_keeps_the_step_and_starts_the_data_fresh(base_run, tmp_path, shards_dir, tokenizer_dir):
    run = copy_run(base_run, tmp_path)
    proc = train(
        run,
        shards_dir,
        tokenizer_dir,
        "train.iters=3",
        "checkpoint.interval=1",
        "train.seq_length=512",
        "checkpoint.reset_data=true",
    )
    err = proc.stderr
    assert "checkpoint.reset_data: the loader starts fresh" in err
    assert re.search(r"resumed from \S+iter_0000002 at step 2 .*loader restored: False", err), err[-4000:]
    assert "resume: train.iters 2 -> 3: the LR schedule is recomputed" in err
    assert "packed samples exceed" not in err + proc.stdout
    assert sorted(metrics(run)) == [1, 2, 3]
    state = json.loads((run / "checkpoints" / "iter_0000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data"]["train.seq_length"] == 512 and state["data_reset"] is True

    # a rerun with the switch still on (a crash, a time limit) continues the new data position
    proc = train(
        run,
        shards_dir,
        tokenizer_dir,
        "train.iters=4",
        "checkpoint.interval=1",
        "train.seq_length=512",
        "checkpoint.reset_data=true",
    )
    assert "the data is unchanged since this run's reset, so its data position resumes" in proc.stderr
    assert re.search(r"at step 3 .*loader restored: True", proc.stderr), proc.stderr[-4000:]


def test_a_checkpoint_of_another_format_is_refused(base_run, tmp_path, shards_dir, tokenizer_dir):  # noqa: F811
    """No reader for pre-release checkpoints: one written before the format field (and the data
    identity) existed is refused up front, naming its format, instead of resuming unchecked."""
    from mmtrain.runtime.checkpoint.integrity import write_file_list

    run = copy_run(base_run, tmp_path)
    ckpt = run / "checkpoints" / "iter_0000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    for key in ("format", "data", "data_reset"):  # as written before the record existed
        del state[key]
    (ckpt / "trainer_state.json").write_text(json.dumps(state, indent=2))
    write_file_list(ckpt)
    proc = train(run, shards_dir, tokenizer_dir, "train.iters=3", "checkpoint.interval=1", expect_rc=2)
    assert "checkpoint format 1, this mmtrain reads format 2" in proc.stderr
    assert sorted(metrics(run)) == [1, 2]


def test_a_loader_worker_that_raises_fails_the_job(tmp_path, shards_dir, tokenizer_dir):
    """Every shard unreadable: the loader worker's exception reaches the trainer, and the job ends
    with exit status 1 naming it (not at exit 0 with a log full of skipped samples)."""
    broken = tmp_path / "broken_shards"
    shutil.copytree(shards_dir, broken)
    for tar in broken.rglob("*.tar"):  # same sizes (the index still matches), unreadable contents
        tar.write_bytes(b"\xff" * tar.stat().st_size)
    proc = train(tmp_path / "run", broken, tokenizer_dir, *TINY, "checkpoint.save=false", expect_rc=1)
    assert re.search(r"internal error: \w+: Caught \w+ in DataLoader worker process 0", proc.stderr), proc.stderr[
        -4000:
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").is_file() or not metrics(tmp_path / "run")


def test_rewritten_shards_at_the_same_path_are_a_change(tmp_path, shards_dir, tokenizer_dir):
    """The same data.paths, preprocessed again (energon's sample counts rewritten): named as a
    change of that path's contents; the resolved recipe keys are compared as the loader sees them."""
    from mmtrain.config import load_recipe
    from mmtrain.runtime.checkpoint.data_identity import data_identity, identity_changes

    shards = tmp_path / "shards"
    shutil.copytree(shards_dir, shards)
    recipe = load_recipe(
        REPO / "recipes" / "llava-ov-tiny.yaml",
        [f"run_dir={tmp_path / 'run'}", f"data.paths=[{shards}]", f"tokenizer.path={tokenizer_dir}"],
    )
    before = data_identity(recipe)
    assert identity_changes(before, data_identity(recipe)) == []
    info = shards / ".nv-meta" / ".info.json"
    info.write_text(json.dumps(json.loads(info.read_text()), indent=4) + "\n")
    assert identity_changes(before, data_identity(recipe)) == [f"data.paths[0] {shards.resolve()}: shards rewritten"]
    recipe.train.seq_length = 512
    assert "train.seq_length 2048 -> 512" in identity_changes(before, data_identity(recipe))
