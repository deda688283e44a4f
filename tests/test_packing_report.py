"""The packing report (mmdata/packing/report.py): bin fill and executed-token
efficiency on hand-computed rows, and tokens computed counted exactly as the runtime's CP layout
pads a packed micro-batch (mmtrain/models/context_parallel.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmdata.energon_loaders.packing import pack_rows
from mmdata.packing.report import (
    PackingReport,
    padding_multiple,
    report_from_bins,
    report_from_cu_seqlens,
    report_from_rows,
)
from mmtrain.models import context_parallel as runtime_cp
from mmtrain.models.flops import executed_lengths


def _batch(rows: list[list[int]], seq_length: int):
    """A packed micro-batch of text-only samples of these lengths, as the loader packs it."""
    return pack_rows([[(np.arange(n) + 5, np.full(n, 7)) for n in row] for row in rows], seq_length, pad_token_id=0)


def _runtime_computed(cu: torch.Tensor, cp: int, tp: int) -> int:
    """Positions the runtime runs for this stream: the CP layout's padded stream (every rank
    holds 2 of its 2*cp chunks), and the MFU's executed lengths, which must agree."""
    m = runtime_cp.padding_multiple(cp, tp)
    layouts = [runtime_cp.cp_layout(cu, cp, r, m) for r in range(cp)]
    held = sum(layout.local_tokens for layout in layouts)
    assert held == int(layouts[0].cu_seqlens[-1]) == sum(executed_lengths(cu, m))
    return held


def test_padding_multiple_is_the_runtimes():
    for cp in (1, 2, 4, 8):
        for tp in (1, 2, 4):
            assert padding_multiple(cp, tp) == runtime_cp.padding_multiple(cp, tp), (cp, tp)
    with pytest.raises(ValueError):
        padding_multiple(0, 1)


@pytest.mark.parametrize(
    "rows, seq, cp, tp, real, computed",
    [
        # CP2 (multiple 4): row 0 = 5 -> 8, 6 -> 8, padding run 5 -> 8; row 1 is full (16)
        ([[5, 6], [16]], 16, 2, 1, 27, 40),
        # CP4 + TP2 (multiple 16): row 0 = 10 -> 16, 30 -> 32, padding run 24 -> 32; row 1 full (64)
        ([[10, 30], [64]], 64, 4, 2, 104, 144),
        # a full row of two text-only samples: 33 -> 48, 31 -> 32, no padding run
        ([[33, 31]], 64, 4, 2, 64, 80),
        # a last partial row (20 -> 32, padding run 44 -> 48) and an empty row (one 64-token padding run)
        ([[64], [20], []], 64, 4, 2, 84, 64 + 80 + 64),
        # no CP: nothing is padded beyond the rows, whatever TP is
        ([[5, 6], [16]], 16, 1, 2, 27, 32),
    ],
)
def test_hand_computed_rows_match_the_runtime_layout(rows, seq, cp, tp, real, computed):
    report = report_from_rows(rows, seq, cp=cp, tp=tp)
    assert (report.rows, report.capacity, report.real_tokens, report.computed_tokens) == (
        len(rows),
        len(rows) * seq,
        real,
        computed,
    )
    assert report.bin_fill == pytest.approx(real / (len(rows) * seq))
    assert report.executed_token_efficiency == pytest.approx(real / computed)
    batch = _batch(rows, seq)
    assert _runtime_computed(batch.cu_seqlens, cp, tp) == computed
    assert report_from_cu_seqlens(batch.cu_seqlens, batch.num_real_tokens, len(rows), seq, cp, tp) == report


