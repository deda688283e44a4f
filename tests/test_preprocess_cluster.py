"""`mmdata preprocess --address` on a real two-node Ray cluster: a head and a separate worker
node started with `ray start` as processes on 127.0.0.1 (one CPU each). The output is
byte-identical to a local run, and the job's tasks ran on both nodes (the manifest counts the
tasks per node id). In the local run, the Ray workers running the first scan task, the first
sort task and the first shard write are SIGKILLed (the writer leaving its partial file behind): Ray retries the
tasks, and the output is still the same bytes, with no partial file left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from mmdata import shard_format as sf
from mmdata.shard_job.manifest import stable_view
from mmdata.dev.synth import generate_records, write_infinity_mm
from tests.cli_runs import flags
from tests.fixtures_preprocess import run_preprocess_cli
from tests.fixtures_preprocess import free_port, start_ray_node


# Loaded by every Python process of the local run (PYTHONPATH): the first scan task, the first
# sort task and the first shard write, in whichever Ray worker runs them, kill their own process
# (the writer after leaving a partial temp file, as a real crash would). Every input file is
# scanned by a Ray task.
_KILL_WORKERS_ONCE = """
import os, signal, sys
from pathlib import Path
from mmdata.preprocess import stages
from mmdata.shard_job import shard_writer

def _first(what):
    try:
        fd = os.open(Path(os.environ["KILL_ONCE_DIR"]) / f"killed-{what}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True

real_write, real_sort, real_scan = shard_writer._write, stages.sort_bucket, stages.scan_unit

def _write(tmp, *args):
    if _first("write"):
        Path(tmp).write_bytes(b"partial shard")
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(tmp, *args)

def sort_bucket(*args, **kwargs):
    if _first("sort"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_sort(*args, **kwargs)

def scan_unit(*args, **kwargs):
    if "default_worker" in sys.argv[0] and _first("scan"):  # a Ray worker's task
        os.kill(os.getpid(), signal.SIGKILL)
    return real_scan(*args, **kwargs)

shard_writer._write, stages.sort_bucket, stages.scan_unit = _write, sort_bucket, scan_unit
from mmdata.preprocess import job  # (after the patches: it imports scan_unit and sort_bucket by name)
"""


# Loaded by the cluster's Ray workers (the nodes' PYTHONPATH): each sort task takes half a second,
# as real buckets do. The test's tasks otherwise take milliseconds, and Ray then runs them all on
# the first leased worker (a finished lease is reused for the next task), which proves nothing
# about placement. With 4 sort tasks in flight and one CPU per node, both nodes must take some.
_SLOW_SORT = """
import sys, time
if "default_worker" in sys.argv[0]:
    from mmdata.preprocess import stages
    real_sort = stages.sort_bucket
    def sort_bucket(*args, **kwargs):
        time.sleep(0.5)
        return real_sort(*args, **kwargs)
    stages.sort_bucket = sort_bucket
"""


def _ray_start(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    return start_ray_node("--num-cpus=1", *args, env_extra=env_extra)


@pytest.fixture
def ray_cluster():
    """A head and one worker node (distinct processes and resources) on 127.0.0.1."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="/tmp/mmray")
    hook = Path(temp_dir) / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SLOW_SORT)
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    procs = [
        _ray_start(
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            '--resources={"head_node": 1}',
            env_extra=env,
        )
    ]
    try:
        procs.append(_ray_start(f"--address=127.0.0.1:{port}", '--resources={"worker_node": 1}', env_extra=env))
        yield f"127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):  # the groups we started: each `ray start` and what it spawned
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_two_node_cluster_equals_local_and_uses_both_nodes(ray_cluster, tmp_path):
    raw = tmp_path / "raw"
    write_infinity_mm(generate_records(80, seed=3, broken_fraction=0.05, synthetic=True), raw, samples_per_tar=10)
    common = flags(dataset="infinity-mm", input=raw, seed=3, samples_per_shard=8, num_buckets=4)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_KILL_WORKERS_ONCE)
    run_preprocess_cli(
        *common,
        "--output",
        str(tmp_path / "local"),
        "--num-cpus",
        "2",
        env={"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]), "KILL_ONCE_DIR": str(hook)},
    )
    for stage in ("scan", "sort", "write"):  # three workers died mid-task
        assert (hook / f"killed-{stage}").exists(), stage
    assert not [p.name for p in (tmp_path / "local").iterdir() if p.name.startswith(".shard-")]
    run_preprocess_cli(*common, "--output", str(tmp_path / "cluster"), "--address", ray_cluster)
    local, cluster = (json.loads((tmp_path / d / sf.MANIFEST_NAME).read_text()) for d in ("local", "cluster"))
    assert cluster["run"]["ray_address"] == ray_cluster
    assert stable_view(cluster) == stable_view(local)
    for name in [s["name"] for s in local["shards"]] + [sf.QUARANTINE_NAME]:
        assert (tmp_path / "cluster" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    nodes = cluster["run"]["task_nodes"]
    assert len(nodes) == 2 and all(n > 0 for n in nodes.values()), nodes  # tasks ran on both nodes
    assert sum(nodes.values()) >= 4 + len(local["shards"])  # at least every sort and write task
