"""The driver scans input files itself, in a child process, while it imports and starts Ray.

A private Ray instance takes seconds to boot, its workers a while longer, and for most of that
time the driver's interpreter is busy with one core's worth of work (importing Ray, starting its
processes) while the other cores wait. The child is forked before Ray is imported, so it shares
nothing with Ray and no GIL with the driver: it scans from the first second, at full speed, and
Ray's import and start keep the driver's interpreter to themselves. (A scanning thread in the
driver took the GIL at each of the import's file reads and stretched Ray's start to twice as long.)

The child and the driver's Ray submission loop claim files from one shared counter; once
stopped (Ray has scanned its first file), the child finishes its current file and exits.
`scan_unit` is a pure function of the file, so who scans a file never changes the output. A file
the child took but could not finish (it died) is handed back by `unfinished()`, for Ray to scan.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from mmdata.parent_death import LINUX, die_with_parent
from mmdata.preprocess.adapters.base import InputUnit

def _start_method() -> str:
    """fork where it is safe: on Linux, from a process with no other threads and no Ray in it
    (the CLI forks before it imports Ray), so the child starts at once with every module the
    scan needs. Elsewhere (macOS, Windows, a notebook running Ray) a fresh interpreter, which
    imports them first."""
    if LINUX and threading.active_count() == 1 and "ray" not in sys.modules:
        return "fork"
    return "spawn"


def _claim(counter, n: int) -> int | None:
    """The next unclaimed file's position, or None when every file is claimed."""
    with counter.get_lock():
        i = counter.value
        if i >= n:
            return None
        counter.value = i + 1
        return i


def _scan_loop(units: list[InputUnit], scan: Callable[[InputUnit], dict], counter, stopped,
               results: Connection, driver: int) -> None:
    """The child: scan claimed files until stopped or none is left; send (kind, position, payload)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it stops the child
    die_with_parent(driver)  # (and the loop checks between files, on every platform)
    try:
        while not stopped.value and os.getppid() == driver and (i := _claim(counter, len(units))) is not None:
            try:
                results.send(("done", i, scan(units[i])))
            except Exception:  # noqa: BLE001 - re-raised in the driver by finish()
                results.send(("failed", i, traceback.format_exc()))
                return
    finally:
        results.close()


class DriverScanner:
    """Scans `units` in a child process from `start()` until `stop()`; the driver takes the
    files not yet claimed with `take()`, collects results with `drain()` (as they come, so its
    checks see the first files early) and `finish()`, and always ends with `close()`."""

    def __init__(self, units: list[InputUnit], scan: Callable[[InputUnit], dict], start_method: str | None = None):
        ctx = multiprocessing.get_context(start_method or _start_method())
        self._units = list(units)
        self._counter = ctx.Value("q", 0)
        self._stopped = ctx.Value("b", 0)
        self._results, sender = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_scan_loop, name="mmdata-driver-scan", daemon=True,
                                    args=(self._units, scan, self._counter, self._stopped, sender, os.getpid()))
        self._sender: Connection | None = sender
        self._taken: set[int] = set()  # positions take() handed to Ray
        self._reported: set[int] = set()  # positions the child finished
        self._eof = not self._units
        self._failure: tuple[int, str] | None = None
        self.scanned = 0

    def start(self) -> None:
        if self._units:
            self._process.start()
        self._close_sender()

    def take(self) -> InputUnit | None:
        """The next file nobody has claimed (for Ray), or None."""
        i = _claim(self._counter, len(self._units))
        if i is None:
            return None
        self._taken.add(i)
        return self._units[i]

    def stop(self) -> None:
        """Claim no new file (the current one is finished)."""
        self._stopped.value = 1

    def drain(self) -> list[tuple[InputUnit, dict]]:
        """(unit, result) of the files scanned since the last call; does not wait."""
        out: list[tuple[InputUnit, dict]] = []
        while not self._eof and self._results.poll():
            self._receive(out)
        return out

    def finish(self) -> list[tuple[InputUnit, dict]]:
        """Stop, wait for the child, and return the results not yet drained. Raises the error of
        a file whose scan failed (as a scan in Ray would)."""
        self.stop()
        out: list[tuple[InputUnit, dict]] = []
        self._eof |= self._process.pid is None  # (never started)
        while not self._eof:
            self._receive(out)
        if self._process.pid is not None:
            self._process.join()
        if self._failure is not None:
            i, trace = self._failure
            raise RuntimeError(f"scanning {self._units[i].path} in the driver failed:\n{trace}")
        return out

    def unfinished(self) -> list[InputUnit]:
        """Files the child claimed but never finished (it died: killed, out of memory); after
        `finish()`."""
        with self._counter.get_lock():
            claimed = min(self._counter.value, len(self._units))
        return [self._units[i] for i in range(claimed) if i not in self._taken and i not in self._reported]

    def close(self) -> None:
        """End the child now if it still runs (an error or Ctrl-C in the driver: its current
        file is abandoned, and rescanned by a rerun, like a killed Ray task's)."""
        self.stop()
        if self._process.pid is not None and self._process.is_alive():
            self._process.terminate()
        if self._process.pid is not None:
            self._process.join()
        self._results.close()
        self._close_sender()

    def _receive(self, out: list[tuple[InputUnit, dict]]) -> None:
        try:
            kind, i, payload = self._results.recv()
        except EOFError:  # the child has exited (or died)
            self._eof = True
            return
        if kind == "done":
            self._reported.add(i)
            self.scanned += 1
            out.append((self._units[i], payload))
        elif kind == "failed":
            self._failure = (i, payload)

    def _close_sender(self) -> None:
        # The driver keeps only the reading end, so that the child's exit reads as end-of-file.
        if self._sender is not None:
            self._sender.close()
            self._sender = None
