"""Fail fast on systematic loss: a job that quarantines most records for one reason is almost
always misconfigured (wrong --dataset or --image-root, a layout the adapter does not know), not
fed bad data, and finding out after hours of work loses those hours.

The check looks at the first input files in input order that together hold at least
`first_records` records (all of them when fewer): as soon as those files are scanned, whoever
scanned them and in whatever order, it decides once. So the verdict is a function of the
inputs, like everything else the job does. It keeps only per-file counts until it decides.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from mmdata.errors import UserError

DEFAULT_MAX_FRACTION = 0.2
DEFAULT_FIRST_RECORDS = 2000
EXAMPLES = 3


class SystematicLoss(UserError):
    """One quarantine reason took more than the allowed fraction of the first records (exit 2:
    a misconfiguration the user fixes)."""


class LossCheck:
    def __init__(
        self,
        num_units: int,
        max_fraction: float,
        quarantine_part: Callable[[int], Path],
        first_records: int = DEFAULT_FIRST_RECORDS,
    ):
        self.num_units, self.max_fraction, self.first_records = num_units, max_fraction, first_records
        self.quarantine_part = quarantine_part  # unit index -> its scan's quarantine lines
        self.pending: dict[int, dict] = {}  # scanned units not yet in the prefix
        self.prefix = 0  # units 0 .. prefix-1 are counted
        self.read = 0
        self.reasons: Counter[str] = Counter()
        self.decided = max_fraction >= 1.0

    def add(self, unit_index: int, counts: dict) -> None:
        """Count one scanned unit; raise SystematicLoss when the verdict is in and bad."""
        if self.decided:
            return
        self.pending[unit_index] = counts
        while self.prefix in self.pending:
            c = self.pending.pop(self.prefix)
            self.read += c["read"]
            self.reasons.update(c["by_reason"])
            self.prefix += 1
            if self.read >= self.first_records or self.prefix == self.num_units:
                self.decided = True
                self.pending.clear()
                self._judge()
                return

    def _judge(self) -> None:
        if not self.reasons:
            return
        reason, n = max(sorted(self.reasons.items()), key=lambda kv: kv[1])
        if n <= self.max_fraction * self.read:
            return
        examples = self._examples(reason)
        shown = "".join(f"\n  - {e['id']} at {e['source_location']}: {e['detail']}" for e in examples)
        raise SystematicLoss(
            f"{n:,} of the first {self.read:,} records ({n / self.read:.1%}, from the first {self.prefix} input "
            f"file(s)) were quarantined as {reason}, more than --max-quarantine-fraction {self.max_fraction:g} "
            f"allows. That is almost always a misconfiguration (wrong --dataset or --image-root, an input "
            f"layout the adapter does not know), not bad data. Examples:{shown}\n"
            f"Nothing was written. Fix the cause, or rerun with --max-quarantine-fraction 1.0 to accept the "
            f"loss (the files scanned so far are reused)."
        )

    def _examples(self, reason: str) -> list[dict]:
        out: list[dict] = []
        for u in range(self.prefix):
            path = self.quarantine_part(u)
            if not path.exists():
                continue
            with path.open(encoding="utf-8") as f:
                for line in f:
                    row = json.loads(line)
                    if row["reason"] == reason:
                        out.append(row)
                        if len(out) == EXAMPLES:
                            return out
        return out
