"""metrics.jsonl writer (append, crash/resume truncation) and `mmtrain worst-samples`."""

from __future__ import annotations

import json
import math

import pytest

from mmtrain.cli import main as mmtrain_main
from mmtrain.runtime.metrics import MetricsWriter, read_metrics, worst_samples

pytestmark = pytest.mark.unit


def _record(step: int, loss: float, losses: dict[str, float]) -> dict:
    return {
        "step": step,
        "loss": loss,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 100.0,
        "samples_per_s": 2.0,
        "sample_ids": list(losses),
        "sample_losses": losses,
    }


def test_writer_appends_one_json_line_per_step(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(_record(1, 2.0, {"a": 1.0}))
        # written through immediately, not buffered until close
        assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
        w.write(_record(2, float("nan"), {"b": float("inf")}))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads(lines[1])["loss"] == "nan"  # strict JSON
    with pytest.raises(ValueError, match="int 'step'"):
        MetricsWriter(tmp_path, tensorboard=False).write({"loss": 1.0})


def test_resume_truncates_later_steps_and_partial_line(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in range(1, 6):
            w.write(_record(step, float(step), {}))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as w:
        w.write(_record(4, 40.0, {}))
    recs = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 4


def test_plain_reopen_keeps_history(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(_record(1, 1.0, {}))
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(_record(2, 1.0, {}))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_worst_samples_ranking():
    recs = [
        _record(1, 1.0, {"a": 0.5, "b": 1.5}),
        _record(2, 3.0, {"x": 2.0, "y": 9.0, "z": float("nan"), "w": 0.1}),
        _record(3, 2.0, {"q": 1.0}),
    ]
    rec, ranked = worst_samples(recs)
    assert rec["step"] == 2
    assert [i for i, _ in ranked] == ["z", "y", "x", "w"]  # NaN first, then by loss
    rec, ranked = worst_samples(recs, step=1, top=1)
    assert ranked == [("b", 1.5)]
    with pytest.raises(LookupError, match="step 7 not in metrics"):
        worst_samples(recs, step=7)


def test_worst_samples_cli(tmp_path, capsys):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(_record(1, 1.0, {"s-1": 0.2, "s-2": 0.9}))
        w.write(_record(2, 5.0, {"s-3": 7.5, "s-4": 2.5, "s-5": 4.0}))
        w.write({"step": 3, "loss": 0.5, "sample_ids": ["s-6", "s-7"]})  # ids only
    assert mmtrain_main(["worst-samples", str(tmp_path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("step 2: loss 5.0000")  # rounded
    assert out.splitlines()[1].split() == [
        "rank",
        "sample_key",
        "loss",
    ]  # DATASET#SHARD_KEY, as mmdata inspect --key takes
    rows = [line.split() for line in out.splitlines()[2:]]
    assert rows == [["1", "s-3", "7.5000"], ["2", "s-5", "4.0000"]]
    assert mmtrain_main(["worst-samples", str(tmp_path / "metrics.jsonl"), "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "no per-sample losses" in out and "s-6" in out and "s-7" in out
    assert mmtrain_main(["worst-samples", str(tmp_path), "--step", "9"]) == 2  # a user error: one line
    err = capsys.readouterr().err
    assert "step 9 not in metrics" in err and len(err.strip().splitlines()) == 1
    assert mmtrain_main(["worst-samples", str(tmp_path / "nothing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_tensorboard_scalars(tmp_path):
    # tensorboard is a required dependency (the recipes log to it by default): no skip
    with MetricsWriter(tmp_path, tensorboard=True) as w:
        assert w.tensorboard_enabled
        w.write(_record(1, 1.0, {}))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0)]


def test_nan_loss_skipped_for_default_step():
    rec, _ = worst_samples([_record(1, float("nan"), {}), _record(2, 0.3, {})])
    assert rec["step"] == 2 and not math.isnan(rec["loss"])


def test_sample_losses_as_list_aligned_with_ids():
    rec = {"step": 1, "loss": 1.0, "sample_ids": ["a", "b", "c"], "sample_losses": [0.5, None, 2.0]}
    _, ranked = worst_samples([rec])
    assert ranked == [("c", 2.0), ("a", 0.5), ("b", None)]
    with pytest.raises(ValueError, match="2 sample_losses for 3 sample_ids"):
        worst_samples([dict(rec, sample_losses=[1.0, 2.0])])
