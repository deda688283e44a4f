"""`mmdata synth`: real Infinity-MM layout, the variety the issue asks for, opt-in broken
records, byte-determinism, and the llava-json layout."""

from __future__ import annotations

import hashlib
from collections import Counter
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from mmdata.dev.synth import (
    BROKEN_KINDS,
    PRODUCER_ROOT,
    generate_records,
    write_infinity_mm,
    write_llava_json,
)


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth_varied") / "raw"
    recs = generate_records(300, seed=1, broken_fraction=0.05, synthetic=True)
    files = write_infinity_mm(recs, out, samples_per_tar=40)
    return out, recs, files


def test_layout_is_infinity_mm(varied):
    out, recs, files = varied
    assert files and all(f.suffix == ".tar" for f in files)
    for f in files:
        rel = f.relative_to(out).parts
        assert len(rel) == 3 and rel[0].startswith("stage") and rel[0][5:].isdigit()
    n_json = 0
    for f in files:
        with tarfile.open(f) as tar:
            names = tar.getnames()
        stems = {n.split(".")[0] for n in names}
        for stem in stems:
            assert f"{stem}.json" in names  # each sample is a {stem}.json + {stem}.<ext> group
        n_json += sum(n.endswith(".json") for n in names)
    assert n_json == len(recs)
    good = next(r for r in recs if not r.broken and r.images)
    for field in ("id", "source", "conversations", "image", "ram++_tags", "ram++_tags_score", "phash", "qw2vl_loss"):
        assert field in good.record


def test_records_are_varied(varied):
    _, recs, _ = varied
    sizes, formats, modes = set(), set(), set()
    for r in recs:
        if r.broken:
            continue
        for im in r.images:
            img = Image.open(io.BytesIO(im.data))
            sizes.add(img.size)
            formats.add(img.format)
            modes.add(img.mode)
    assert min(w for w, h in sizes) <= 32 and max(max(w, h) for w, h in sizes) > 2000
    assert any(w / h >= 8 for w, h in sizes) and any(h / w >= 8 for w, h in sizes)
    assert formats == {"JPEG", "PNG", "WEBP"}
    assert {"L", "RGBA", "P", "RGB"} <= modes
    good = [r for r in recs if not r.broken]
    assert any(len(r.images) >= 2 for r in good)  # multi-image
    assert any(not r.images for r in good)  # text-only
    assert any(len(r.record["conversations"]) > 2 for r in good)  # multi-turn
    with_img = [r for r in good if r.images]
    assert any("<image>" not in r.record["conversations"][0]["value"] for r in with_img)
    assert any("<image>" in r.record["conversations"][0]["value"] for r in with_img)
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in r.record["conversations"][0]["value"]) for r in good)


def test_broken_fraction_covers_every_kind(varied):
    _, recs, _ = varied
    broken = [r.broken for r in recs if r.broken]
    assert len(broken) == 15
    assert set(broken) == set(BROKEN_KINDS)
    assert generate_records(50, seed=0, broken_fraction=0.0, synthetic=True) and not any(
        r.broken for r in generate_records(50, seed=0, synthetic=True)
    )


def test_image_field_is_provenance_like_the_published_tars(varied):
    """By default `image` is mostly a foreign absolute path whose basename and extension differ
    from the member; some records use the member's basename or its exact name. `phash` is a list
    of 64-bit integers, one per image."""
    _, recs, _ = varied
    styles = Counter()
    for r in recs:
        entries = r.record.get("image")
        if r.video is not None or entries is None:
            assert not r.member_names and "phash" not in r.record
            continue
        entries = [entries] if isinstance(entries, str) else entries
        assert len(entries) == len(r.member_names) == len(r.images) == len(r.record["phash"])
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in r.record["phash"])
        bases = [e.rsplit("/", 1)[-1] for e in entries]
        style = "exact" if entries == r.member_names else "basename" if bases == r.member_names else "foreign"
        styles[style] += 1
        assert style == "exact" or all(e.startswith(PRODUCER_ROOT) for e in entries)
    assert styles["foreign"] > styles["exact"] + styles["basename"] and styles["exact"] and styles["basename"]
    names = [n for r in recs for n in r.member_names]
    assert any(n.endswith((".jpeg", ".JPG")) for n in names) and any(".1." in n for n in names)
    member_only = generate_records(40, seed=1, image_field="member", synthetic=True)
    assert all(
        r.record.get("image") in (None, r.member_names[0] if len(r.member_names) == 1 else r.member_names)
        for r in member_only
    )


def test_byte_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_infinity_mm(generate_records(40, seed=3, broken_fraction=0.1, synthetic=True), a, samples_per_tar=10)
    write_infinity_mm(generate_records(40, seed=3, broken_fraction=0.1, synthetic=True), b, samples_per_tar=10)
    assert _tree_digest(a) == _tree_digest(b)
    c = tmp_path / "c"
    write_infinity_mm(generate_records(40, seed=4, broken_fraction=0.1, synthetic=True), c, samples_per_tar=10)
    assert _tree_digest(a) != _tree_digest(c)


