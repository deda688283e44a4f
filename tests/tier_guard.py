"""The unit tier's promise, enforced (a pytest plugin, registered in tests/conftest.py).

`unit` means pure functions and in-process models: no `slow` mark and no other process.
- An item marked both `unit` and `slow` is a collection error (a module's `pytestmark = unit`
  plus a function's `@slow` gives both; mark such a module's fast tests one by one instead).
- While a `unit` item sets up, runs and tears down, starting a process fails it. Two public
  mechanisms see every way a process starts here: the audit events that CPython raises for
  `subprocess.Popen` (so `ray.init`, `torchrun`, `mmdata ...` in a subprocess), `os.fork`
  (multiprocessing's default), `os.posix_spawn`, `os.system` and `os.exec*`; and
  `multiprocessing`'s `BaseProcess.start`, because the spawn and forkserver start methods (torch's
  `mp.spawn`, DataLoader workers under spawn) create the child with no audit event.
Such a test belongs to the default tier: drop its `unit` mark.
"""

from __future__ import annotations

import multiprocessing.process
import sys
from typing import Any, Iterator

import pytest

# audit events that start another process (https://docs.python.org/3/library/audit_events.html)
_PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "os.startfile"}
)


class _Watch:
    """The unit item being run (None outside one) and the process starts it attempted."""

    nodeid: str | None = None
    seen: list[str] = []


def _refuse(what: str) -> None:
    _Watch.seen.append(what)
    raise RuntimeError(
        f"unit test {_Watch.nodeid} started a process ({what}): a unit test runs in-process only; "
        "move it to the default tier (drop its `unit` mark)"
    )


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _Watch.nodeid is not None and event in _PROCESS_EVENTS:
        _refuse(f"{event} {args[:2]!r}"[:300])


sys.addaudithook(_audit)  # cannot be removed; it does nothing outside a unit item
_process_start = multiprocessing.process.BaseProcess.start


def _guarded_start(self: multiprocessing.process.BaseProcess) -> None:
    if _Watch.nodeid is not None:
        _refuse(f"multiprocessing {type(self).__name__}.start")
    _process_start(self)


multiprocessing.process.BaseProcess.start = _guarded_start  # type: ignore[method-assign]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects, so the error does not depend on the tier run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    both = [
        item.nodeid
        for item in items
        if item.get_closest_marker("unit") is not None and item.get_closest_marker("slow") is not None
    ]
    if both:
        raise pytest.UsageError(
            "marked both unit and slow (the unit tier has no slow test; mark the module's "
            "fast tests `unit` one by one):\n  " + "\n  ".join(both)
        )


def _watched(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("unit") is None:
        return (yield)
    _Watch.nodeid, _Watch.seen = item.nodeid, []
    try:
        result = yield
    finally:
        _Watch.nodeid = None
    if _Watch.seen:  # the code under test caught our RuntimeError: fail the item all the same
        pytest.fail(f"unit test started a process: {_Watch.seen[0]}; move it to the default tier", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    return (yield from _watched(item))
