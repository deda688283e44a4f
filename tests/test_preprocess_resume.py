"""Resumability: a driver SIGKILLed mid-way (during scan, then during shard writing) and rerun
gives the same manifest and shards as an uninterrupted run, curation stages (dedup, an
up-sampling mix with its merge stage) included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmdata import shard_format as sf
from mmdata.preprocess.manifest import stable_view
from mmdata.preprocess.synth import generate_records, write_infinity_mm
from tests.conftest import run_preprocess_cli



def _start_and_kill_when(args: list[str], ready) -> None:
    """Start the CLI, SIGKILL the driver as soon as `ready()` holds (polled), reap it."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "mmdata.preprocess.cli", "--no-progress", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    while proc.poll() is None and not ready():
        time.sleep(0.02)
    assert proc.poll() is None, "job finished before it could be killed: make the test input bigger"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_killed_driver_rerun_gives_same_output(tmp_path):
    raw = tmp_path / "raw"
    write_infinity_mm(generate_records(400, seed=11, broken_fraction=0.05), raw, samples_per_tar=25)
    mix = tmp_path / "mix.yaml"
    mix.write_text("weights: {laion_caption: 2, '*': 1}\nrepeat: true\n")
    common = ["--dataset", "infinity-mm", "--input", str(raw), "--seed", "3", "--samples-per-shard", "8",
              "--num-cpus", "1", "--dedup", "phash:2", "--mix", str(mix)]
    ref = tmp_path / "ref"
    run_preprocess_cli(*common, "--output", str(ref))
    out = tmp_path / "out"
    work = out / ".mmdata-work"
    # kill 1: while scanning
    _start_and_kill_when([*common, "--output", str(out)], lambda: len(list((work / "scan").glob("*.done.json"))) >= 1)
    assert not (out / sf.MANIFEST_NAME).exists()
    # kill 2: while writing shards, once 3 shards have their done-marker <shard>.tar.json (written after
    # <shard>.tar.layout.json, so a bare *.json would count a layout whose marker is not there yet)
    _start_and_kill_when([*common, "--output", str(out)], lambda: len(list((work / "shards").glob("*.tar.json"))) >= 3)
    assert not (out / sf.MANIFEST_NAME).exists()
    run_preprocess_cli(*common, "--output", str(out))
    m_ref, m_out = (json.loads((d / sf.MANIFEST_NAME).read_text()) for d in (ref, out))
    assert stable_view(m_out) == stable_view(m_ref)
    assert m_out["run"]["resumed"]["shards"] >= 3 and m_out["run"]["resumed"]["scan"] >= 1
    for s in m_ref["shards"]:
        assert (out / s["name"]).read_bytes() == (ref / s["name"]).read_bytes()
    for name in (sf.QUARANTINE_NAME, "duplicates.jsonl", "lengths.parquet"):
        assert (out / name).read_bytes() == (ref / name).read_bytes()
    assert m_ref["counts"]["repeated"] > 0
    assert not work.exists() and not list(out.glob(".shard-*"))
