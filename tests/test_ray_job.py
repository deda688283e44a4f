"""The private Ray instance a job starts and stops (mmdata/ray_job.py), seen through Ray's public
API and the processes it leaves: the size it was given, tasks that run, and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, os
import psutil, ray
from mmdata.ray_job import init_ray, object_store_bytes, shutdown_ray

owned = init_ray(None, 1)
again = init_ray(None, 2)  # Ray is already up in this process: joined, not owned
shutdown_ray(again)  # (so this leaves it running)
up_after_unowned_stop = ray.is_initialized()
resources = ray.cluster_resources()

@ray.remote(num_cpus=1)
def pid():
    return os.getpid()

worker = ray.get(pid.remote())
started = psutil.Process().children(recursive=True)
commands = [" ".join(p.cmdline()) for p in started]
shutdown_ray(owned)
_, alive = psutil.wait_procs(started, timeout=60)  # (a bound, so a leak fails instead of hanging)
print(json.dumps({"owned": owned, "again": again, "up_after_unowned_stop": up_after_unowned_stop,
                  "cpus": resources.get("CPU"), "store": resources.get("object_store_memory"),
                  "expected_store": object_store_bytes(), "worker": worker,
                  "worker_was_a_child": worker in {p.pid for p in started}, "commands": commands,
                  "alive_after_shutdown": [" ".join(p.cmdline()) for p in alive if p.is_running()],
                  "initialized_after_shutdown": ray.is_initialized()}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    """One private instance started and stopped by `init_ray`/`shutdown_ray` in a fresh process."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_private_instance_gets_the_cpus_and_object_store_it_was_given_and_runs_tasks(probe: dict) -> None:
    assert probe["owned"] and probe["cpus"] == 1.0
    assert probe["store"] == probe["expected_store"] == 256 << 20
    assert probe["worker"] > 0 and probe["worker_was_a_child"]
    assert any("raylet" in c for c in probe["commands"]) and any("gcs_server" in c for c in probe["commands"])


def test_a_process_already_running_ray_keeps_it(probe: dict) -> None:
    """`init_ray` in a process where Ray is up joins it without owning it, and `shutdown_ray` of
    an instance it does not own leaves it running (a notebook's own Ray survives a job)."""
    assert probe["again"] is False and probe["up_after_unowned_stop"]


def test_shutdown_stops_every_process_the_instance_started(probe: dict) -> None:
    """Raylet, GCS, workers and Ray's helper processes: none outlives the job."""
    assert probe["alive_after_shutdown"] == [] and not probe["initialized_after_shutdown"]


@pytest.mark.unit
def test_a_bad_object_store_setting_is_refused_before_ray_starts(monkeypatch) -> None:
    import ray

    from mmdata.errors import UserError
    from mmdata.ray_job import OBJECT_STORE_ENV, init_ray

    if ray.is_initialized():
        pytest.skip("Ray is already running in this test process")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv(OBJECT_STORE_ENV, "12")
    with pytest.raises(UserError, match=f"{OBJECT_STORE_ENV}='12'"):
        init_ray(None, 1)
    assert not ray.is_initialized()


@pytest.mark.unit
def test_a_install_without_ray_gets_one_line_naming_the_extra(monkeypatch):
    """A training-only install (no `data` extra) running a Ray job: a UserError (rc 2) that names
    the extra, not an ImportError traceback."""
    import sys

    from mmdata.errors import UserError
    from mmdata.ray_job import init_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what Python's import does when a module is absent
    with pytest.raises(UserError, match=r"mmdata-mmtrain\[data\]"):
        init_ray(None, 1)


def _timing_out(times: int, monkeypatch) -> list[int]:
    """Ray's own start, failing the first `times` calls as Ray does when its raylet misses the
    30 s it is given (ray/_private/node.py: a bare Exception with this text)."""
    import ray

    calls, real_init = [], ray.init

    def init(*args, **kwargs):
        calls.append(1)
        if len(calls) <= times:
            raise Exception("The current node timed out during startup. This could happen because ...")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(ray, "init", init)
    return calls


def test_a_ray_start_that_times_out_is_tried_once_more(monkeypatch, caplog):
    """A busy machine: the first start times out, the second starts a real local Ray."""
    from mmdata.ray_job import init_ray, shutdown_ray

    calls = _timing_out(1, monkeypatch)
    with caplog.at_level("WARNING"):
        owned = init_ray(None, 1)
    try:
        assert owned and len(calls) == 2
        assert "starting it once more" in caplog.text
    finally:
        shutdown_ray(owned)


@pytest.mark.unit
def test_a_ray_start_that_times_out_twice_is_one_line(monkeypatch):
    """Twice: a UserError (rc 2) that says what happened and what to do, not Ray's traceback."""
    from mmdata.errors import UserError
    from mmdata.ray_job import RAY_START_ATTEMPTS, init_ray

    calls = _timing_out(RAY_START_ATTEMPTS, monkeypatch)
    with pytest.raises(UserError, match=r"did not start in time, 2 tries .*`ray start --head`"):
        init_ray(None, 1)
    assert len(calls) == RAY_START_ATTEMPTS