def test_hand_computed_ratios_and_dict():
    r = report_from_rows([[10, 30], [64]], 64, cp=4, tp=2)
    assert r.bin_fill == 0.8125 and r.executed_token_efficiency == pytest.approx(104 / 144)
    d = r.as_dict()
    assert d["bin_fill"] == 0.8125 and d["executed_token_efficiency"] == round(104 / 144, 6)
    assert (d["cp"], d["tp"], d["computed_tokens"]) == (4, 2, 144)
    assert "bin fill 81.25%" in r.line() and "executed-token efficiency 72.22%" in r.line() and "CP4 TP2" in r.line()
    both = r + report_from_rows([[64]], 64, cp=4, tp=2)
    assert (both.rows, both.real_tokens, both.computed_tokens) == (3, 168, 208)
    with pytest.raises(ValueError):
        r + report_from_rows([[64]], 64, cp=2, tp=1)


def test_bins_form_clips_over_length_and_counts_empty_rows():
    # sample 2 (100 tokens) is over length: the loader truncates it to 64, alone in its row
    r = report_from_bins(np.array([0, 0, 1]), np.array([10, 30, 100]), 64, num_rows=3, cp=4, tp=2)
    assert (r.rows, r.real_tokens, r.computed_tokens) == (3, 104, 80 + 64 + 64)
    assert report_from_rows([], 64).bin_fill == 0.0 and report_from_rows([], 64).executed_token_efficiency == 0.0
    with pytest.raises(ValueError, match="more than seq_length"):
        report_from_bins(np.array([0, 0]), np.array([40, 40]), 64)


def test_random_rows_agree_with_the_runtime(seed: int = 3):
    rng = np.random.default_rng(seed)
    seq = 256
    rows = []
    for _ in range(6):
        row, room = [], seq
        while room > 0 and rng.random() < 0.8:
            n = int(rng.integers(1, room + 1))
            row.append(n)
            room -= n
        rows.append(row)
    batch = _batch(rows, seq)
    for cp, tp in ((1, 1), (2, 1), (2, 2), (4, 2), (8, 1)):
        report = report_from_rows(rows, seq, cp=cp, tp=tp)
        assert report.computed_tokens == _runtime_computed(batch.cu_seqlens, cp, tp), (cp, tp)
        assert isinstance(report, PackingReport) and report.real_tokens == batch.num_real_tokens


def test_train_step_report_and_step_line(caplog):
    """The train loop's per-step report (`throughput.batch_packing` over this rank's micro-batches)
    and what `_log` writes: `bin_fill` / `executed_token_efficiency` in the metrics record and
    `| fill X% | exec Y% |` in the step line."""
    import logging

    from mmdata.energon_loaders.batch import PackedBatch
    from mmtrain.runtime.throughput import batch_packing
    from tests.fixtures_training import logging_trainer, step_result

    micro = [[[10, 30], [64]], [[20], []]]  # two micro-batches of 2 rows of 64
    batches = []
    for rows in micro:
        p = _batch(rows, 64)
        batches.append(
            PackedBatch(
                input_ids=p.input_ids,
                labels=p.labels,
                position_ids=p.position_ids,
                cu_seqlens=p.cu_seqlens,
                max_seqlen=p.max_seqlen,
                num_real_tokens=p.num_real_tokens,
            )
        )
    report = batch_packing(batches, cp=4, tp=2)
    assert report == report_from_rows([r for rows in micro for r in rows], 64, cp=4, tp=2)
    assert (report.rows, report.real_tokens, report.computed_tokens) == (4, 124, 144 + 80 + 64)

    t, records = logging_trainer(world_size=1, interval=1, peak_flops=None)
    r = step_result(
        tokens=report.real_tokens,
        samples=4,
        bin_fill=report.bin_fill,
        executed_token_efficiency=report.executed_token_efficiency,
    )
    with caplog.at_level(logging.INFO, logger="mmtrain.runtime.trainer"):
        t._log(r)
    assert records[0]["bin_fill"] == pytest.approx(124 / 256)
    assert records[0]["executed_token_efficiency"] == pytest.approx(124 / 288)
    assert "| fill 48.4% | exec 43.1% |" in caplog.text
