"""Live progress on stderr (records validated, buckets sorted, shards written, throughput)
and the final summary table."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class JobProgress:
    def __init__(self, enabled: bool = True):
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
            console=self.console, disable=not enabled, transient=False,
        )
        self.tasks: dict[str, int] = {}
        self.t0: dict[str, float] = {}

    def __enter__(self) -> "JobProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def stage(self, name: str, total: int) -> None:
        self.tasks[name] = self.progress.add_task(name, total=total, info="")
        self.t0[name] = time.perf_counter()

    def advance(self, name: str, n: int = 1, *, records: int | None = None, unit: str = "records") -> None:
        info = ""
        if records is not None:
            dt = max(1e-9, time.perf_counter() - self.t0[name])
            info = f"{records} {unit} ({records / dt:,.0f}/s)"
        self.progress.update(self.tasks[name], advance=n, **({"info": info} if info else {}))


def summary_table(manifest: dict) -> Table:
    c = manifest["counts"]
    cols = ["read", "written", "quarantined"] + [k for k in ("filtered", "duplicates", "mixed_out", "repeated") if c.get(k)]
    t = Table(title=f"mmdata preprocess: {manifest['run']['output']}")
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
    t.caption = (f"{len(manifest['shards'])} shards, {total_bytes / 1e6:,.1f} MB, "
                 f"{manifest['samples_per_shard']} samples/shard, {wall:.1f} s "
                 f"({c['read'] / max(wall, 1e-9):,.0f} records/s)\n{media_resolution_line(c['media_resolution'])}")
    mix = (manifest.get("curation") or {}).get("mix")
    if mix and "realised" in mix:
        t.caption += "\nmix (target → realised): " + " · ".join(
            f"{g or '(none)'} {mix['target'][g]:,} → {mix['realised'][g]:,}" for g in mix["target"])
    return t


def media_resolution_line(mr: dict[str, int]) -> str:
    """e.g. "media found by stem 9,998,812 · by name 12 · by basename 0; unreferenced members 3"."""
    found = " · ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in mr.items() if k.startswith("by_"))
    return f"media found {found}; unreferenced members {mr.get('unreferenced_members', 0):,}"
