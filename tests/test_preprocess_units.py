"""Fast unit tests (no Ray): validation reasons, placeholder normalisation, the shuffle plan's
independence from the bucket count, and deterministic shard bytes."""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from mmdata.preprocess.adapters.base import MediaRef, MediaResolver, RawRecord
from mmdata.shard_job.shard_writer import SampleMembers, sha256_file, write_shard
from mmdata.preprocess.shuffle_plan import bucket_of, plan_shards, shuffle_key
from mmdata.preprocess.validation import Invalid, Valid, ValidationConfig, validate

pytestmark = pytest.mark.unit


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((w, h), 40).convert("RGB").save(buf, format="JPEG", quality=90)
    return buf.getvalue()


class _Files(MediaResolver):
    def __init__(self, tmp: Path, files: dict[str, bytes]):
        self.refs = {}
        for name, data in files.items():
            p = tmp / name
            p.write_bytes(data)
            self.refs[name] = MediaRef(str(p), 0, len(data), name)

    def by_name(self, ref):
        return self.refs.get(ref)


def _record(tmp: Path, obj, files: dict[str, bytes] | None = None) -> RawRecord:
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return RawRecord("f.tar:x.json", "f.tar:x.json", data, {"file": "f.tar"}, _Files(tmp, files or {}))


CONV = [{"from": "human", "value": "What is this?"}, {"from": "gpt", "value": "A square."}]


@pytest.mark.parametrize(
    "obj,files,reason",
    [
        (b'{"id": "a", "conversations": [', {}, "json_malformed"),
        ([1, 2], {}, "schema_invalid"),
        ({"id": "a", "conversations": [{"from": "gpt", "value": "hi"}]}, {}, "conversation_malformed"),
        (
            {"id": "a", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]},
            {},
            "conversation_malformed",
        ),
        ({"id": "a", "conversations": CONV, "image": 5}, {}, "schema_invalid"),
        ({"id": "a", "conversations": CONV, "image": "x.png"}, {}, "image_missing"),
        ({"id": "a", "conversations": CONV, "image": "x.png"}, {"x.png": b""}, "image_empty"),
        ({"id": "a", "conversations": CONV, "image": "x.jpg"}, {"x.jpg": _jpeg(200, 200)[:900]}, "image_truncated"),
        ({"id": "a", "conversations": CONV, "image": "x.png"}, {"x.png": b"not an image at all"}, "image_undecodable"),
        ({"id": "a", "conversations": CONV, "image": "x.png"}, {"x.png": _png(400, 400)}, "image_too_large"),
        (
            {
                "id": "a",
                "conversations": [{"from": "human", "value": "<image><image>hi"}, {"from": "gpt", "value": "x"}],
                "image": "x.png",
            },
            {"x.png": _png(8, 8)},
            "placeholder_mismatch",
        ),
        (
            {"id": "a", "conversations": [{"from": "human", "value": "<image>hi"}, {"from": "gpt", "value": "x"}]},
            {},
            "placeholder_mismatch",
        ),
        (
            b'{"id": "a", "conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "x"}]}',
            {},
            "json_malformed",
        ),  # a lone surrogate: valid JSON, not encodable as UTF-8
    ],
)
def test_invalid_records_get_their_reason(tmp_path, obj, files, reason):
    res = validate(_record(tmp_path, obj, files), ValidationConfig(max_image_pixels=100_000))
    assert isinstance(res, Invalid) and res.reason == reason, res


SYS = {"from": "system", "value": "Be brief."}


@pytest.mark.parametrize(
    "conversations, detail",
    [
        ([SYS, {"from": "gpt", "value": "x"}], "needs a human turn first and at least one gpt turn"),
        ([{"from": "human", "value": "a"}, SYS], "needs a human turn first and at least one gpt turn"),
        (
            [{"from": "human", "value": "a"}, SYS, {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}],
            "turns do not alternate: turns 0 and 1 (system turns not counted) are both from 'human'",
        ),
        (
            [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "gpt", "value": "c"}],
            "turns do not alternate: turns 1 and 2 (system turns not counted) are both from 'gpt'",
        ),
        (
            [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}],
            "turn 1 has role 'bot', expected one of ['gpt', 'human', 'system']",
        ),
        ([{"from": "human", "value": "a"}, ["gpt", "b"]], "turn 1 is not {from, value: str}"),
        ([{"from": "human", "value": "a" * 12}, {"from": "gpt", "value": "b" * 10}], "22 characters > 20"),
        (
            [{"from": "human", "value": "hi <video>"}, {"from": "gpt", "value": "b"}],
            "1 `<video>` placeholders for 0 videos",
        ),
        (
            [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<image>"}],
            "1 `<image>` placeholders for 0 images",
        ),
    ],
)
def test_conversation_rejections_say_what_is_wrong(tmp_path, conversations, detail):
    res = validate(
        _record(tmp_path, {"id": "a", "conversations": conversations}), ValidationConfig(max_conversation_chars=20)
    )
    assert isinstance(res, Invalid) and res.detail == detail, res


