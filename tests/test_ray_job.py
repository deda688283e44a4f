"""The private Ray instance a job starts: only the processes a job uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, os
import psutil, ray
from ray._private import node as ray_node
from mmdata.ray_job import init_ray, shutdown_ray

from ray._private import services as ray_services, state as ray_state

original = (ray_node.Node.__init__, ray_node.Node.start_api_server, ray_services.get_node)
registered_when_asked = []  # per call of Ray's own node lookup: was the raylet registered already?
real_lookup = ray_state.GlobalState.get_node

def lookup(self, node_id):
    self._connect_and_get_accessor()
    registered_when_asked.append(any(n["NodeID"] == node_id and n["Alive"] for n in self.node_table()))
    return real_lookup(self, node_id)

ray_state.GlobalState.get_node = lookup
owned = init_ray(None, 1)
ray_state.GlobalState.get_node = real_lookup

@ray.remote(num_cpus=1)
def pid():
    return os.getpid()

worker = ray.get(pid.remote())
children = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
restored = (ray_node.Node.__init__, ray_node.Node.start_api_server, ray_services.get_node) == original
dashboard_url = ray._private.worker._global_node.webui_url
shutdown_ray(owned)
print(json.dumps({"owned": owned, "worker": worker, "children": children, "restored": restored,
                  "dashboard_url": dashboard_url,
                  "registered_when_asked": registered_when_asked}))
"""


def _probe() -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_private_instance_runs_tasks_without_monitors_or_api_server() -> None:
    """No log monitor, no autoscaler monitor and no API server (`dashboard.py`, whose usage-stats
    module would report to Ray's servers); tasks still run and Ray's node class is restored."""
    r = _probe()
    assert r["owned"] and r["worker"] > 0 and r["restored"]
    children = r["children"]
    assert any("raylet" in c for c in children) and any("gcs_server" in c for c in children), children
    assert not any("log_monitor.py" in c for c in children), children
    assert not any("autoscaler/_private/monitor.py" in c for c in children), children
    assert not any("dashboard/dashboard.py" in c for c in children), children
    assert r["dashboard_url"] is None


def test_private_start_asks_ray_for_its_node_only_once_registered() -> None:
    """Ray's own node lookup retries once a second; `ray.init` must reach it only after the new
    raylet has registered (the job's start polls the GCS first), so it never waits that second."""
    asked = _probe()["registered_when_asked"]
    assert asked and all(asked), asked
