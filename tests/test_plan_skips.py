"""A plan made from estimated text lengths (shards preprocessed without --tokenizer, issue 45):
pack-plan says so, training refuses it unless the recipe opts in, the loader carries a sample
that does not fit its row into a later row (resumably) instead of dropping it, and what is still
skipped is counted per step and summed at the end of the run."""

from __future__ import annotations

import contextlib
import json
import io
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from megatron.energon import TaskEncoder, WorkerConfig

from mmdata.energon_loaders import plan_packing as pp
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
from mmdata.errors import UserError
from mmdata.global_order.sources import estimated_lengths_problem as order_lengths_problem
from mmdata.shard_job.lengths import LENGTHS_NAME
from mmdata.packing.plan_file import plan_path, read_plan_info
from mmtrain import registry
from mmtrain.cli import main as mmtrain_main
from mmtrain.config import load_recipe
from mmtrain.runtime.preflight import _check_data
from mmtrain.runtime.step_metrics import StepResult, skip_summary, step_line, step_record
from mmtrain.runtime.train_data import batch_skips
from tests.fixtures_training import step_result

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "llava-ov-tiny.yaml"
SEQ = 2048


@pytest.fixture(scope="module")
def estimated(shards_dir, tmp_path_factory) -> tuple[Path, Path, str]:
    """A copy of the session shards (preprocessed without --tokenizer), planned at SEQ with the
    tiny recipe's geometry by `mmtrain pack-plan`, its output line, and the tiny tokenizer."""
    root = tmp_path_factory.mktemp("estimated")
    out = root / "shards"
    shutil.copytree(shards_dir, out)
    tok = build_tiny_qwen2_tokenizer(root / "tok")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert (
            mmtrain_main(
                [
                    "pack-plan",
                    str(RECIPE),
                    str(out),
                    "--set",
                    f"train.seq_length={SEQ}",
                    "--set",
                    f"tokenizer.path={tok}",
                    "--jobs",
                    "1",
                    "--no-progress",
                ]
            )
            == 0
        )
    return out, tok, printed.getvalue().splitlines()[0]


def _recipe(out: Path, tok: Path, *extra: str):
    return load_recipe(
        RECIPE, [f"data.paths=[{out}]", f"tokenizer.path={tok}", "data.packing=plan", f"train.seq_length={SEQ}", *extra]
    )


def test_pack_plan_says_its_lengths_are_estimates(estimated):
    out, tok, line = estimated
    assert "text lengths are ESTIMATES (shards preprocessed without --tokenizer)" in line
    assert "data.plan_allow_estimated_lengths: true" in line
    info = read_plan_info(plan_path(out, SEQ))
    assert info["lengths_estimated"] is True and info["text_tokens"] == "estimate"
    assert pp.lengths_estimated(info)
    assert not pp.lengths_estimated({"text_tokens": "tokenizer", "lengths_estimated": False})


def test_training_refuses_an_estimated_plan_unless_opted_in(estimated, tmp_path, capsys):
    out, tok, _ = estimated
    problems: list[str] = []
    _check_data(_recipe(out, tok), registry.get_family("llava-ov"), problems)
    assert len(problems) == 1 and "estimated text lengths" in problems[0]
    assert "--tokenizer" in problems[0] and "data.plan_allow_estimated_lengths: true" in problems[0]
    problems = []
    _check_data(_recipe(out, tok, "data.plan_allow_estimated_lengths=true"), registry.get_family("llava-ov"), problems)
    assert problems == []
    # the command: rc 2 before anything is written
    run_dir = tmp_path / "run"
    capsys.readouterr()
    rc = mmtrain_main(
        [
            "llava-ov",
            str(RECIPE),
            f"data.paths=[{out}]",
            f"tokenizer.path={tok}",
            "data.packing=plan",
            f"train.seq_length={SEQ}",
            f"run_dir={run_dir}",
            "train.iters=1",
        ]
    )
    assert rc == 2 and not run_dir.exists()
    assert "plan_allow_estimated_lengths" in capsys.readouterr().err
    # the key is validated: only read with packing: plan
    with pytest.raises(UserError, match="plan_allow_estimated_lengths"):
        load_recipe(RECIPE, ["data.plan_allow_estimated_lengths=true"])


def test_the_global_order_refuses_estimated_lengths_unless_opted_in(estimated, tmp_path):
    """`data.sharding: global` over shards preprocessed without --tokenizer: one line naming the
    folder and the fix; `data.plan_allow_estimated_lengths: true` accepts it (the key is read in
    this mode too), and so does `data.packing: false` (no row to overflow). A length index
    counted with the tokenizer is not refused."""
    out, tok, _ = estimated
    family = registry.get_family("llava-ov")

    def problems_of(*extra: str) -> list[str]:
        base = [f"data.paths=[{out}]", f"tokenizer.path={tok}", "data.sharding=global", "train.global_batch_size=4"]
        recipe = load_recipe(RECIPE, [*base, *extra])
        found: list[str] = []
        _check_data(recipe, family, found)
        return found

    (line,) = problems_of()
    assert line.startswith(f"data.paths[0]: {out} has estimated text lengths") and "\n" not in line
    assert "`mmdata preprocess --tokenizer DIR`" in line and "data.plan_allow_estimated_lengths: true" in line
    assert problems_of("data.plan_allow_estimated_lengths=true") == []
    assert problems_of("data.packing=false") == []  # one sample a row: nothing to overflow
    exact = tmp_path / "exact"
    exact.mkdir()
    table = pa.table({"index": [0]}).replace_schema_metadata({"mmdata.text_tokens": "tokenizer"})
    pq.write_table(table, exact / LENGTHS_NAME)
    assert order_lengths_problem(exact) is None and order_lengths_problem(out) == line.split(": ", 1)[1]


