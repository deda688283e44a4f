"""`session_fixture`: a session fixture built once per session, however many test modules import it.

pytest registers a fixture imported into several test modules once per module, and builds a
session-scoped one again for each (the Emu3 token shards: a Ray job each time; a base training
run: a training process each time). The value is kept here by session (its base temp dir) and
fixture name, as tests/inspect_fixtures.py keeps its dataset. The fixture modules are registered
once in tests/conftest.py (`pytest_plugins`), which alone builds each once; the cache keeps a module
that still imports a fixture (tests/gpu/) from building it again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest

_built: dict[tuple[str, str], Any] = {}


def session_fixture(build: Callable[..., Any]):
    """`build(tmp_path_factory, **fixtures)` as a session fixture, built once per session."""

    @functools.wraps(build)
    def once(tmp_path_factory, **fixtures):
        key = (str(tmp_path_factory.getbasetemp()), build.__name__)
        if key not in _built:
            _built[key] = build(tmp_path_factory, **fixtures)
        return _built[key]

    return pytest.fixture(scope="session")(once)
