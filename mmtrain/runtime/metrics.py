"""Per-step training metrics (`<run_dir>/metrics.jsonl`, written by rank 0) and `mmtrain worst-samples`.
Design notes: docs/training.md, "metrics.jsonl, field by field"."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

from mmdata.errors import UserError

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # 0-d tensors / numpy scalars
        return _clean(value.item())
    return value


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _read_lines(path: Path) -> tuple[list[dict], int]:
    """Complete records, and the byte length of the complete part of the file."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # drop a partial trailing line left by a crash
    records = []
    for line in data[:end].splitlines():
        if line.strip():
            records.append(json.loads(line))
    return records, end


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Records of `<run_dir>/metrics.jsonl` (or of that file itself), last write per step wins."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    records, _ = _read_lines(path)
    by_step: dict[int, dict] = {}
    for rec in records:
        by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


class MetricsWriter:
    """Appends one record per step to `<run_dir>/metrics.jsonl`, plus TensorBoard scalars."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._truncate(resume_step)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._tb = _summary_writer(self.run_dir / "tensorboard") if tensorboard else None

    def _truncate(self, resume_step: int | None) -> None:
        records, end = _read_lines(self.path)
        keep = [r for r in records if resume_step is None or int(r["step"]) <= resume_step]
        if len(keep) == len(records) and end == (self.path.stat().st_size if self.path.exists() else 0):
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in keep))
        os.replace(tmp, self.path)

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def write(self, record: dict[str, Any]) -> None:
        if not isinstance(record.get("step"), int) or isinstance(record.get("step"), bool):
            raise ValueError(f"a metrics record needs an int 'step', got {record.get('step')!r}")
        clean = _clean(record)
        line = (json.dumps(clean, allow_nan=False) + "\n").encode()
        os.write(self._fd, line)  # one write per line: O_APPEND keeps lines whole
        if self._tb is not None:
            for key, value in clean.items():
                number = _as_float(value)
                if key != "step" and number is not None:
                    self._tb.add_scalar(f"train/{key}", number, record["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def _summary_writer(log_dir: Path) -> Any:
    """TensorBoard writer; asking for one without the optional `tensorboard` package is an error
    (the recipe check says so before training starts: mmtrain/runtime/preflight.py)."""
    if not tensorboard_available():
        raise ImportError("logging.tensorboard is true but the `tensorboard` package is not installed")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


# ----------------------------------------------------------------------------- worst samples


def worst_samples(
    records: Iterable[dict], step: int | None = None, top: int = 10
) -> tuple[dict, list[tuple[str, float | None]]]:
    """(record of the step, [(sample_key, loss)] highest loss first). Default step: highest loss."""
    records = list(records)
    if not records:
        raise LookupError("no metrics records")
    if step is None:
        scored = [(_as_float(r.get("loss")), r) for r in records]
        scored = [(v, r) for v, r in scored if v is not None and not math.isnan(v)]
        if not scored:
            raise LookupError("no record has a numeric loss")
        # (type checker: None losses are filtered out one line up)
        record = max(scored, key=lambda vr: vr[0])[1]  # type: ignore[arg-type,return-value]
    else:
        found = [r for r in records if int(r["step"]) == step]
        if not found:
            steps = [int(r["step"]) for r in records]
            raise LookupError(f"step {step} not in metrics (steps {min(steps)}..{max(steps)})")
        record = found[-1]
    losses = record.get("sample_losses") or {}
    ids = [str(i) for i in record.get("sample_ids") or []]
    if isinstance(losses, list):  # aligned with sample_ids
        if len(losses) != len(ids):
            raise ValueError(f"step {record['step']}: {len(losses)} sample_losses for {len(ids)} sample_ids")
        losses = {i: v for i, v in zip(ids, losses) if v is not None}
    losses = {str(k): v for k, v in losses.items()}
    ids = ids or list(losses)
    ids += [i for i in losses if i not in ids]
    ranked = sorted(((str(i), _as_float(losses.get(i))) for i in ids), key=_badness)
    return record, ranked[:top] if top > 0 else ranked


def _badness(item: tuple[str, float | None]) -> tuple[int, float]:
    """NaN losses first (the likeliest culprits), then highest loss, then ids without a loss."""
    loss = item[1]
    if loss is None:
        return (2, 0.0)
    if math.isnan(loss):
        return (0, 0.0)
    return (1, -loss)


WORST_SAMPLES_HELP = """Trace a loss spike to its data: the samples of one training step ranked by their own
loss (highest first; NaN first of all), read from RUN_DIR/metrics.jsonl, where every step records
its samples' keys (field `sample_ids`) and per-sample losses.

  mmtrain worst-samples RUN_DIR [--step N] [--top K]

Without --step, the step with the highest loss. A sample key is DATASET#SHARD_KEY, unique across
shards and blended datasets (a record id repeats across sources); show the sample, its images,
conversation and loss spans, with `mmdata inspect DATASET --key KEY`.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its metrics.jsonl)")
    parser.add_argument("--step", type=int, default=None, help="step to inspect (default: the highest-loss step)")
    parser.add_argument("--top", type=int, default=10, help="how many samples to print (default 10; 0 = all)")


def run(args: argparse.Namespace) -> int:
    path = Path(args.run_dir)
    if not path.exists() or (path.is_dir() and not (path / METRICS_FILE).is_file()):
        raise UserError(f"{path}: no {METRICS_FILE} there (give a run_dir of `mmtrain FAMILY RECIPE`)")
    try:
        record, ranked = worst_samples(read_metrics(path), args.step, args.top)
    except (LookupError, ValueError) as err:
        raise UserError(f"{err} ({path})") from None
    extras = ", ".join(f"{k} {record[k]:.4g}" for k in ("lr", "grad_norm") if isinstance(record.get(k), (int, float)))
    loss = _as_float(record.get("loss"))
    print(f"step {record['step']}: loss {'-' if loss is None else f'{loss:.4f}'}" + (f" ({extras})" if extras else ""))
    if not ranked:
        print("  no sample keys were logged for this step")
        return 0
    if all(loss is None for _, loss in ranked):
        print("  no per-sample losses logged; sample keys of the step:")
    width = max(len(i) for i, _ in ranked)
    print(f"  {'rank':>4}  {'sample_key':<{width}}  loss")
    for n, (sid, loss) in enumerate(ranked, 1):
        print(f"  {n:>4}  {sid:<{width}}  {'-' if loss is None else f'{loss:.4f}'}")
    return 0
