"""`mmdata preprocess` end to end with real Ray and real energon: reconciliation, quarantine
reasons, byte-determinism across CPUs/buckets, seeded order, shard format, energon loading, and
the `--address` path against a Ray head the test starts on 127.0.0.1."""

from __future__ import annotations

import hashlib
from collections import Counter
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile

import pytest
from PIL import Image

from mmdata import shard_format as sf
from mmdata.shard_job.manifest import stable_view
from mmdata.dev.synth import BROKEN_KINDS, generate_records, write_infinity_mm, write_llava_json
from tests.fixtures_preprocess import (
    SYNTH_NUM_SAMPLES,
    free_port,
    read_shards,
    run_preprocess,
    run_preprocess_cli,
    start_ray_node,
)
from tests.energon_reading import energon_samples


N = 200
SEED = 7


def expected_media_rule(src) -> str | None:
    """How the job must find a synthetic record's images (synth writes exact member names,
    member basenames under a foreign folder, or foreign paths)."""
    entries = src.record.get("image")
    entries = [entries] if isinstance(entries, str) else entries or []
    if not entries:
        return None
    if entries == src.member_names:
        return "by_name"
    if [e.rsplit("/", 1)[-1] for e in entries] == src.member_names:
        return "by_basename"
    return "by_stem"


@pytest.fixture(scope="module")
def broken_raw(tmp_path_factory):
    raw = tmp_path_factory.mktemp("broken") / "raw"
    recs = generate_records(N, seed=SEED, broken_fraction=0.1, synthetic=True)
    write_infinity_mm(recs, raw, samples_per_tar=25)
    return raw, recs


@pytest.fixture(scope="module")
def run_a(broken_raw, tmp_path_factory):
    raw, _ = broken_raw
    out = tmp_path_factory.mktemp("run_a") / "out"
    proc = run_preprocess(raw, out, seed=7, samples_per_shard=40, num_cpus=2, num_buckets=3)
    return out, proc


def test_counts_reconcile_and_quarantine_reasons(broken_raw, run_a):
    _, recs = broken_raw
    out, proc = run_a
    assert proc.returncode == 0
    m = json.loads((out / sf.MANIFEST_NAME).read_text())
    c = m["counts"]
    expected_broken = {r.id: BROKEN_KINDS[r.broken] for r in recs if r.broken}
    assert len(expected_broken) == 20
    assert c["read"] == N and c["written"] == N - 20 and c["quarantined"] == 20
    assert c["read"] == c["written"] + c["quarantined"]
    for src in c["by_source"].values():
        assert src["read"] == src["written"] + src["quarantined"]
    assert sum(s["read"] for s in c["by_source"].values()) == N
    assert c["by_reason"] == {reason: 4 for reason in BROKEN_KINDS.values()}
    # foreign `image` paths resolve by stem, and the manifest counts each rule
    rules = Counter(expected_media_rule(r) for r in recs if not r.broken)
    assert c["media_resolution"] == {
        "by_name": rules["by_name"],
        "by_basename": rules["by_basename"],
        "by_stem": rules["by_stem"],
        "unreferenced_members": 0,
    }
    assert rules["by_stem"] > rules["by_name"] > 0 and rules["by_basename"] > 0
    assert any(len(r.member_names) > 1 and r.members_sorted for r in recs if not r.broken)  # name-ordered tars
    q = [json.loads(line) for line in (out / sf.QUARANTINE_NAME).read_text().splitlines()]
    assert len(q) == 20
    for line in q:
        assert set(line) >= {"id", "source_location", "reason", "detail"}
        assert ".tar:" in line["source_location"]
    # a malformed JSON has no readable id: it is named by its location instead
    by_loc = {line["source_location"].rsplit(":", 1)[1].split(".")[0]: line for line in q}
    for r in recs:
        if r.broken:
            assert by_loc[r.stem]["reason"] == BROKEN_KINDS[r.broken], (r.id, by_loc[r.stem])
    samples = read_shards(out)
    assert sorted(s[1]["id"] for s in samples) == sorted(r.id for r in recs if not r.broken)
    assert [len(s) for s in [samples[i : i + 40] for i in range(0, len(samples), 40)]] == [
        s["samples"] for s in m["shards"]
    ]


