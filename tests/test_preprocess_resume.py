"""Resumability: a driver SIGKILLed mid-way (during scan, sort, shard writing, then the index) and rerun
gives the same manifest and shards as an uninterrupted run, curation stages (dedup, an
up-sampling mix with its merge stage) included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mmdata import shard_format as sf
from mmdata.shard_job.manifest import stable_view
from mmdata.dev.synth import generate_records, write_infinity_mm
from tests.cli_runs import flags
from tests.fixtures_preprocess import run_preprocess_cli


# A driver that SIGKILLs itself at a fixed point of a stage whose progress a test cannot poll in
# time: "sort" (the first sort-bucket result handled, other buckets unsorted), "index" (energon's
# index built in its temporary folder but not published; quarantine.jsonl and lengths.parquet
# already out).
_SIGKILL_AT = """
import os, signal, sys
point = sys.argv.pop(1)
import mmdata.preprocess.job as job
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if point == "sort":
    real_sorted = job.PreprocessJob._sorted
    def sorted_then_die(self, bucket, result):
        real_sorted(self, bucket, result)
        die()
    job.PreprocessJob._sorted = sorted_then_die
elif point == "index":
    def publish(*args):  # energon's index built in its temporary folder (by a task), not published yet
        die()
    job.publish_index = publish
