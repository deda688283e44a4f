"""Per-machine calibration of the cost model from measured trials.

The analytical model misses what it cannot know about a machine: a fixed per-process memory
overhead (allocator pools, communication buffers; on CPU everything the process holds besides the
tensors) and how fast the kernels really run. A search fits, over its successful trials,

    measured peak memory  ~ memory_offset_gib + memory_scale * estimated memory   (least squares)
    measured step time    ~ time_scale * estimated step time                      (median ratio)

and writes them to `<run_dir>/auto_tune/calibration.yaml`. `auto_tune.calibration: PATH` makes
later dry-runs and searches on the same machine use them. The error before/after is reported
leave-one-out (each trial predicted from a fit on the others) when there are 3 or more trials,
otherwise in-sample (and said so).
"""

from __future__ import annotations

import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import yaml

from mmdata.errors import UserError

GIB = 1024**3


@dataclass(frozen=True)
class Calibration:
    memory_offset_gib: float = 0.0
    memory_scale: float = 1.0
    time_scale: float = 1.0
    host: str = ""
    device: str = ""
    trials: int = 0  # how many measured trials the fit used

    def memory_bytes(self, estimate_bytes: float) -> float:
        return self.memory_offset_gib * GIB + self.memory_scale * estimate_bytes

    def step_s(self, estimate_s: float) -> float:
        return self.time_scale * estimate_s

    @property
    def identity(self) -> bool:
        return (self.memory_offset_gib, self.memory_scale, self.time_scale) == (0.0, 1.0, 1.0)

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        header = (
            "# Cost-model calibration of one machine, fitted by mmtrain auto_tune from measured trials.\n"
            "# Use it: auto_tune.calibration=THIS_FILE (dry_run and auto_tune read it).\n"
        )
        out.write_text(header + yaml.safe_dump(asdict(self), sort_keys=False))
        return out

    @classmethod
    def load(cls, path: str | Path | None) -> "Calibration":
        if not path:
            return cls()
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except (OSError, yaml.YAMLError, TypeError) as err:
            raise UserError(f"auto_tune.calibration: cannot read {path}: {err}") from None


def fit(
    est_mem_gib: Sequence[float],
    meas_mem_gib: Sequence[float],
    est_step_s: Sequence[float],
    meas_step_s: Sequence[float],
    device: str = "",
) -> Calibration:
    """Fit a calibration to paired (estimate, measurement) points of successful trials."""
    offset, scale = _line(est_mem_gib, meas_mem_gib)
    ratios = [m / e for e, m in zip(est_step_s, meas_step_s) if e > 0]
    return Calibration(
        offset, scale, statistics.median(ratios) if ratios else 1.0, platform.node(), device, len(meas_mem_gib)
    )


def _line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares y = a + b x; with one point (or no spread in x) a pure offset."""
    if not x:
        return 0.0, 1.0
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((xi - mx) ** 2 for xi in x)
    if len(x) < 2 or sxx <= 1e-12 * max(mx * mx, 1e-30):
        return my - mx, 1.0
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sxx
    if b <= 0:  # noise on a narrow range: keep the model's slope, fit the offset
        return my - mx, 1.0
    return my - b * mx, b


@dataclass(frozen=True)
class ErrorStats:
    median: float  # relative error |estimate - measured| / measured
    worst: float
    n: int

    def text(self) -> str:
        return f"median {self.median:.0%}, worst {self.worst:.0%} over {self.n}"


def rel_errors(est: Sequence[float], meas: Sequence[float]) -> ErrorStats | None:
    errs = [abs(e - m) / m for e, m in zip(est, meas) if m > 0]
    return ErrorStats(statistics.median(errs), max(errs), len(errs)) if errs else None


def calibrated_errors(
    est_mem: Sequence[float], meas_mem: Sequence[float], est_step: Sequence[float], meas_step: Sequence[float]
) -> tuple[ErrorStats | None, ErrorStats | None, bool]:
    """(memory error, step-time error) of calibrated estimates, and whether leave-one-out."""
    n = len(meas_mem)
    loo = n >= 3
    pred_mem, pred_step = [], []
    for i in range(n):
        keep = [j for j in range(n) if j != i] if loo else list(range(n))
        cal = fit(
            [est_mem[j] for j in keep],
            [meas_mem[j] for j in keep],
            [est_step[j] for j in keep],
            [meas_step[j] for j in keep],
        )
        pred_mem.append(cal.memory_offset_gib + cal.memory_scale * est_mem[i])
        pred_step.append(cal.step_s(est_step[i]))
    return rel_errors(pred_mem, meas_mem), rel_errors(pred_step, meas_step), loo