def test_manifest_describes_shards(run_a, broken_raw):
    out, _ = run_a
    m = json.loads((out / sf.MANIFEST_NAME).read_text())
    assert m["tool"] == "mmdata preprocess" and m["version"] and m["seed"] == SEED and m["samples_per_shard"] == 40
    assert len(m["inputs"]) == 8 and all({"path", "size", "mtime_ns"} <= set(i) for i in m["inputs"])
    names = sorted(p.name for p in out.glob("shard-*.tar"))
    assert names == [sf.SHARD_NAME_TEMPLATE.format(i) for i in range(5)] == [s["name"] for s in m["shards"]]
    for s in m["shards"]:
        data = (out / s["name"]).read_bytes()
        assert s["bytes"] == len(data) and s["sha256"] == hashlib.sha256(data).hexdigest()
    # the job's wall time covers Ray's start, every stage and the finish step, each timed on its own
    # and one after the other (each figure rounded to the millisecond)
    phases = m["run"]["phases"]
    assert {"scan_s", "sort_s", "write_s", "outputs_s", "finish_s"} <= set(phases) and phases["scan_s"] > 0, phases
    assert sum(phases.values()) <= m["wall_time_s"] + 0.001 * (len(phases) + 1), (phases, m["wall_time_s"])
    # the Ray tasks' own CPU per phase, measured in their workers; the scan (it decodes every image) the most
    cpu = m["run"]["task_cpu_s"]
    assert set(cpu) == {"scan_s", "sort_s", "write_s", "outputs_s"} and min(cpu.values()) > 0, cpu
    assert cpu["scan_s"] > cpu["sort_s"], cpu


def test_shard_format(run_a, broken_raw):
    out, _ = run_a
    _, recs = broken_raw
    by_id = {r.id: r for r in recs}
    samples = read_shards(out)
    for rank, (key, rec, members, infos) in enumerate(samples):
        assert key == f"{rank:010d}"
        for info in infos:
            assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (
                sf.TAR_MTIME,
                sf.TAR_UID,
                sf.TAR_GID,
                sf.TAR_UNAME,
                sf.TAR_GNAME,
                sf.TAR_MODE,
            )
        src = by_id[rec["id"]]
        assert rec["images"] == [n for n in members if n != sf.JSON_MEMBER]
        # original bytes, never re-encoded, in placeholder order
        assert [members[n] for n in rec["images"]] == [im.data for im in src.images]
        n_ph = sum(t["value"].count(sf.IMAGE_PLACEHOLDER) for t in rec["conversations"])
        assert n_ph == len(rec["images"])
        if src.images and sf.IMAGE_PLACEHOLDER not in src.record["conversations"][0]["value"]:
            assert rec["conversations"][0]["value"].startswith(sf.IMAGE_PLACEHOLDER)  # inserted like LLaVA
        for name in rec["images"]:
            fmt = Image.open(io.BytesIO(members[name])).format
            assert name.endswith({"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp"}[fmt])
        assert rec["source"] == src.record["source"] and rec["meta"].get("phash") == src.record.get("phash")
        assert rec["provenance"]["file"].endswith(".tar") and rec["provenance"]["member"] == f"{src.stem}.json"
        # the `image` field as the source wrote it (a foreign path, mostly), kept as provenance
        assert rec["provenance"].get("source_image") == src.record.get("image")
        assert rec["provenance"].get("media_resolution") == expected_media_rule(src)
    assert any(not rec["images"] for _, rec, _, _ in samples)  # text-only samples are shard members too


