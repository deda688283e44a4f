"""Curation in the real Ray job: near-duplicate removal (exact at D=0, edited copies at D=4,
scope record vs image, survivor independent of input order and worker count), filters and the
source mix (counts reconcile, repeats), all byte-reproducible."""

from __future__ import annotations

import copy
import hashlib
import io
import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image, ImageEnhance

from mmdata import shard_format as sf
from mmdata.preprocess.curation.phash import hamming, phash_bytes
from mmdata.shard_job.manifest import stable_view
from mmdata.dev.synth import SynthImage, SynthRecord, generate_records, write_infinity_mm
from tests.fixtures_preprocess import run_preprocess
from tests.fixtures_preprocess import read_shards


def _copy(rec: SynthRecord, n: int, *, answer: str | None = None, image: SynthImage | None = None) -> SynthRecord:
    """Another record of the same image(s): new id and stem; optionally another answer, or an
    edited image (then without a `phash` field, so the job computes it)."""
    r = copy.deepcopy(rec.record)
    r["id"] = f"{rec.id}-copy{n}"
    if answer is not None:
        r["conversations"][-1]["value"] = answer
    images = rec.images
    if image is not None:
        images = [image]
        del r["phash"]
    stem = f"c{n:07d}"
    names = [f"{stem}.{im.name_ext}" for im in images]
    return SynthRecord(
        1000 + n, "stage9", "copies", stem, r, images, json_bytes=json.dumps(r).encode(), member_names=names
    )


def _edited(im: SynthImage) -> SynthImage:
    """The image re-encoded at another quality and slightly brightened: a near, not exact, copy."""
    img = ImageEnhance.Brightness(Image.open(io.BytesIO(im.data)).convert("RGB")).enhance(1.04)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=70)
    return SynthImage("jpg", buf.getvalue())


@pytest.fixture(scope="module")
def dup_data(tmp_path_factory):
    """60 records plus: 6 exact copies (same text), 4 copies with another answer, and edited
    near-copies whose hash is 1-4 bits away. Also the same records in another input order."""
    recs = generate_records(60, seed=21, synthetic=True)
    single = [r for r in recs if len(r.images) == 1]
    exact = [_copy(r, i) for i, r in enumerate(single[:6])]
    other_text = [_copy(r, 10 + i, answer="Something else entirely.") for i, r in enumerate(single[6:10])]
    near = []
    for i, r in enumerate(single[10:]):
        edited = _edited(r.images[0])
        d = hamming(phash_bytes(edited.data), r.record["phash"][0])
        if 1 <= d <= 4:
            near.append(_copy(r, 20 + i, image=edited))
    assert len(near) >= 3
    root = tmp_path_factory.mktemp("dups")
    everything = recs + exact + other_text + near
    write_infinity_mm(everything, root / "raw", samples_per_tar=20)
    write_infinity_mm(everything[::-1], root / "reordered", samples_per_tar=13)
    return root, recs, {"exact": exact, "other_text": other_text, "near": near}


def _pairs(out: Path) -> set[frozenset]:
    lines = [json.loads(x) for x in (out / "duplicates.jsonl").read_text().splitlines()]
    return {frozenset((d["id"], d["duplicate_of"])) for d in lines}


def _expected_pairs(copies: list[SynthRecord]) -> set[frozenset]:
    return {frozenset((c.id, c.id.rsplit("-copy", 1)[0])) for c in copies}


def _written_ids(out: Path) -> Counter:
    return Counter(rec["id"] for _, rec, _, _ in read_shards(out))


@pytest.fixture(scope="module")
def exact_run(dup_data, tmp_path_factory):
    root, _, _ = dup_data
    out = tmp_path_factory.mktemp("exact") / "out"
    run_preprocess(root / "raw", out, seed=3, num_cpus=2, dedup="phash")
    return out