def test_system_turns_are_kept_and_not_counted_for_alternation(tmp_path):
    conversations = [SYS, {"from": "human", "value": "a"}, SYS, {"from": "gpt", "value": "b"}]
    res = validate(_record(tmp_path, {"id": "a", "conversations": conversations}), ValidationConfig())
    assert isinstance(res, Valid) and res.record["conversations"] == conversations


def test_quarantine_details_are_the_same_in_every_run(tmp_path):
    """Pillow names an unreadable in-memory file by its object's address, which differs per run."""
    from mmdata.shard_job.quarantine import quarantine_line

    obj = {"id": "a", "conversations": CONV, "image": "x.png"}
    res = validate(_record(tmp_path, obj, {"x.png": b"not an image at all"}), ValidationConfig())
    assert isinstance(res, Invalid) and "cannot identify image file" in res.detail
    line = json.loads(quarantine_line(res.id, "f.tar:x.json", res.reason, res.detail))
    assert "0x" not in line["detail"] and line["detail"].startswith("x.png: cannot identify image file")
    assert quarantine_line("i", "l", "r", "<Foo object at 0x7f3a2b> and <bar at 0xDEAD>") == quarantine_line(
        "i", "l", "r", "<Foo object at 0x55aa> and <bar at 0x1>"
    )


