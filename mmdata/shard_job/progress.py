"""Live progress of a Ray job on stderr (units done per stage, records and their rate) and what a
resumed run found already done (mmdata/stage_runner.py drives it for both jobs)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mmdata.units import plural


class JobProgress:
    def __init__(self, enabled: bool = True):
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not enabled,
            transient=False,
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