def test_same_seed_identical_whatever_cpus_and_buckets(broken_raw, run_a, tmp_path):
    raw, _ = broken_raw
    out_a, _ = run_a
    out_b = tmp_path / "b"
    run_preprocess(raw, out_b, seed=7, samples_per_shard=40, num_cpus=1, num_buckets=1)
    ma, mb = (json.loads((o / sf.MANIFEST_NAME).read_text()) for o in (out_a, out_b))
    assert [s["sha256"] for s in ma["shards"]] == [s["sha256"] for s in mb["shards"]]
    assert stable_view(ma) == stable_view(mb)
    assert (out_a / sf.QUARANTINE_NAME).read_bytes() == (out_b / sf.QUARANTINE_NAME).read_bytes()
    # different seed: same records, different order
    out_c = tmp_path / "c"
    run_preprocess(raw, out_c, seed=8, samples_per_shard=40, num_cpus=2)
    ids_a = [s[1]["id"] for s in read_shards(out_a)]
    ids_c = [s[1]["id"] for s in read_shards(out_c)]
    assert sorted(ids_a) == sorted(ids_c) and ids_a != ids_c


def test_output_order_uncorrelated_with_input_order(run_a):
    from scipy.stats import spearmanr

    out, _ = run_a
    ids = [s[1]["id"] for s in read_shards(out)]
    input_pos = [int(i.rsplit("-", 1)[1]) for i in ids]  # synth index = input order
    rho = spearmanr(range(len(ids)), input_pos).statistic
    assert abs(rho) < 0.2, rho


def test_refuses_other_job_dir_unless_overwrite(broken_raw, run_a, tmp_path):
    raw, _ = broken_raw
    out = tmp_path / "o"
    shutil.copytree(run_a[0], out)
    proc = run_preprocess(raw, out, seed=9, samples_per_shard=40, check=False)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and "Traceback" not in proc.stderr
    assert "(changed: seed 7 → 9)" in proc.stderr  # the refusal names the option that changed
    # same inputs + seed: recognised as complete, nothing rewritten; the copy's own path is printed
    proc = run_preprocess(raw, out, seed=7, samples_per_shard=40, check=False)
    assert proc.returncode == 0 and "already complete" in proc.stderr
    assert proc.stdout.startswith(f"{out.resolve()}: 180 samples in 5 shards") and str(run_a[0]) not in proc.stdout


def test_energon_yields_every_valid_sample_once(shards_dir, synth_raw_dir):
    from mmdata.energon_loaders.sample import ConversationSample

    seen = []
    for s in energon_samples(shards_dir, "mmdata.yaml"):
        assert isinstance(s, ConversationSample)
        assert len(s.images) == len(s.image_names)
        for data in s.images:
            Image.open(io.BytesIO(data)).load()
        seen.append(s.id)
    assert len(seen) == SYNTH_NUM_SAMPLES and len(set(seen)) == SYNTH_NUM_SAMPLES
    m = json.loads((shards_dir / sf.MANIFEST_NAME).read_text())
    assert m["counts"]["written"] == SYNTH_NUM_SAMPLES