def test_video_records(tmp_path):
    import numpy as np

    from mmdata.dev.synth_media import encode_video

    clip = encode_video(np.random.default_rng(0))
    obj = {"id": "v", "conversations": [dict(t) for t in CONV], "video": "c.mp4"}
    rec = json.loads(validate(_record(tmp_path, obj, {"c.mp4": clip}), ValidationConfig()).record_json)
    assert rec["video"] == "video.mp4" and rec["conversations"][0]["value"].startswith("<video>\n")
    for files, reason in [
        ({}, "video_missing"),
        ({"c.mp4": b""}, "video_empty"),
        ({"c.mp4": clip[: len(clip) // 2]}, "video_undecodable"),
    ]:
        res = validate(_record(tmp_path, obj, files), ValidationConfig())
        assert isinstance(res, Invalid) and res.reason == reason


def test_placeholder_inserted_and_members_named_by_real_format(tmp_path):
    obj = {"id": 7, "source": "s", "conversations": [dict(t) for t in CONV], "image": ["a.png", "b.png"], "phash": "ff"}
    obj["conversations"][0]["value"] = "<image> and <image>: compare"
    jpeg_named_png = _jpeg(64, 32)
    res = validate(_record(tmp_path, obj, {"a.png": _png(16, 16), "b.png": jpeg_named_png}), ValidationConfig())
    assert isinstance(res, Valid)
    rec = json.loads(res.record_json)
    assert rec["images"] == ["img00.png", "img01.jpg"] and rec["id"] == "7" and rec["meta"]["phash"] == "ff"
    assert rec["meta"]["image_sizes"] == [[16, 16, "RGB"], [64, 32, "RGB"]]
    single = {"id": "b", "conversations": [dict(t) for t in CONV], "image": "a.png"}
    rec = json.loads(validate(_record(tmp_path, single, {"a.png": _png(16, 16)}), ValidationConfig()).record_json)
    assert rec["conversations"][0]["value"] == "<image>\nWhat is this?"
    text_only = {"id": "c", "conversations": CONV}
    rec = json.loads(validate(_record(tmp_path, text_only), ValidationConfig()).record_json)
    assert rec["images"] == [] and rec["conversations"] == CONV


def test_order_independent_of_bucket_count():
    rids = [f"stage1/x/{i // 50:06d}.tar:{i:08d}.json" for i in range(1000)]
    keys = {r: shuffle_key(3, r) for r in rids}
    global_order = sorted(rids, key=lambda r: (keys[r], r))
    for num_buckets in (1, 2, 7, 64):
        buckets = [[] for _ in range(num_buckets)]
        shuffled = rids[:]
        random.Random(num_buckets).shuffle(shuffled)  # arrival order must not matter
        for r in shuffled:
            buckets[bucket_of(keys[r], num_buckets)].append(r)
        order = [r for b in buckets for r in sorted(b, key=lambda r: (keys[r], r))]
        assert order == global_order
        plans = plan_shards([len(b) for b in buckets], 64)
        assert [p.num_samples for p in plans] == [64] * 15 + [40]
        assert [p.first_rank for p in plans] == list(range(0, 1000, 64))
        covered = [(sl.bucket, i) for p in plans for sl in p.slices for i in range(sl.start, sl.stop)]
        assert covered == [(b, i) for b in range(num_buckets) for i in range(len(buckets[b]))]
    assert shuffle_key(3, rids[0]) != shuffle_key(4, rids[0])


def test_write_shard_is_deterministic_and_atomic(tmp_path):
    samples = [
        SampleMembers(f"{i:010d}", [("json", b'{"i": %d}' % i), ("img00.jpg", bytes([i]) * 100)]) for i in range(5)
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ra, _ = write_shard(a / "shard-000000.tar", iter(samples))  # (ShardResult, ShardLayout)
    rb, _ = write_shard(b / "shard-000000.tar", iter(samples))
    assert ra.sha256 == rb.sha256 == sha256_file(a / "shard-000000.tar") and ra.samples == 5
    assert ra.bytes == (a / "shard-000000.tar").stat().st_size
    assert sorted(p.name for p in a.iterdir()) == ["shard-000000.tar"]  # no temp file left
    with tarfile.open(a / "shard-000000.tar") as tar:
        assert tar.getnames()[:2] == ["0000000000.img00.jpg", "0000000000.json"]
    with pytest.raises(ValueError):
        write_shard(a / "shard-000001.tar", iter([SampleMembers("a.b", [("json", b"{}")])]))
    assert sorted(p.name for p in a.iterdir()) == ["shard-000000.tar"]  # failed write leaves nothing


def test_truncated_input_tar_keeps_the_good_records(tmp_path):
    """A tar cut short: records before the damage go through, the rest is quarantined."""
    from mmdata.preprocess.adapters import list_units
    from mmdata.preprocess.stages import JobSpec, scan_unit
    from mmdata.dev.synth import generate_records, write_infinity_mm

    raw = tmp_path / "raw"
    write_infinity_mm(generate_records(40, seed=0, synthetic=True), raw, samples_per_tar=10)
    victim = sorted(raw.rglob("*.tar"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) * 6 // 10])
    (tmp_path / "work" / "scan").mkdir(parents=True)
    unit = list_units("infinity-mm", [raw])[0]
    assert unit.path == str(victim.resolve())
    spec = JobSpec("infinity-mm", 0, 2, ValidationConfig(), str(tmp_path / "work"))
    counts = scan_unit(unit, spec)
    assert 0 < counts["written"] < 10 and counts["read"] == counts["written"] + counts["quarantined"]
    assert counts["by_reason"].get("input_truncated", 0) >= 1
    lines = (tmp_path / "work" / "scan" / "u0000000.quarantine.jsonl").read_text().splitlines()
    assert any(json.loads(line)["reason"] == "input_truncated" for line in lines)
    not_a_tar = raw / "stage9" / "x" / "000000.tar"
    not_a_tar.parent.mkdir(parents=True)
    not_a_tar.write_bytes(b"\x00garbage" * 10)
    bad = next(u for u in list_units("infinity-mm", [raw]) if u.path == str(not_a_tar.resolve()))
    counts = scan_unit(bad, spec)
    assert counts["read"] == counts["quarantined"] == 1 and counts["by_reason"] == {"input_unreadable": 1}


def test_truncated_png_and_webp_are_image_truncated_or_undecodable(tmp_path):
    im = Image.effect_mandelbrot((300, 200), (-2, -1.5, 1, 1.5), 60).convert("RGB")
    for fmt, name in (("PNG", "x.png"), ("WEBP", "x.webp")):
        buf = io.BytesIO()
        im.save(buf, format=fmt)
        obj = {"id": "a", "conversations": CONV, "image": name}
        res = validate(_record(tmp_path, obj, {name: buf.getvalue()[: len(buf.getvalue()) // 2]}), ValidationConfig())
        assert isinstance(res, Invalid) and res.reason in ("image_truncated", "image_undecodable"), res
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    obj = {"id": "a", "conversations": CONV, "image": "x.png"}
    res = validate(_record(tmp_path, obj, {"x.png": buf.getvalue()[:-30]}), ValidationConfig())
    assert isinstance(res, Invalid) and res.reason == "image_truncated", res


def test_input_files_cache_keeps_recently_used_files_open(tmp_path):
    """A shard writer reads from every input file in turn: the fd cache must evict the least
    recently used file, not the first opened, and give fds that read the right bytes after any
    eviction."""
    from mmdata.preprocess.stages import _InputFiles

    paths = []
    for name in "abc":
        p = tmp_path / name
        p.write_bytes(name.encode() * 10 + bytes(range(10)))
        paths.append(str(p))
    a, b, c = paths
    files = _InputFiles(limit=2)

    def read(path: str, offset: int, size: int) -> bytes:
        return os.pread(files.fd(path), size, offset)

    try:
        assert read(a, 0, 3) == b"aaa" and read(b, 0, 3) == b"bbb"
        assert read(a, 10, 3) == bytes([0, 1, 2])  # a becomes the most recently used
        assert read(c, 8, 4) == b"cc\x00\x01"  # evicts b, not a
        assert set(files.fds) == {a, c} and files.opened == 3
        assert read(a, 0, 1) == b"a" and files.opened == 3  # no reopen
        assert read(b, 19, 1) == b"\x09" and files.opened == 4 and set(files.fds) == {a, b}
    finally:
        files.close()
    assert not files.fds


def test_offsets_files_round_trip_and_slices(tmp_path):
    from mmdata.preprocess.rows import concat_rows, load_offsets, read_rows, save_offsets

    rows = [bytes([i]) * (i % 5) + b"\0x" for i in range(50)]
    data, offsets = concat_rows(rows)
    (tmp_path / "r.rows").write_bytes(data)
    save_offsets(tmp_path / "r.i64", offsets)
    assert (tmp_path / "r.i64").stat().st_size == 8 * len(offsets)
    assert load_offsets(tmp_path / "r.i64", 0, len(offsets)) == offsets
    for start, stop in ((0, 50), (7, 8), (13, 41), (49, 50), (20, 20)):
        assert read_rows(tmp_path / "r.rows", tmp_path / "r.i64", start, stop) == rows[start:stop]
    with pytest.raises(IOError, match="work folder damaged"):
        load_offsets(tmp_path / "r.i64", 45, 10)


def test_loss_check_decides_on_the_first_files_in_input_order(tmp_path):
    """The verdict covers the first files (input order) holding >= K records, whatever order
    they finish in; it names the reason, the count and 3 examples from those files."""
    from mmdata.preprocess.loss_check import LossCheck, SystematicLoss
    from mmdata.shard_job.quarantine import quarantine_line

    def part(i: int) -> Path:
        return tmp_path / f"u{i}.jsonl"

    def unit(i: int, read: int, missing: int) -> dict:
        part(i).write_text(
            "".join(
                quarantine_line(f"r{i}-{k}", f"f{i}.tar:{k}.json", "image_missing", f"detail {k}") + "\n"
                for k in range(missing)
            )
        )
        return {"read": read, "by_reason": {"image_missing": missing} if missing else {}}

    clean_prefix = LossCheck(num_units=5, max_fraction=0.2, quarantine_part=part, first_records=100)
    clean_prefix.add(2, unit(2, 50, 50))  # a later, bad file finishes first: not judged yet
    clean_prefix.add(1, unit(1, 50, 0))
    assert not clean_prefix.decided
    clean_prefix.add(0, unit(0, 60, 0))  # files 0-1 hold 110 >= 100 records, none lost: fine
    assert clean_prefix.decided and clean_prefix.read == 110
    clean_prefix.add(3, unit(3, 10, 10))  # decided once: later files do not matter

    bad_prefix = LossCheck(num_units=5, max_fraction=0.2, quarantine_part=part, first_records=100)
    bad_prefix.add(1, unit(1, 50, 0))
    with pytest.raises(SystematicLoss) as e:
        bad_prefix.add(0, unit(0, 60, 30))  # 30 of 110 = 27 % > 20 %
    msg = str(e.value)
    assert "30 of the first 110 records" in msg and "image_missing" in msg and "--max-quarantine-fraction 0.2" in msg
    assert all(f"r0-{k} at f0.tar:{k}.json: detail {k}" in msg for k in range(3)) and "r0-3" not in msg

    few = LossCheck(num_units=2, max_fraction=0.5, quarantine_part=part)  # fewer records than K: all of them
    few.add(0, unit(0, 10, 5))
    with pytest.raises(SystematicLoss):
        few.add(1, unit(1, 10, 6))  # 11 of 20 > 50 %
    off = LossCheck(num_units=1, max_fraction=1.0, quarantine_part=part)
    off.add(0, unit(0, 10, 10))  # 1.0 disables the check


def _scan_outputs(work: Path, unit_index: int) -> dict[str, bytes]:
    """A scan run's files (rows, offsets, groups, quarantine part, done marker) by suffix."""
    prefix = f"u{unit_index:07d}."
    return {
        f"{p.parent.name}/{p.name}": p.read_bytes()
        for folder in ("scan", "dedup")
        for p in sorted((work / folder).glob(prefix + "*"))
    }


def test_scan_in_batches_gives_what_one_record_at_a_time_gives(tmp_path, monkeypatch):
    """scan_unit validates records phase by phase in batches (validate_many); a batch of one is
    the old record-at-a-time scan. Every reason a broken record can have (synth's broken kinds,
    video records among them), filters and dedup: the same rows, quarantine lines and counts
    whatever the batch size, down to the last byte."""
    from mmdata.preprocess import stages
    from mmdata.preprocess.adapters import list_units
    from mmdata.preprocess.curation.filters import parse_filters
    from mmdata.dev.synth import generate_records, write_infinity_mm

    raw = tmp_path / "raw"
    write_infinity_mm(
        generate_records(160, seed=3, broken_fraction=0.4, video_fraction=0.1, synthetic=True), raw, samples_per_tar=60
    )  # (four subsets: about 40 records in each file)
    (unit,) = [u for u in list_units("infinity-mm", [raw]) if u.index == 0]
    outputs = []
    for batch in (1, 7, stages.SCAN_BATCH_RECORDS):
        monkeypatch.setattr(stages, "SCAN_BATCH_RECORDS", batch)
        work = tmp_path / f"work{batch}"
        for folder in ("scan", "dedup"):
            (work / folder).mkdir(parents=True)
        spec = stages.JobSpec(
            "infinity-mm", 0, 3, ValidationConfig(), str(work), tuple(parse_filters(["turns<=3"])), dedup_distance=2
        )
        counts = stages.scan_unit(unit, spec)
        outputs.append(_scan_outputs(work, unit.index))
    assert counts["quarantined"] >= 10 and counts["written"] >= 10 and counts.get("filtered", 0) >= 1, counts
    assert len(counts["by_reason"]) >= 4, counts["by_reason"]
    assert outputs[0] == outputs[1] == outputs[2]


def test_scan_keeps_the_records_before_a_file_fails_half_way(tmp_path, monkeypatch):
    """An input whose reading fails after some records (an I/O error half way): the records
    read before it are validated and kept, whichever batch they were in, and the rest of the
    file is one input_unreadable line."""
    from mmdata.preprocess import adapters, stages
    from mmdata.dev.synth import generate_records, write_infinity_mm

    raw = tmp_path / "raw"
    write_infinity_mm(generate_records(80, seed=1, synthetic=True), raw, samples_per_tar=20)  # 4 files of 20
    unit = adapters.list_units("infinity-mm", [raw])[0]
    real = adapters.iter_records

    def failing(dataset, unit):
        for k, record in enumerate(real(dataset, unit)):
            if k == 13:
                raise OSError("device gone")
            yield record

    monkeypatch.setattr(adapters, "iter_records", failing)
    monkeypatch.setattr(stages, "SCAN_BATCH_RECORDS", 5)
    (tmp_path / "work" / "scan").mkdir(parents=True)
    counts = stages.scan_unit(unit, stages.JobSpec("infinity-mm", 0, 2, ValidationConfig(), str(tmp_path / "work")))
    assert (counts["read"], counts["written"], counts["by_reason"]) == (14, 13, {"input_unreadable": 1})
    (line,) = (tmp_path / "work" / "scan" / "u0000000.quarantine.jsonl").read_text().splitlines()
    assert json.loads(line)["detail"] == "OSError: device gone"