def test_loader_carries_overflowing_samples_and_resumes_exactly(estimated):
    """The estimated plan's rows overflow when encoded: nothing is skipped, the overflowing
    samples train in later rows, and a restored loader (carried samples in its state) continues
    exactly."""
    from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader

    out, tok, _ = estimated

    def build():
        return build_llava_ov_loader(
            out,
            tok,
            seq_length=SEQ,
            micro_batch_size=1,
            num_workers=1,
            packing="plan",
            image_size=30,
            patch_size=14,
            checkpoint_every_min_n_samples=1,
            checkpoint_every_sec=0,
        )

    loader = build()
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    state = loader.save_state_json()
    rest = [next(it) for _ in range(2)]
    del it
    assert loader.stats.skipped == {}
    assert loader.stats.counters[pp.PLAN_CARRIED] > 0  # main dropped these as plan_overflow
    assert all(b.num_real_tokens <= SEQ for b in first + rest)
    resumed = build()
    resumed.restore_state_json(state)
    again = iter(resumed)
    assert [next(again).sample_keys for _ in range(2)] == [b.sample_keys for b in rest]


class _LengthEncoder(TaskEncoder):
    """Encodes sample `i` as `lengths[i]` tokens; records skips and counters like the family encoders."""

    def __init__(self, lengths: dict[int, int], seq_length: int) -> None:
        self.lengths, self.seq_length = lengths, seq_length
        self.skips: list[tuple[str, str]] = []
        self.counts: Counter = Counter()

    def encode_sample(self, sample):
        return SimpleNamespace(input_ids=[0] * self.lengths[sample.index], id=sample.index)

    def _skip(self, reason: str, sample_id: str, detail: str = "") -> None:
        self.skips.append((reason, sample_id))

    def _count(self, key: str, n: int = 1) -> None:
        self.counts[key] += n


class _InMemoryPlan(pp.PlanPackedDataset):
    def _read(self, index: int, key: str):
        return SimpleNamespace(index=index, __subflavors__=None)


def _dataset(te: _LengthEncoder, sequences: list[list[int]]) -> _InMemoryPlan:
    indices = np.array([i for s in sequences for i in s], dtype=np.int32)
    starts = np.cumsum([0] + [len(s) for s in sequences]).astype(np.int64)
    plan = pp.PlanSequences(indices, starts, {"bins": len(sequences), "seq_length": te.seq_length})
    return _InMemoryPlan(
        Path("unused"),
        plan,
        te,
        micro_batch_size=1,
        seed=0,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
    )


def test_plan_rows_carry_in_order_and_count_what_cannot_fit(monkeypatch):
    """Row 0 planned [0, 1] at 5 + 5 tokens encodes 6 + 6: sample 1 is carried into row 1 and
    goes first there; a sample longer than the sequence is skipped as plan_too_long; with the
    carry full, plan_overflow; the carry is part of the savable state."""
    lengths = {0: 6, 1: 6, 2: 3, 3: 3, 4: 12}
    te = _LengthEncoder(lengths, 10)
    ds = _dataset(te, [[0, 1], [2, 3], [4]])
    ids = lambda row: [s.id for s in row]  # noqa: E731
    assert ids(ds._row(0)) == [0] and ds._carry == [[1, "0000000001", None]]
    saved = ds._carry.copy()
    assert ids(ds._row(1)) == [1, 2] and ds._carry == [[3, "0000000003", None]]
    assert ids(ds._row(2)) == [3]
    assert te.skips == [(pp.PLAN_TOO_LONG, "4")] and te.counts[pp.PLAN_CARRIED] == 2
    # restored with the carry it had after row 0, row 1 is made again the same
    again = _dataset(te, [[0, 1], [2, 3], [4]])
    again.restore_state({"__class__": "_InMemoryPlan", "_batches": 1, "_carry": saved})
    assert ids(again._row(1)) == [1, 2]
    # a loader state saved before carrying restores with an empty carry
    old = _dataset(te, [[0, 1], [2, 3], [4]])
    old.restore_state({"__class__": "_InMemoryPlan", "_batches": 1})
    assert old._carry == []
    # the carry full: the sample that does not fit is skipped, counted
    monkeypatch.setattr(pp, "PLAN_CARRY_LIMIT", 0)
    te = _LengthEncoder(lengths, 10)
    assert ids(_dataset(te, [[0, 1]])._row(0)) == [0]
    assert te.skips == [(pp.PLAN_OVERFLOW, "1")]