def test_energon_info_cli(shards_dir):
    """energon's default config names its own InterleavedSample, `mmdata.yaml` our type."""
    for args, sample_type in (([], "InterleavedSample"), (["--dataset-config", "mmdata.yaml"], "ConversationSample")):
        proc = subprocess.run(
            [sys.executable, "-m", "megatron.energon.cli.main", "info", *args, str(shards_dir)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        assert sample_type in proc.stdout and f"{SYNTH_NUM_SAMPLES} samples" in proc.stdout, proc.stdout


def test_llava_json_dataset_with_videos(tmp_path):
    raw = tmp_path / "llava"
    recs = generate_records(30, seed=2, broken_fraction=0.2, video_fraction=0.3, synthetic=True)
    videos = {r.id: r.video for r in recs if r.video is not None}
    assert videos
    write_llava_json(recs, raw)
    out = tmp_path / "out"
    run_preprocess(raw / "annotations.jsonl", out, dataset="llava-json", samples_per_shard=10, num_cpus=1)
    m = json.loads((out / sf.MANIFEST_NAME).read_text())
    assert m["counts"]["quarantined"] == 6 and m["counts"]["written"] == 24
    expected: dict[str, int] = {}
    for r in recs:
        if r.broken:
            expected[BROKEN_KINDS[r.broken]] = expected.get(BROKEN_KINDS[r.broken], 0) + 1
    assert m["counts"]["by_reason"] == dict(sorted(expected.items()))
    samples = read_shards(out)
    assert sorted(s[1]["id"] for s in samples) == sorted(r.id for r in recs if not r.broken)
    for _, rec, members, _ in samples:
        if rec["id"] in videos:
            assert rec["video"] == "video.mp4" and members["video.mp4"] == videos[rec["id"]]
            assert sum(t["value"].count(sf.VIDEO_PLACEHOLDER) for t in rec["conversations"]) == 1
            assert rec["images"] == [] and rec["meta"]["video_size_frames"][2] >= 4
        else:
            assert rec["video"] is None and "video.mp4" not in members


def test_fail_fast_on_systematic_loss_then_rerun_relaxed(tmp_path):
    """Tars whose image members are elsewhere: most records would be image_missing. The job stops
    naming the reason, the count and 3 examples, leaves no manifest or shard, and a rerun with
    the check relaxed continues from the files already scanned."""
    raw = tmp_path / "raw"
    recs = generate_records(40, seed=4, synthetic=True)
    write_infinity_mm(recs, raw, samples_per_tar=10)
    for path in raw.rglob("*.tar"):
        with tarfile.open(path) as tar:
            kept = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.name.endswith(".json")]
        with tarfile.open(path, "w") as tar:
            for m, data in kept:
                tar.addfile(m, io.BytesIO(data))
    n_image = sum(1 for r in recs if r.images)
    args = ["--dataset", "infinity-mm", "--input", str(raw), "--output", str(tmp_path / "out"), "--num-cpus", "2"]
    proc = run_preprocess_cli(*args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{n_image} of the first 40 records" in proc.stderr and "image_missing" in proc.stderr
    assert sum(r.id in proc.stderr for r in recs) == 3  # three examples, with their details
    assert "--max-quarantine-fraction 1.0" in proc.stderr
    assert not (tmp_path / "out" / sf.MANIFEST_NAME).exists() and not list((tmp_path / "out").glob("shard-*"))
    run_preprocess_cli(*args, "--max-quarantine-fraction", "1.0")
    m = json.loads((tmp_path / "out" / sf.MANIFEST_NAME).read_text())
    assert m["counts"]["by_reason"] == {"image_missing": n_image} and m["counts"]["written"] == 40 - n_image
    assert m["run"]["resumed"]["scan"] == 4  # the stopped job's scans were kept


def test_help_and_bad_input(tmp_path):
    proc = run_preprocess(tmp_path / "nope", tmp_path / "o", check=False)
    assert proc.returncode == 2 and "nope" in proc.stderr


@pytest.fixture
def ray_head():
    """A one-CPU Ray head on 127.0.0.1, in its own process group (stopped by group id)."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="/tmp/mmray")
    proc = start_ray_node(
        "--head",
        f"--port={port}",
        "--num-cpus=1",
        "--include-dashboard=false",
        f"--temp-dir={temp_dir}",
    )
    yield f"127.0.0.1:{port}"
    os.killpg(proc.pid, signal.SIGKILL)  # the group we started: ray start and everything it spawned
    proc.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_address_runs_on_existing_cluster(ray_head, broken_raw, run_a, tmp_path):
    raw, _ = broken_raw
    out = tmp_path / "cluster"
    run_preprocess(raw, out, seed=7, samples_per_shard=40, address=ray_head)
    m_c, m_a = (json.loads((d / sf.MANIFEST_NAME).read_text()) for d in (out, run_a[0]))
    assert m_c["run"]["ray_address"] == ray_head
    assert stable_view(m_c) == stable_view(m_a)  # same bytes as the local 2-CPU, 3-bucket run
