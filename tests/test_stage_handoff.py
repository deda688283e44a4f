"""LLaVA-OV training stages: a later stage (`checkpoint.weights_only: true`) starts from the
previous stage's weights with a fresh step counter, optimizer, LR schedule and data position,
instead of resuming the previous run (which would restore its step and train nothing)."""

from __future__ import annotations

from pathlib import Path

from tests.test_train_runtime import metrics, tokenizer_dir, train  # noqa: F401 (fixture)


def test_next_stage_takes_weights_only(tmp_path: Path, shards_dir, tokenizer_dir):
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    train(stage1, shards_dir, tokenizer_dir, "train.iters=2", "checkpoint.interval=2")
    train(
        stage2, shards_dir, tokenizer_dir, "train.iters=2",
        f"checkpoint.load={stage1 / 'checkpoints'}", "checkpoint.weights_only=true",
    )  # fmt: skip
    first, second = metrics(stage1), metrics(stage2)
    assert sorted(second) == [1, 2]  # a fresh step counter: the stage really trains
    assert second[1]["lr"] == first[1]["lr"]  # a fresh LR schedule (warmup restarts)
    # same seed -> the same first batch; the trained weights fit it better than the random init
    assert second[1]["sample_ids"] == first[1]["sample_ids"]
    assert second[1]["loss"] < first[1]["loss"] - 1e-3