def test_dedup_exact_at_d0(dup_data, exact_run):
    _, recs, copies = dup_data
    m = json.loads((exact_run / sf.MANIFEST_NAME).read_text())
    c = m["counts"]
    # only the exact copies with the same conversation: one of each pair is dropped
    assert _pairs(exact_run) == _expected_pairs(copies["exact"]) and c["duplicates"] == len(copies["exact"])
    ids = _written_ids(exact_run)
    for pair in _expected_pairs(copies["exact"]):
        assert sum(ids[i] for i in pair) == 1
    assert all(ids[c.id] == 1 for c in copies["other_text"] + copies["near"])
    assert c["read"] == c["written"] + c["quarantined"] + c["duplicates"] and c["written"] == sum(ids.values())
    dedup = m["curation"]["dedup"]
    assert (
        dedup["distance"] == 0
        and dedup["scope"] == "record"
        and dedup["phash_images"]["computed"] == len(copies["near"])
    )
    for line in (exact_run / "duplicates.jsonl").read_text().splitlines():
        d = json.loads(line)
        assert d["distance"] == 0 and ".tar:" in d["source_location"] and ".tar:" in d["duplicate_of_location"]


def test_dedup_survivor_independent_of_input_order_and_workers(dup_data, exact_run, tmp_path):
    root, _, _ = dup_data
    out = tmp_path / "reordered"
    run_preprocess(root / "reordered", out, seed=3, num_cpus=1, num_buckets=3, dedup="phash")
    assert _written_ids(out) == _written_ids(exact_run)
    assert _pairs(out) == _pairs(exact_run)
    dropped = {json.loads(x)["id"] for x in (out / "duplicates.jsonl").read_text().splitlines()}
    assert dropped == {json.loads(x)["id"] for x in (exact_run / "duplicates.jsonl").read_text().splitlines()}


def test_dedup_near_copies_at_d4_and_image_scope(dup_data, tmp_path):
    root, _, copies = dup_data
    out = tmp_path / "near"
    run_preprocess(root / "raw", out, seed=3, num_cpus=2, dedup="phash:4", dedup_scope="image")
    want = _expected_pairs(copies["exact"] + copies["other_text"] + copies["near"])
    assert _pairs(out) == want
    lines = [json.loads(x) for x in (out / "duplicates.jsonl").read_text().splitlines()]
    near_ids = {c.id for c in copies["near"]} | {c.id.rsplit("-copy", 1)[0] for c in copies["near"]}
    assert all(1 <= d["distance"] <= 4 for d in lines if d["id"] in near_ids) and all(
        d["scope"] == "image" for d in lines
    )
    assert json.loads((out / sf.MANIFEST_NAME).read_text())["curation"]["dedup"]["bands"] == 15


def _expected_filtered(recs: list[SynthRecord]) -> dict[str, int]:
    got = Counter()
    for r in recs:
        if r.broken:
            continue
        if r.record["qw2vl_loss"] > 2.7:
            got["qw2vl_loss<=2.7"] += 1
        elif len(r.record["conversations"]) > 6:
            got["turns<=6"] += 1
    return dict(sorted(got.items()))


def test_filters_and_mix_reconcile_and_reproduce(dup_data, tmp_path):
    """Filters, dedup and an up-sampling mix in one job: every record is accounted for, the
    realised mix is what the shards hold (repeats included), and another worker count and
    bucket count give byte-identical output."""
    root, recs, copies = dup_data
    mix = tmp_path / "mix.yaml"
    # laion_caption is repeated up to its share, the other sources are down-sampled
    mix.write_text("by: source\nweights: {laion_caption: 4, 2a: 1, '*': 0.5}\ntotal: 60\nrepeat: true\n")
    options = dict(seed=5, dedup="phash", filter=["qw2vl_loss<=2.7", "turns<=6"], mix=mix)
    a, b = tmp_path / "a", tmp_path / "b"
    run_preprocess(root / "raw", a, num_cpus=2, **options)
    run_preprocess(root / "raw", b, num_cpus=1, num_buckets=5, **options)
    m = json.loads((a / sf.MANIFEST_NAME).read_text())
    c = m["counts"]
    assert c["by_filter"] == _expected_filtered(recs + copies["exact"] + copies["other_text"] + copies["near"])
    for x in [c, *c["by_source"].values()]:
        assert (
            x["read"]
            == x["written"] + x["quarantined"] + x["filtered"] + x["duplicates"] + x["mixed_out"] - x["repeated"]
        )
    assert c["repeated"] > 0 and c["mixed_out"] > 0 and c["duplicates"] > 0
    samples = read_shards(a)
    assert len(samples) == c["written"]
    by_source = Counter(rec["source"] for _, rec, _, _ in samples)
    mixed = m["curation"]["mix"]
    assert mixed["realised"] == {g: by_source[g] for g in mixed["target"]}
    assert mixed["target"] == {"2a": 10, "gpt4_synthetic": 5, "laion_caption": 40, "llava_onevision": 5}
    assert max(_written_ids(a).values()) > 1  # repeated records, each copy its own sample
    for name in [s["name"] for s in m["shards"]] + ["duplicates.jsonl", "quarantine.jsonl", "lengths.parquet"]:
        assert hashlib.sha256((a / name).read_bytes()).digest() == hashlib.sha256((b / name).read_bytes()).digest(), (
            name
        )
    assert stable_view(m) == stable_view(json.loads((b / sf.MANIFEST_NAME).read_text()))