from mmdata.preprocess.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _start_and_kill(args: list[str], ready=None, point: str | None = None) -> None:
    """Run the CLI and SIGKILL the driver: as soon as `ready()` holds (polled), or at `point`
    (see _SIGKILL_AT); reap it."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-c", _SIGKILL_AT, point or "-", "--no-progress", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    if ready is not None:
        while proc.poll() is None and not ready():
            time.sleep(0.02)
        assert proc.poll() is None, "job finished before it could be killed: make the test input bigger"
        proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, point


@pytest.mark.slow
def test_killed_driver_rerun_gives_same_output(tmp_path):
    raw = tmp_path / "raw"
    write_infinity_mm(generate_records(400, seed=11, broken_fraction=0.05, synthetic=True), raw, samples_per_tar=25)
    mix = tmp_path / "mix.yaml"
    mix.write_text("weights: {laion_caption: 2, '*': 1}\nrepeat: true\n")
    common = flags(dataset="infinity-mm", input=raw, seed=3, samples_per_shard=8, num_cpus=1, dedup="phash:2", mix=mix)
    ref = tmp_path / "ref"
    run_preprocess_cli(*common, "--output", str(ref))
    out = tmp_path / "out"
    work = out / ".mmdata-work"
    args = [*common, "--output", str(out)]
    markers = lambda folder, pattern: len(list((work / folder).glob(pattern)))  # noqa: E731
    # kill 1: while scanning (polled)
    _start_and_kill(args, ready=lambda: markers("scan", "*.done.json") >= 1)
    assert not (out / sf.MANIFEST_NAME).exists()
    # kill 2: in the sort stage, once the first bucket is sorted
    _start_and_kill(args, point="sort")
    assert (
        1 <= markers("sorted", "*.done.json") < 8 and not (out / sf.MANIFEST_NAME).exists()
    )  # (8 buckets: small input)
    # kill 3: while writing shards, once 3 shards have their done-marker <shard>.tar.json (written after
    # <shard>.tar.index.sqlite, so a bare pattern would count a shard whose marker is not there yet)
    _start_and_kill(args, ready=lambda: markers("shards", "*.tar.json") >= 3)
    assert not (out / sf.MANIFEST_NAME).exists()
    # kill 4: in the finish step, energon's index built but not yet published
    _start_and_kill(args, point="index")
    assert list(out.glob(".nv-meta.tmp-*")) and not (out / ".nv-meta").exists()
    assert (out / sf.QUARANTINE_NAME).exists() and not (out / sf.MANIFEST_NAME).exists()
    run_preprocess_cli(*common, "--output", str(out))
    m_ref, m_out = (json.loads((d / sf.MANIFEST_NAME).read_text()) for d in (ref, out))
    assert stable_view(m_out) == stable_view(m_ref)
    resumed = m_out["run"]["resumed"]  # the last run redid nothing but the finish step
    assert (resumed["scan"], resumed["sort"], resumed["shards"]) == (len(m_ref["inputs"]), 8, len(m_ref["shards"]))
    for s in m_ref["shards"]:
        assert (out / s["name"]).read_bytes() == (ref / s["name"]).read_bytes()
    for name in (sf.QUARANTINE_NAME, "duplicates.jsonl", "lengths.parquet"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()
    for meta in (ref / ".nv-meta").iterdir():
        if meta.name != "index.uuid":  # a fresh random id per preparation, as energon's own
            assert (out / ".nv-meta" / meta.name).read_bytes() == meta.read_bytes(), meta.name
    assert m_ref["counts"]["repeated"] > 0
    assert not work.exists() and not list(out.glob(".shard-*"))


# A driver whose Ctrl-C lands at a fixed point: inside `ray.init` (held back until Ray is up), or
# in the finish step while `.nv-meta` is being published (the manifest not yet).
_SIGINT_AT = """
import os, signal, sys, time
point = sys.argv.pop(1)
if point == "ray_init":
    import ray
    real_init = ray.init
    def init(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real_init(*args, **kwargs)
    ray.init = init
elif point == "finish":
    import mmdata.preprocess.job as job
    real_publish = job.publish_index
    def publish(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        return real_publish(*args, **kwargs)
    job.publish_index = publish
from mmdata.preprocess.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _interrupted_run(args: list[str], point: str | None = None, ready=None) -> subprocess.CompletedProcess:
    """Run the CLI; SIGINT it at `point` (see _SIGINT_AT), or send SIGINT to its whole process
    group (a terminal's Ctrl-C: Ray's processes get it too) as soon as `ready()` holds."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-c", _SIGINT_AT, point or "-", "--no-progress", *args]
    # (a test run in the background inherits an ignored SIGINT: the job gets Python's default back)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    if ready is not None:
        while proc.poll() is None and not ready():
            time.sleep(0.02)
        assert proc.poll() is None, "job finished before it could be interrupted: make the test input bigger"
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
def test_sigint_at_three_points_then_rerun_gives_identical_output(tmp_path):
    """Ctrl-C inside ray.init, while shards are written and in the finish step: each time exit 130
    with "interrupted: rerun the same command to resume" (no traceback, no crash), no manifest,
    and the half-finished folder is refused by inspect and the loaders; the rerun then gives
    byte-identical output."""
    from mmdata.energon_loaders.loader import build_loader
    from mmdata.readiness import DatasetNotReady

    raw = tmp_path / "raw"
    write_infinity_mm(generate_records(240, seed=5, broken_fraction=0.05, synthetic=True), raw, samples_per_tar=20)
    common = flags(dataset="infinity-mm", input=raw, seed=1, samples_per_shard=6, num_cpus=1)
    ref = tmp_path / "ref"
    run_preprocess_cli(*common, "--output", str(ref))
    out = tmp_path / "out"
    args = [*common, "--output", str(out)]
    shard_markers = lambda: len(list((out / ".mmdata-work" / "shards").glob("*.tar.json")))  # noqa: E731
    for point, ready in (("ray_init", None), (None, lambda: shard_markers() >= 2), ("finish", None)):
        proc = _interrupted_run(args, point, ready)
        where = point or "writing shards"
        assert proc.returncode == 130, (where, proc.returncode, proc.stderr[-3000:])
        assert proc.stderr.strip().splitlines()[-1] == "interrupted: rerun the same command to resume", where
        assert "Traceback" not in proc.stderr and "Segmentation" not in proc.stderr, (where, proc.stderr[-3000:])
        assert not (out / sf.MANIFEST_NAME).exists() and (out / ".mmdata-work").is_dir(), where
        inspect = subprocess.run(
            [sys.executable, "-m", "mmdata.cli", "inspect", str(out)], capture_output=True, text=True
        )
        assert inspect.returncode == 2 and "unfinished `mmdata preprocess` job" in inspect.stderr, where
        with pytest.raises(DatasetNotReady, match="rerun the same command"):
            build_loader(out, task_encoder=None, micro_batch_size=1)
    run_preprocess_cli(*args)
    m_ref, m_out = (json.loads((d / sf.MANIFEST_NAME).read_text()) for d in (ref, out))
    assert stable_view(m_out) == stable_view(m_ref)
    names = [s["name"] for s in m_ref["shards"]]
    assert len(names) >= 4 and m_out["run"]["resumed"]["scan"] == len(m_ref["inputs"])
    for name in names + [f"{n}.idx" for n in names] + [sf.QUARANTINE_NAME, "lengths.parquet"]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    for meta in (ref / ".nv-meta").iterdir():
        if meta.name != "index.uuid":  # a fresh random id per preparation, as energon's own
            assert (out / ".nv-meta" / meta.name).read_bytes() == meta.read_bytes(), meta.name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