def test_llava_json_layout(tmp_path):
    recs = generate_records(30, seed=0, broken_fraction=0.2, synthetic=True)
    write_llava_json(recs, tmp_path)
    lines = (tmp_path / "annotations.jsonl").read_bytes().splitlines()
    assert len(lines) == 30
    ok = [json.loads(line) for r, line in zip(recs, lines) if r.broken != "malformed_json"]
    for rec in ok:
        refs = rec.get("image")
        for ref in [refs] if isinstance(refs, str) else refs or []:
            assert ref.startswith("images/")


def test_videos_are_opt_in(tmp_path):
    import av

    plain = generate_records(40, seed=3, synthetic=True)
    mixed = generate_records(40, seed=3, video_fraction=0.3, synthetic=True)
    assert not any(r.video for r in plain)
    vids = [r for r in mixed if r.video]
    assert vids and all("<video>" in r.record["conversations"][0]["value"] for r in vids)
    # records that are not videos are unchanged by the option
    assert [r.json_bytes for r in mixed if not r.video] == [p.json_bytes for p, m in zip(plain, mixed) if not m.video]
    with av.open(io.BytesIO(vids[0].video)) as c:
        assert sum(1 for _ in c.decode(video=0)) >= 4
    write_infinity_mm(mixed, tmp_path, samples_per_tar=40)
    names = [n for t in tmp_path.rglob("*.tar") for n in tarfile.open(t).getnames()]
    assert sum(n.endswith(".mp4") for n in names) == len(vids)


def test_cli(tmp_path):
    out = tmp_path / "raw"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmdata.dev.synth",
            "--dataset",
            "infinity-mm",
            "--output",
            str(out),
            "--num-samples",
            "12",
            "--seed",
            "0",
            "--broken-fraction",
            "0.5",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "12 records (6 broken)" in proc.stdout
    assert sorted(p.parts[-3] for p in out.rglob("*.tar")) == ["stage1", "stage2", "stage3", "stage4"]


def _bytes_per_pixel(records, fmt: str) -> float:
    data = pixels = 0
    for r in records:
        for im in r.images:
            if im.name_ext == fmt and im.data and not r.broken:
                w, h = Image.open(io.BytesIO(im.data)).size
                data, pixels = data + len(im.data), pixels + w * h
    return data / pixels


def test_photo_like_images_have_real_entropy_and_are_deterministic():
    """The default images are crops of real photos: encoded they are several times the size of
    the gradients per pixel (JPEG about 3x, PNG and WebP far more), they are the same in every
    run (per record from seed and index: a shorter run is a prefix of a longer one), and only
    the pixels differ from --synthetic (same records, sizes and formats)."""
    photo, gradient = generate_records(40, seed=5), generate_records(40, seed=5, synthetic=True)
    ratios = {fmt: _bytes_per_pixel(photo, fmt) / _bytes_per_pixel(gradient, fmt) for fmt in ("jpg", "png", "webp")}
    assert ratios["jpg"] > 2.5 and ratios["png"] > 10 and ratios["webp"] > 4, ratios
    again = generate_records(20, seed=5)
    assert [(r.json_bytes, [im.data for im in r.images]) for r in again] == [
        (r.json_bytes, [im.data for im in r.images]) for r in photo[:20]
    ]
    for p, g in zip(photo, gradient):
        assert p.member_names == g.member_names and p.record["conversations"] == g.record["conversations"]
        assert [Image.open(io.BytesIO(im.data)).size for im in p.images if im.data] == [
            Image.open(io.BytesIO(im.data)).size for im in g.images if im.data
        ]
    assert all(p.images[0].data != g.images[0].data for p, g in zip(photo, gradient) if p.images and not p.broken)


def test_photos_come_from_the_installed_wheel():
    """Every source photo is read from scikit-image's bundled files (no download) and decodes."""
    from mmdata.dev.photo_source import PHOTOS, source_photo

    for name in PHOTOS:
        img = source_photo(name)
        assert img.mode == "RGB" and min(img.size) >= 150, (name, img.size)


def test_cli_default_is_photo_like(tmp_path):
    """`mmdata synth` writes photo-like images unless --synthetic, as generate_records does."""
    from mmdata.cli import main

    for flag, synthetic in (([], False), (["--synthetic"], True)):
        out = tmp_path / f"cli{synthetic}"
        assert main(["synth", "--output", str(out), "--num-samples", "6", "--seed", "2", *flag]) == 0
        write_infinity_mm(generate_records(6, seed=2, synthetic=synthetic), tmp_path / f"api{synthetic}")
        assert _tree_digest(out) == _tree_digest(tmp_path / f"api{synthetic}")
