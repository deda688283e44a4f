"""The packing report: how full the packed rows are, and how much of what the device computes is
real work. Megatron-Bridge's two packing metrics, counted for our row layout:

- **bin fill** = real tokens / row capacity (rows x seq_length): what the packer achieved;
- **executed-token efficiency** = real tokens / tokens computed: the positions that reach the loss
  or attention over every position the decoder runs, i.e. row padding *and* context-parallel
  padding included.

Tokens computed are counted exactly as the training runtime lays a micro-batch out
(`packing.pack_rows`, `mmtrain.models.context_parallel`): a row is its samples back to back and
then one padding run; under CP (cp > 1) every non-empty segment, sample or padding run, is
padded at its end to a multiple of `2*cp*tp` (`padding_multiple`; the `tp` factor lets sequence
parallelism split each CP share). Without CP nothing is padded beyond the row, whatever TP is
(the row length is already a multiple of TP). Megatron-Bridge's packer packs *aligned* lengths,
so its bin fill counts the alignment; ours packs real lengths and the alignment lands in the
executed-token efficiency's denominator instead (a row can then compute more than seq_length
positions).

`mmdata inspect`, `mmdata pack-plan` (and the plan's metadata) and the train loop's
`metrics.jsonl` all report these two numbers (docs/loaders.md, "Packing report").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def padding_multiple(cp: int, tp: int) -> int:
    """What every segment is padded to under CP: `2*cp*tp` when cp > 1, else 1 (the runtime's
    `mmtrain.models.context_parallel.padding_multiple`, which tests/test_packing_report.py checks
    this against)."""
    if cp < 1 or tp < 1:
        raise ValueError(f"cp and tp must be >= 1, got cp={cp}, tp={tp}")
    return 2 * cp * tp if cp > 1 else 1


def _aligned(n: np.ndarray, multiple: int) -> np.ndarray:
    """Segment lengths `n` (>= 0) padded up to `multiple`; an empty segment stays empty."""
    return -(-n // multiple) * multiple if multiple > 1 else n


@dataclass(frozen=True)
class PackingReport:
    """Token counts of some packed rows, and the two ratios they give. Reports add up (`+`)."""

    rows: int
    capacity: int  # rows x seq_length
    real_tokens: int  # sample positions (what reaches the loss or attention)
    computed_tokens: int  # positions the decoder runs: rows plus CP padding of every segment
    cp: int = 1
    tp: int = 1

    @property
    def bin_fill(self) -> float:
        return self.real_tokens / self.capacity if self.capacity else 0.0

    @property
    def executed_token_efficiency(self) -> float:
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def __add__(self, other: PackingReport) -> PackingReport:
        if (self.cp, self.tp) != (other.cp, other.tp):
            raise ValueError(f"cannot add reports for CP{self.cp}/TP{self.tp} and CP{other.cp}/TP{other.tp}")
        return PackingReport(
            self.rows + other.rows,
            self.capacity + other.capacity,
            self.real_tokens + other.real_tokens,
            self.computed_tokens + other.computed_tokens,
            self.cp,
            self.tp,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "capacity": self.capacity,
            "real_tokens": self.real_tokens,
            "computed_tokens": self.computed_tokens,
            "cp": self.cp,
            "tp": self.tp,
            "bin_fill": round(self.bin_fill, 6),
            "executed_token_efficiency": round(self.executed_token_efficiency, 6),
        }

    def line(self) -> str:
        """One line for a terminal: `bin fill 99.61% | executed-token efficiency 99.20% (CP2 TP1)`."""
        return (
            f"bin fill {self.bin_fill:.2%} | executed-token efficiency {self.executed_token_efficiency:.2%} "
            f"(CP{self.cp} TP{self.tp})"
        )


def empty_report(cp: int = 1, tp: int = 1) -> PackingReport:
    padding_multiple(cp, tp)  # checks the sizes
    return PackingReport(0, 0, 0, 0, cp, tp)


def report_from_bins(
    bins: np.ndarray, lengths: np.ndarray, seq_length: int, *, num_rows: int | None = None, cp: int = 1, tp: int = 1
) -> PackingReport:
    """The report of rows given per sample: sample `i` (length `lengths[i]`, clipped to
    `seq_length` as the loader truncates it) sits in row `bins[i]`; `num_rows` (default
    max(bins) + 1) counts rows without samples too. Vectorised: a 45M-sample plan in seconds."""
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    m = padding_multiple(cp, tp)
    bins = np.asarray(bins, dtype=np.int64)
    n = np.minimum(np.asarray(lengths, dtype=np.int64), seq_length)
    if bins.shape != n.shape:
        raise ValueError(f"{len(bins)} bins for {len(n)} lengths")
    rows = int(bins.max()) + 1 if num_rows is None and len(bins) else int(num_rows or 0)
    fill = np.bincount(bins, weights=n, minlength=rows).astype(np.int64)
    if fill.max(initial=0) > seq_length:
        raise ValueError(f"a row holds {int(fill.max())} tokens, more than seq_length {seq_length}")
    pad = seq_length - fill  # each row's padding run (empty in a full row)
    computed = int(_aligned(n[n > 0], m).sum()) + int(_aligned(pad, m).sum())
    return PackingReport(rows, rows * seq_length, int(n.sum()), computed, cp, tp)


def report_from_rows(rows: Iterable[Sequence[int]], seq_length: int, cp: int = 1, tp: int = 1) -> PackingReport:
    """The report of rows given as lists of their samples' lengths (e.g. a packer's bins)."""
    lengths: list[int] = []
    bins: list[int] = []
    count = 0
    for r, row in enumerate(rows):
        lengths.extend(int(x) for x in row)
        bins.extend([r] * len(row))
        count = r + 1
    return report_from_bins(
        np.array(bins, dtype=np.int64), np.array(lengths, dtype=np.int64), seq_length, num_rows=count, cp=cp, tp=tp
    )


def report_from_cu_seqlens(
    cu_seqlens: Any, real_tokens: int, rows: int, seq_length: int, cp: int = 1, tp: int = 1
) -> PackingReport:
    """The report of one packed micro-batch from its host `cu_seqlens` (one segment per sample
    and per padding run over the flattened `[rows * seq_length]` stream, `PackedBatch`) and its
    real (non-padding) positions: computed = every segment padded to the CP multiple, as
    `mmtrain.models.context_parallel.cp_layout` pads it."""
    cu = np.asarray(cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens), dtype=np.int64)
    seg = np.diff(cu)
    computed = int(_aligned(seg[seg > 0], padding_multiple(cp, tp)).sum())
    return PackingReport(rows, rows * seq_length, int(real_tokens), computed, cp, tp)
