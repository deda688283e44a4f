"""The driver's scan processes: every file is scanned exactly once (by a child or by whoever
takes it), a failure is re-raised with the file's name, a file a child died on is handed back,
and no child outlives the driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mmdata.preprocess.adapters.base import InputUnit
from mmdata.preprocess.driver_scan import DriverScanner


def _units(n: int) -> list[InputUnit]:
    return [InputUnit(index=i, path=f"/data/part{i:03d}.tar", rel=f"part{i:03d}.tar", size=100, mtime_ns=0)
            for i in range(n)]


def _echo(unit: InputUnit) -> dict:
    return {"index": unit.index, "scanned_by": os.getpid()}


def _scan_everything(scanner: DriverScanner) -> list:
    """Start the children, let them scan every file (they end by themselves when none is left)
    and collect the results."""
    scanner.start()
    try:
        [p.join() for p in scanner._processes]
        return scanner.finish()
    finally:
        scanner.close()


def _slow(unit: InputUnit) -> dict:
    time.sleep(0.05)
    return _echo(unit)


@pytest.mark.parametrize("processes", [1, 3])
def test_every_file_is_scanned_once_by_the_children_or_by_take(processes):
    units = _units(90)
    scanner = DriverScanner(units, _slow, processes=processes)
    scanner.start()
    try:
        results = []
        while not results:  # the children have scanned some (however loaded the machine is)
            time.sleep(0.02)
            results += scanner.drain()
        scanner.stop()
        by_ray = list(iter(scanner.take, None))
        results += scanner.drain() + scanner.finish()
        assert scanner.unfinished() == []
    finally:
        scanner.close()
    in_child = [u.index for u, _ in results]
    assert in_child and by_ray, (len(in_child), len(by_ray))
    assert sorted(in_child + [u.index for u in by_ray]) == list(range(90))
    assert all(r == {"index": u.index, "scanned_by": r["scanned_by"]} for u, r in results)
    # the scan ran in `processes` children (under load, at nice +10, one may start only after
    # the others have taken everything, so which child scanned what is not asserted)
    children = {p.pid for p in scanner._processes}
    assert len(children) == processes and os.getpid() not in children
    assert {r["scanned_by"] for _, r in results} <= children
    assert scanner.scanned == len(in_child)


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_without_stop_the_child_scans_everything(start_method):
    scanner = DriverScanner(_units(25), _echo, start_method)
    results = _scan_everything(scanner)
    assert [u.index for u, _ in results] == list(range(25))
    assert scanner.take() is None and scanner.unfinished() == []


def _niceness(unit: InputUnit) -> dict:
    return {"nice": os.nice(0)}


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no os.nice")
def test_children_scan_below_the_drivers_priority():
    """Ray's start comes first: the children take the CPU it leaves."""
    results = _scan_everything(DriverScanner(_units(4), _niceness, processes=2))
    assert len(results) == 4 and {r["nice"] for _, r in results} == {min(19, os.nice(0) + 10)}


def _fails_on_third(unit: InputUnit) -> dict:
    if unit.index == 2:
        raise ValueError("bad header")
    return _echo(unit)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_failed_scan_is_raised_with_the_file_name(processes):
    scanner = DriverScanner(_units(5), _fails_on_third, processes=processes)
    scanner.start()
    try:
        [p.join() for p in scanner._processes]  # it stops at the failure
        with pytest.raises(RuntimeError, match=r"part002\.tar in the driver failed:(.|\n)*ValueError: bad header"):
            scanner.finish()
    finally:
        scanner.close()


def _dies_on_second(unit: InputUnit) -> dict:
    if unit.index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _echo(unit)


def test_a_file_a_child_died_on_is_handed_back_while_the_others_go_on():
    scanner = DriverScanner(_units(30), _dies_on_second, processes=3)
    scanner.start()
    try:
        [p.join() for p in scanner._processes]  # the other two finish every other file
        results = scanner.finish()
    finally:
        scanner.close()
    assert sorted(p.exitcode for p in scanner._processes) == [-signal.SIGKILL, 0, 0]
    assert sorted(u.index for u, _ in results) == [i for i in range(30) if i != 1]
    assert [u.index for u in scanner.unfinished()] == [1] and scanner.take() is None


def test_a_file_the_child_died_on_is_handed_back():
    scanner = DriverScanner(_units(4), _dies_on_second)
    scanner.start()
    try:
        [p.join() for p in scanner._processes]
        results = scanner.finish()
    finally:
        scanner.close()
    assert scanner._processes[0].exitcode == -signal.SIGKILL
    assert [u.index for u, _ in results] == [0]
    assert [u.index for u in scanner.unfinished()] == [1]  # then 2, 3 were never claimed
    assert [u.index for u in iter(scanner.take, None)] == [2, 3]


def _forever(unit: InputUnit) -> dict:
    time.sleep(3600)
    return {}


def test_close_ends_a_busy_child_at_once():
    scanner = DriverScanner(_units(2), _forever)
    scanner.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    scanner.close()
    assert time.monotonic() - t0 < 60  # (not the hour: terminated, not waited for)
    assert not any(p.is_alive() for p in scanner._processes)


def test_fork_only_from_a_process_without_threads_or_ray(monkeypatch):
    from mmdata.preprocess import driver_scan

    monkeypatch.setattr(driver_scan, "LINUX", True)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert driver_scan._start_method() == ("fork" if threading.active_count() == 1 else "spawn")
    monkeypatch.setitem(sys.modules, "ray", object())
    assert driver_scan._start_method() == "spawn"
    monkeypatch.setattr(driver_scan, "LINUX", False)
    monkeypatch.delitem(sys.modules, "ray")
    assert driver_scan._start_method() == "spawn"


def test_nothing_to_scan_starts_no_process():
    scanner = DriverScanner([], _echo)
    scanner.start()
    assert not scanner.started
    assert scanner.finish() == [] and scanner.unfinished() == []
    scanner.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_the_child_dies_with_a_killed_driver(tmp_path: Path):
    driver = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from tests.test_driver_scan import _units, _forever
        from mmdata.preprocess.driver_scan import DriverScanner
        s = DriverScanner(_units(2), _forever, processes=2)
        s.start()
        print(*(p.pid for p in s._processes), flush=True)
        time.sleep(3600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    children = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(children) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(600):  # the kernel signals them as the driver exits; reaped by init
        if not any(map(_alive, children)):
            break
        time.sleep(0.05)
    assert not any(map(_alive, children)), "a scan process outlived its driver"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
