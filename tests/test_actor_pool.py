"""mmdata/actor_pool.py on a real local Ray instance (in a subprocess: nothing of Ray left in
pytest): every item done once with at most `queue_per_actor` queued per actor, a lost actor's
items finished by the others, a constructor failure raised as is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, os
import ray
from ray.exceptions import RayActorError
from mmdata.actor_pool import ActorPoolError, run_on_actors

ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)


@ray.remote(num_cpus=1)
class Square:
    def __init__(self, name, die_on=None, fail=False):
        if fail:
            raise ValueError("cannot load the model")
        self.name, self.die_on = name, die_on

    def run(self, x):
        if x == self.die_on:
            os._exit(1)  # the process dies (no restarts left: max_restarts=0)
        return self.name, x * x


def drive(actors, items, **kw):
    queued, peak, results = {}, {}, {}

    def call(actor, x):
        queued[actor] = queued.get(actor, 0) + 1
        peak[actor] = max(peak.get(actor, 0), queued[actor])
        return actor.run.remote(x)

    def done(x, r):
        name, y = r
        queued[by_name[name]] -= 1
        results.setdefault(x, []).append((name, y))

    by_name = {n: a for n, a in actors}
    finished = run_on_actors([a for _, a in actors], items, call, done, **kw)
    return finished, sorted(peak.values()), results


report = {}
actors = [(n, Square.remote(n)) for n in "abc"]
finished, peak, results = drive(actors, range(20), queue_per_actor=2)
report["plain"] = {"finished": finished, "peak": peak,
                   "ok": sorted(results) == list(range(20)) and all(len(v) == 1 and v[0][1] == x * x
                                                                   for x, v in results.items())}
actors = [("a", Square.remote("a", die_on=0)), ("b", Square.remote("b"))]
finished, _, results = drive(actors, range(12), queue_per_actor=2)
report["lost"] = {"finished": finished, "ok": sorted(results) == list(range(12)),
                  "by": sorted({n for v in results.values() for n, _ in v})}
try:
    drive([("a", Square.remote("a", fail=True))], range(3))
    report["init"] = "no error"
except RayActorError as e:
    report["init"] = "init failed" if e.actor_init_failed and "cannot load the model" in str(e) else str(e)
try:
    drive([("a", Square.remote("a", die_on=1))], range(3))
    report["all_lost"] = "no error"
except ActorPoolError as e:
    report["all_lost"] = str(e)
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow  # 7 actor processes and 2 deaths: ~2 min on 2 loaded cores
def test_pool_bounds_queues_moves_lost_work_and_raises_init_errors():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", PROBE], check=False, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line[len("REPORT ") :])
    plain = report["plain"]
    assert plain["ok"] and sum(plain["finished"]) == 20 and min(plain["finished"]) >= 1, plain
    assert plain["peak"] == [2, 2, 2]  # every actor had 2 queued at some point, never more
    lost = report["lost"]
    assert lost["ok"] and lost["finished"] == [0, 12] and lost["by"] == ["b"], lost  # a died on its first item
    assert report["init"] == "init failed"
    assert report["all_lost"].startswith("all 1 actors were lost beyond their restarts"), report["all_lost"]