def test_malformed_curation_flags_rejected_before_any_work(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for flags, why in [
        (["--filter", "qw2vl_loss<=two"], "is a number"),
        (["--dedup", "phash:99"], "0..8"),
        (["--mix", str(tmp_path / "none.yaml")], "none.yaml"),
        (["--mix", "a:1"], "source=weight"),
        (["--filter", "sourse==a"], "did you mean 'source'"),
    ]:
        proc = run_preprocess(raw, tmp_path / "o", *flags, check=False)
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "o").exists()


SYNTH_SOURCES = ("2a", "gpt4_synthetic", "laion_caption", "llava_onevision")
SYNTH_SUBSETS = ("stage1/laion_caption", "stage2/2a", "stage3/llava_onevision", "stage4/gpt4_synthetic")


def _error_line(stderr: str, term: str) -> str:
    """The one line of the error naming `term` (Ray may log other lines to stderr)."""
    lines = [x for x in stderr.splitlines() if repr(term) in x]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize(
    "flags, bad, known, close",
    [
        (["--mix", "laion=1,2a=2"], "laion", SYNTH_SOURCES, "laion_caption"),
        (["--filter", "source in [laion_caption, gpt4]"], "gpt4", SYNTH_SOURCES, "gpt4_synthetic"),
        (["--mix", "subset.yaml"], "stage2/2b", SYNTH_SUBSETS, "stage2/2a"),
    ],
    ids=["mix-source", "filter-source", "mix-subset"],
)
def test_term_matching_no_source_is_exit_2_and_writes_nothing(synth_raw_dir, tmp_path, flags, bad, known, close):
    """A --mix or --filter term naming no source (or subset) of the input would silently mix or
    filter out records (`laion` for `laion_caption` dropped 428 of 600): exit 2, one line naming
    the term and listing what the input has, and nothing under --output."""
    (tmp_path / "subset.yaml").write_text("by: subset\nweights: {stage1/laion_caption: 1, stage2/2b: 1}\n")
    flags = [str(tmp_path / f) if f.endswith(".yaml") else f for f in flags]
    out = tmp_path / "out"
    proc = run_preprocess(synth_raw_dir, out, *flags, num_cpus=2, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    line = _error_line(proc.stderr, bad)
    assert all(k in line for k in known), line
    assert f"did you mean {close!r}" in line, line
    assert not out.exists(), sorted(out.rglob("*"))  # no shards, no work folder: the run left nothing


def test_valid_inline_mix_still_mixes_by_source(synth_raw_dir, tmp_path):
    """The check leaves a valid mix alone: only the named sources, in their 1:2 proportion."""
    out = tmp_path / "out"
    run_preprocess(synth_raw_dir, out, num_cpus=2, mix="laion_caption=1,2a=2")
    m = json.loads((out / sf.MANIFEST_NAME).read_text())
    by_source = Counter(rec["source"] for _, rec, _, _ in read_shards(out))
    assert set(by_source) == {"laion_caption", "2a"}
    mix = m["curation"]["mix"]
    assert set(mix["target"]) == set(SYNTH_SOURCES)
    assert mix["target"]["2a"] == 2 * mix["target"]["laion_caption"] > 0
    assert mix["realised"] == {g: by_source[g] for g in mix["target"]}
    assert m["counts"]["mixed_out"] > 0
