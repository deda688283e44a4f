"""The driver scans input files itself, in child processes, while it imports and starts Ray.

A private Ray instance takes seconds to boot, its workers a while longer, and for much of that
time the cores are idle: the driver's interpreter does one core's worth of work (importing Ray,
starting its processes) and Ray's processes often wait on each other. The children are forked
before Ray is imported, so they share nothing with Ray and no GIL with the driver: they scan from
the first second, at full speed, on every core Ray's start leaves free. (A scanning thread in the
driver took the GIL at each of the import's file reads and stretched Ray's start to twice as
long; a single child left a core idle whenever Ray's start waited, up to a second per job on 2
cores.)

The children and the driver's Ray submission loop claim files from one shared counter; once
stopped (Ray has scanned its first file), each child finishes its current file and exits.
`scan_unit` is a pure function of the file, so who scans a file never changes the output. A file
a child took but could not finish (it died) is handed back by `unfinished()`, for Ray to scan.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from mmdata.parent_death import LINUX, die_with_parent
from mmdata.preprocess.adapters.base import InputUnit

def _start_method() -> str:
    """fork where it is safe: on Linux, from a process with no other threads and no Ray in it
    (the CLI forks before it imports Ray), so a child starts at once with every module the
    scan needs. Elsewhere (macOS, Windows, a notebook running Ray) a fresh interpreter, which
    imports them first."""
    if LINUX and threading.active_count() == 1 and "ray" not in sys.modules:
        return "fork"
    return "spawn"


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _claim(counter, n: int) -> int | None:
    """The next unclaimed file's position, or None when every file is claimed."""
    with counter.get_lock():
        i = counter.value
        if i >= n:
            return None
        counter.value = i + 1
        return i


def _yield_to_ray() -> None:
    """Lower this child's priority (nice +10, about a tenth of a core's share against a busy
    process): Ray's start and its workers come first, the children scan on what they leave. At
    normal priority a child per core starved Ray's start (measured on 2 cores: 3 s became 4-8 s,
    and Ray's first task began only when the children had scanned nearly everything). Not much
    lower: with Linux's SCHED_IDLE the scan took longer, not shorter (a child preempted while
    holding the file counter's lock can wait long for CPU, and the driver's `take()` with it)."""
    try:
        os.nice(10)
    except OSError:  # (not permitted: then at the driver's priority)
        pass


def _scan_loop(units: list[InputUnit], scan: Callable[[InputUnit], dict], counter, stopped,
               results: Connection, driver: int) -> None:
    """The child: scan claimed files until stopped or none is left; send (kind, position, payload)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it stops the children
    die_with_parent(driver)  # (and the loop checks between files, on every platform)
    _yield_to_ray()
    try:
        while not stopped.value and os.getppid() == driver and (i := _claim(counter, len(units))) is not None:
            try:
                results.send(("done", i, scan(units[i])))
            except Exception:  # noqa: BLE001 - re-raised in the driver by finish()
                stopped.value = 1  # (the other children stop too)
                results.send(("failed", i, traceback.format_exc()))
                return
    finally:
        results.close()


class DriverScanner:
    """Scans `units` in `processes` child processes from `start()` until `stop()`; the driver
    takes the files not yet claimed with `take()`, collects results with `drain()` (as they come,
    so its checks see the first files early) and `finish()`, and always ends with `close()`."""

    def __init__(self, units: list[InputUnit], scan: Callable[[InputUnit], dict], start_method: str | None = None,
                 processes: int = 1):
        ctx = multiprocessing.get_context(start_method or _start_method())
        self._units = list(units)
        self._counter = ctx.Value("q", 0)
        self._stopped = ctx.Value("b", 0)
        self._readers: list[Connection] = []  # one pipe per child: the driver keeps the reading ends
        self._senders: list[Connection] = []
        self._processes = []
        for k in range(max(1, min(processes, len(self._units)))):
            reader, sender = ctx.Pipe(duplex=False)
            self._readers.append(reader)
            self._senders.append(sender)
            self._processes.append(ctx.Process(
                target=_scan_loop, name=f"mmdata-driver-scan-{k}", daemon=True,
                args=(self._units, scan, self._counter, self._stopped, sender, os.getpid())))
        self._open = list(self._readers) if self._units else []  # readers not at end-of-file
        self._taken: set[int] = set()  # positions take() handed to Ray
        self._reported: set[int] = set()  # positions a child finished
        self._failure: tuple[int, str] | None = None
        self.scanned = 0

    @property
    def started(self) -> bool:
        return any(p.pid is not None for p in self._processes)

    def start(self) -> None:
        if self._units:
            for process in self._processes:
                process.start()
        self._close_senders()

    def take(self) -> InputUnit | None:
        """The next file nobody has claimed (for Ray), or None."""
        i = _claim(self._counter, len(self._units))
        if i is None:
            return None
        self._taken.add(i)
        return self._units[i]

    def stop(self) -> None:
        """Claim no new file (each child finishes its current one)."""
        self._stopped.value = 1

    def drain(self) -> list[tuple[InputUnit, dict]]:
        """(unit, result) of the files scanned since the last call; does not wait."""
        out: list[tuple[InputUnit, dict]] = []
        while ready := wait(self._open, timeout=0):
            for reader in ready:
                self._receive(reader, out)
        return out

    def finish(self) -> list[tuple[InputUnit, dict]]:
        """Stop, wait for the children, and return the results not yet drained. Raises the error
        of a file whose scan failed (as a scan in Ray would)."""
        self.stop()
        out: list[tuple[InputUnit, dict]] = []
        if not self.started:
            self._open = []
        while self._open:
            for reader in wait(self._open):
                self._receive(reader, out)
        for process in self._processes:
            if process.pid is not None:
                process.join()
        if self._failure is not None:
            i, trace = self._failure
            raise RuntimeError(f"scanning {self._units[i].path} in the driver failed:\n{trace}")
        return out

    def unfinished(self) -> list[InputUnit]:
        """Files a child claimed but never finished (it died: killed, out of memory); after
        `finish()`."""
        with self._counter.get_lock():
            claimed = min(self._counter.value, len(self._units))
        return [self._units[i] for i in range(claimed) if i not in self._taken and i not in self._reported]

    def close(self) -> None:
        """End the children now if they still run (an error or Ctrl-C in the driver: their
        current files are abandoned, and rescanned by a rerun, like a killed Ray task's)."""
        self.stop()
        for process in self._processes:
            if process.pid is not None and process.is_alive():
                process.terminate()
        for process in self._processes:
            if process.pid is not None:
                process.join()
        for reader in self._readers:
            reader.close()
        self._open = []
        self._close_senders()

    def _receive(self, reader: Connection, out: list[tuple[InputUnit, dict]]) -> None:
        try:
            kind, i, payload = reader.recv()
        except EOFError:  # that child has exited (or died)
            self._open.remove(reader)
            return
        if kind == "done":
            self._reported.add(i)
            self.scanned += 1
            out.append((self._units[i], payload))
        elif kind == "failed" and self._failure is None:
            self._failure = (i, payload)

    def _close_senders(self) -> None:
        # The driver keeps only the reading ends, so that a child's exit reads as end-of-file.
        for sender in self._senders:
            sender.close()
        self._senders = []