@pytest.mark.unit
def test_a_row_skip_names_the_sample_by_its_key_when_it_has_no_record_id():
    """In the global order a member is (source number, stream position): a sample without a
    record id that is too long, or finds the carry full, is named `DATASET#KEY`, not by its
    source number."""
    te = _LengthEncoder({}, 10)
    read = {  # member -> the raw sample the reader gives (one source per folder)
        (1, 7): ("/d/other", "0000000042", 12),
        (0, 3): ("/d/shards", "0000000005", 6),
        (1, 8): ("/d/other", "0000000009", 6),
    }
    te.encode_sample = lambda raw: SimpleNamespace(  # no `id`, as a family sample without one
        input_ids=[0] * raw[2], __key__=raw[1], __sources__=[SimpleNamespace(dataset_path=raw[0])]
    )
    row, carry = pp.fill_row(te, [[1, 7], [0, 3], [1, 8]], lambda m: read[tuple(m)], where="row 0", carry_limit=0)
    assert [s.__key__ for s in row] == ["0000000005"] and carry == []
    assert te.skips == [(pp.PLAN_TOO_LONG, "/d/other#0000000042"), (pp.PLAN_OVERFLOW, "/d/other#0000000009")]


def _result(**kw) -> StepResult:
    base = dict(step=2, lr=1e-3, step_time_s=1.0, tokens=100, samples=10, loss_tokens=50, bin_fill=0.9)
    return step_result(**{**base, **kw})


def test_skips_are_counted_per_step_and_summed_at_the_end():
    batch = SimpleNamespace(
        stats={"skipped/plan_overflow": 3, "skipped/decode_error": 1, "truncated": 2, pp.PLAN_CARRIED: 4}
    )
    assert batch_skips(batch) == {"plan_overflow": 3, "decode_error": 1}
    r = _result(skipped={"plan_overflow": 3})
    record = step_record(r, 1, None, {})
    assert record["skipped"] == {"plan_overflow": 3} and record["num_skipped"] == 3
    assert "| skipped 3 (plan_overflow 3) |" in step_line(r, record, 4, "0s")
    clean = _result()
    assert step_record(clean, 1, None, {})["num_skipped"] == 0
    assert "skipped" not in step_line(clean, step_record(clean, 1, None, {}), 4, "0s")
    assert skip_summary({"plan_overflow": 344}, 513, pp.PLAN_SKIP_HINTS) == (
        "344 of 857 samples skipped: plan_overflow 344; preprocess with --tokenizer (exact lengths) and rerun pack-plan"
    )
    assert skip_summary({}, 513, pp.PLAN_SKIP_HINTS) is None


def test_a_run_that_skipped_samples_ends_with_one_line(caplog):
    """The trainer's closing line sums its steps' skips (of the samples drawn: trained + skipped)."""
    from mmtrain.runtime.trainer import Trainer

    results = [
        _result(step=1, samples=200, skipped={"plan_overflow": 100}),
        _result(step=2, samples=313, skipped={"plan_overflow": 244}),
        _result(step=3, samples=0),
    ]
    logging_rank = SimpleNamespace(ctx=SimpleNamespace(is_logging_rank=True))
    with caplog.at_level("WARNING", logger="mmtrain.runtime.trainer"):
        Trainer._say_skips(logging_rank, results)
        Trainer._say_skips(logging_rank, [_result()])
    assert [r.getMessage() for r in caplog.records] == [
        "344 of 857 samples skipped: plan_overflow 344; preprocess with --tokenizer (exact lengths) and rerun pack-plan"
    ]


def test_training_counts_skips_in_its_step_lines_and_metrics(estimated, tmp_path, monkeypatch, caplog):
    """A short opted-in run on the estimated plan with no room to carry (as main behaved): every
    skip is in the step line and in metrics.jsonl, and the run ends with the summary line."""
    out, tok, _ = estimated
    monkeypatch.setattr(pp, "PLAN_CARRY_LIMIT", 0)  # the loader workers fork from here: they see it too
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="mmtrain.runtime.trainer"):
        assert (
            mmtrain_main(
                [
                    "llava-ov",
                    str(RECIPE),
                    f"data.paths=[{out}]",
                    f"tokenizer.path={tok}",
                    "data.packing=plan",
                    "data.plan_allow_estimated_lengths=true",
                    f"train.seq_length={SEQ}",
                    f"run_dir={run_dir}",
                    "train.iters=2",
                    "checkpoint.save=false",
                    "logging.tensorboard=false",
                ]
            )
            == 0
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = sum(r["num_skipped"] for r in records)
    assert skipped > 0 and all(sum(r["skipped"].values()) == r["num_skipped"] for r in records)
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        f"| skipped {r['num_skipped']} (plan_overflow {r['num_skipped']})" in line
        for r in records
        if r["num_skipped"]
        for line in lines
    )
    trained = sum(r["num_samples"] for r in records)
    assert (
        f"{skipped} of {trained + skipped} samples skipped: plan_overflow {skipped}; preprocess with --tokenizer"
        in lines[-1]
    )
