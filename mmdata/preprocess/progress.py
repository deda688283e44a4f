"""Live progress on stderr (records validated, buckets sorted, shards written, throughput),
what a resumed run found already done, and the final summary table."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mmdata.units import format_bytes, plural


class JobProgress:
    def __init__(self, enabled: bool = True):
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
            console=self.console, disable=not enabled, transient=False,
        )
        self.enabled = enabled
        self.tasks: dict[str, int] = {}
        self.t0: dict[str, float] = {}
        self.base: dict[str, int] = {}

    def __enter__(self) -> "JobProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def stage(self, name: str, total: int, *, started: float | None = None, base_records: int = 0) -> None:
        """A new stage of `total` steps. Its rate counts the records done in this run since
        `started` (default: now; work begun before the stage counts from when it began), not the
        `base_records` a resumed run found done."""
        self.tasks[name] = self.progress.add_task(name, total=total, info="")
        self.t0[name] = time.perf_counter() if started is None else started
        self.base[name] = base_records

    def advance(self, name: str, n: int = 1, *, records: int | None = None, unit: str = "records") -> None:
        info = ""
        if records is not None:
            dt = time.perf_counter() - self.t0[name]
            fresh = records - self.base[name]
            rate = f" ({fresh / dt:,.0f}/s)" if fresh > 0 and dt > 0.5 else ""
            info = f"{records:,} {unit}{rate}"
        self.progress.update(self.tasks[name], advance=n, **({"info": info} if info else {}))

    def resumed(self, name: str, done: int, total: int, unit: str, *, after: bool = False) -> None:
        """Say on screen what a rerun took over from the interrupted one."""
        if done and self.enabled:
            what = "kept from the interrupted run" if after else "already done"
            self.console.print(f"{name}: resumed, {done}/{plural(total, unit)} {what}")


def summary_table(manifest: dict, out: Path | None = None) -> Table:
    """The run's counts; `out` is where the shards are now (the manifest's `run.output` is where
    they were written, which differs for a copied folder)."""
    c = manifest["counts"]
    cols = ["read", "written", "quarantined"] + [k for k in ("filtered", "duplicates", "mixed_out", "repeated") if c.get(k)]
    t = Table(title=f"mmdata preprocess: {out or manifest['run']['output']}")
    t.add_column("what")
    for col in cols:
        t.add_column(col.replace("_", " "), justify="right")
    t.add_row("[bold]all", *(f"{c[k]:,}" for k in cols))
    for src, sc in c["by_source"].items():
        t.add_row(f"source {src or '(none)'}", *(f"{sc.get(k, 0):,}" for k in cols))
    for reason, n in c["by_reason"].items():
        t.add_row(f"reason {reason}", "", "", f"{n:,}", *("" for _ in cols[3:]))
    for rule, n in c.get("by_filter", {}).items():  # (the filtered column comes right after quarantined)
        t.add_row(f"filter {rule}", "", "", "", f"{n:,}", *("" for _ in cols[4:]))
    total_bytes = sum(s["bytes"] for s in manifest["shards"])
    wall = manifest.get("wall_time_s") or 0.0
    resumed = any((manifest.get("run") or {}).get("resumed", {}).values())
    rate = "resumed run" if resumed else f"{c['read'] / max(wall, 1e-9):,.0f} records/s"
    t.caption = (f"{shards_line(manifest['shards'])}, {format_bytes(total_bytes)}, {wall:.1f} s ({rate})\n"
                 f"{media_resolution_line(c['media_resolution'])}")
    mix = (manifest.get("curation") or {}).get("mix")
    if mix and "realised" in mix:
        t.caption += "\nmix (target → realised): " + " · ".join(
            f"{g or '(none)'} {mix['target'][g]:,} → {mix['realised'][g]:,}" for g in mix["target"])
    return t


def media_resolution_line(mr: dict[str, int]) -> str:
    """e.g. "media found by stem 9,998,812 · by name 12 · by basename 0; unreferenced members 3"."""
    found = " · ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in mr.items() if k.startswith("by_"))
    return f"media found {found}; unreferenced members {mr.get('unreferenced_members', 0):,}"


def shards_line(shards: list[dict]) -> str:
    """"4 shards of 50 samples (the last 44)" from the shards' own sample counts."""
    counts = [int(s["samples"]) for s in shards]
    if not counts:
        return "0 shards"
    head = f"{plural(len(counts), 'shard')} of {plural(max(counts), 'sample')}"
    if len(set(counts[:-1])) <= 1 and counts[-1] <= counts[0]:
        return head + (f" (the last {counts[-1]:,})" if counts[-1] != counts[0] else "")
    return f"{plural(len(counts), 'shard')} of {min(counts):,}-{max(counts):,} samples"
