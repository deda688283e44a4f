"""The hand-built ustar writer against `tarfile` (byte for byte), readers (tarfile, webdataset),
and the compact index-row encoding used between the preprocess stages."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import tarfile
from pathlib import Path

import pytest

from mmdata import shard_format as sf
from mmdata.shard_job.energon_meta import INDEX_PART, ShardLayout, read_index_part
from mmdata.shard_job.shard_writer import FileRange, SampleMembers, ShardResult, sha256_file, tar_header, write_shard
from mmdata.preprocess.rows import decode_row, encode_row, rekey_row, row_head

pytestmark = pytest.mark.unit


# The previous `write_shard` implementation (tarfile-based), kept verbatim as the reference:
# the hand-built headers must produce exactly the bytes it writes.
def _reference_tar(samples: list[SampleMembers]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            if "." in sample.key or "/" in sample.key:
                raise ValueError(f"invalid sample key {sample.key!r}")
            for suffix, data in sorted(sample.members):
                info = tarfile.TarInfo(f"{sample.key}.{suffix}")
                info.size, info.mtime, info.mode = len(data), sf.TAR_MTIME, sf.TAR_MODE
                info.uid, info.gid, info.uname, info.gname = sf.TAR_UID, sf.TAR_GID, sf.TAR_UNAME, sf.TAR_GNAME
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


SIZES = [0, 1, 2, 100, 511, 512, 513, 1023, 1024, 1025, 10_000, 10_240, 300_000]


def _samples(rng: random.Random, n: int, first: int = 0) -> list[SampleMembers]:
    samples = []
    for i in range(first, first + n):
        members = [("json", json.dumps({"i": i, "t": "é\n中"}, ensure_ascii=False).encode())]
        for j in range(rng.randrange(0, 4)):
            members.append((f"img{j:02d}.{rng.choice(['jpg', 'png', 'webp'])}", rng.randbytes(rng.choice(SIZES))))
        if rng.random() < 0.1:
            members.append(("video.mp4", rng.randbytes(rng.choice(SIZES))))
        rng.shuffle(members)  # the writer sorts them by name
        samples.append(SampleMembers(f"{i:010d}", members))
    return samples


def _write(
    tmp_path: Path, samples: list[SampleMembers], name: str = "shard-000000.tar", direct: bool | None = None
) -> tuple[Path, ShardResult]:
    path = tmp_path / name
    result, layout = write_shard(path, iter(samples), direct)
    _check_layout(path, layout)
    return path, result


def _check_layout(path: Path, layout: ShardLayout) -> None:
    """The recorded layout is what reading the tar back finds."""
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    keys = [m.name.split(".", 1)[0] for m in members]
    first = [i for i in range(len(members)) if i == 0 or keys[i] != keys[i - 1]]
    assert layout.samples == [(keys[i], members[i].offset) for i in first]
    sample_of = {k: i for i, (k, _) in enumerate(layout.samples)}
    assert layout.parts == [
        (sample_of[k], m.name.split(".", 1)[1], m.offset_data, m.size) for k, m in zip(keys, members)
    ]
    end = members[-1].offset_data + -(-members[-1].size // 512) * 512 if members else 0
    assert layout.end == end


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
@pytest.mark.parametrize("n", [0, 1, 2, 19, 20, 21, 300])
def test_byte_identical_to_tarfile(tmp_path: Path, n: int, direct: bool) -> None:
    samples = _samples(random.Random(n), n)
    path, res = _write(tmp_path, samples, direct=direct)
    data = path.read_bytes()
    assert data == _reference_tar(samples)
    assert len(data) % (20 * 512) == 0
    assert (res.samples, res.bytes, res.sha256) == (n, len(data), hashlib.sha256(data).hexdigest())
    assert res.sha256 == sha256_file(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
@pytest.mark.parametrize("size", SIZES + [4 << 20, (4 << 20) + 1, 5 << 20, (8 << 20) + 1])
def test_every_member_size(tmp_path: Path, size: int, direct: bool) -> None:
    # Sizes around block boundaries, and members larger than the writer's flush size and its buffer.
    samples = [SampleMembers(f"{i:010d}", [("bin", os.urandom(size)), ("json", b"{}")]) for i in range(3)]
    path, _ = _write(tmp_path, samples, direct=direct)
    assert path.read_bytes() == _reference_tar(samples)


class _Files:
    """OpenFiles for the tests: one fd per path, closed at the end."""

    def __init__(self):
        self.fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _as_ranges(tmp_path: Path, samples: list[SampleMembers]) -> list[SampleMembers]:
    """The same samples with every non-JSON member stored in one input file and given as a
    FileRange into it (as the preprocessing job's write stage gives its media)."""
    blob, ranged = bytearray(b"header"), []
    for s in samples:
        members = []
        for suffix, data in s.members:
            if suffix == "json":
                members.append((suffix, data))
            else:
                members.append((suffix, FileRange(str(tmp_path / "input.bin"), len(blob), len(data))))
                blob += data
        ranged.append(SampleMembers(s.key, members))
    (tmp_path / "input.bin").write_bytes(bytes(blob))
    return ranged


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_file_ranges_write_the_same_bytes_as_bytes(tmp_path: Path, direct: bool) -> None:
    """Media copied from input files into the staging buffer (FileRange) give the very shard
    that the same media as bytes give: members around block boundaries and past the buffer."""
    samples = _samples(random.Random(3), 120)
    samples += [
        SampleMembers(f"{i:010d}", [("bin", os.urandom(size)), ("json", b"{}")])
        for i, size in enumerate([(8 << 20) + 1, 5 << 20, 513], start=500)
    ]
    out = tmp_path / "out"
    out.mkdir()
    files = _Files()
    try:
        res, layout = write_shard(out / "ranges.tar", iter(_as_ranges(tmp_path, samples)), direct, files)
    finally:
        files.close()
    _check_layout(out / "ranges.tar", layout)
    want = _reference_tar(samples)
    assert (out / "ranges.tar").read_bytes() == want
    assert res.sha256 == hashlib.sha256(want).hexdigest()


def test_file_range_past_the_end_of_its_file_is_refused(tmp_path: Path) -> None:
    """An input cut short since the scan: an IOError naming the file, and no shard left behind."""
    samples = _as_ranges(tmp_path, _samples(random.Random(5), 30))
    with open(tmp_path / "input.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    out = tmp_path / "out"
    out.mkdir()
    files = _Files()
    with pytest.raises(IOError, match=r"input\.bin: expected \d+ bytes at offset \d+, got \d+ \(input changed\?\)"):
        write_shard(out / "shard.tar", iter(samples), None, files)
    files.close()
    assert list(out.iterdir()) == []


def test_header_matches_tarfile_for_unicode_and_max_length_names() -> None:
    for name in ["0000000001.json", "0000000001.img00.jpg", "é中.json", "x" * 100, "k." + "é" * 49]:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = 12345, sf.TAR_MTIME, sf.TAR_MODE
        info.uid, info.gid, info.uname, info.gname = sf.TAR_UID, sf.TAR_GID, sf.TAR_UNAME, sf.TAR_GNAME
        assert tar_header(name, 12345) == info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def test_long_names_and_huge_sizes_rejected(tmp_path: Path) -> None:
    # Over 100 bytes: tarfile would need the prefix field (and fails too without a "/"); we refuse.
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        tar_header("x" * 101, 1)
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        _write(tmp_path, [SampleMembers("0000000000", [("s" * 90, b"x")])])
    with pytest.raises(ValueError, match="does not fit"):
        tar_header("0000000000.json", 8**11)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["0000000001.x", "a/b"])
def test_invalid_key_rejected_and_no_partial_file(tmp_path: Path, key: str) -> None:
    samples = _samples(random.Random(0), 5) + [SampleMembers(key, [("json", b"{}")])]
    with pytest.raises(ValueError, match="invalid sample key"):
        _write(tmp_path, samples)
    assert list(tmp_path.iterdir()) == []


def test_readable_by_tarfile_and_webdataset(tmp_path: Path) -> None:
    import webdataset as wds

    samples = _samples(random.Random(7), 200)
    samples = [s for s in samples if s.members] + [SampleMembers("0000999999", [("json", b"")])]
    path, _ = _write(tmp_path, samples)
    want = {s.key: dict(s.members) for s in samples}

    with tarfile.open(path) as tar:
        got: dict[str, dict[str, bytes]] = {}
        for m in tar.getmembers():
            assert (m.mode, m.uid, m.gid, m.uname, m.gname, m.mtime) == (
                sf.TAR_MODE,
                sf.TAR_UID,
                sf.TAR_GID,
                sf.TAR_UNAME,
                sf.TAR_GNAME,
                sf.TAR_MTIME,
            )
            assert m.isreg()
            key, suffix = m.name.split(".", 1)
            got.setdefault(key, {})[suffix] = tar.extractfile(m).read()
    assert got == want

    seen = {}
    for sample in wds.WebDataset(str(path), shardshuffle=False):
        seen[sample["__key__"]] = {k: v for k, v in sample.items() if not k.startswith("__")}
    assert seen == want


# ----------------------------------------------------------------------------- index rows


def test_row_round_trip() -> None:
    rng = random.Random(3)
    record = {"id": 'x\n"y"\\', "conversations": [{"from": "human", "value": "<image>\nline\r\n\t\x00 é 中 🙂 \u2028"}]}
    record_json = json.dumps(record, ensure_ascii=False, sort_keys=True)
    media = [
        (f"/data/dir with space/ünï cøde 中/{i}.tar", rng.randrange(1 << 40), rng.randrange(1 << 31), f"img{i:02d}.jpg")
        for i in range(40)
    ]
    media.append(("/data/undecodable-\udcff.tar", 0, 0, "video.mp4"))  # a non-UTF-8 file name (os.fsdecode)
    for m in (media, media[:1], []):
        rid = "stage1/a b/000.tar:0001.json"
        tokens = (rng.randrange(1 << 30), rng.randrange(1 << 30))
        row = encode_row(2**64 - 1, rid, (3, 17), "src é", "stage1/a b", record_json, m, tokens)
        got_json, got_media, got_tokens = decode_row(row)
        assert json.loads(got_json) == record and got_json == record_json.encode()
        assert got_media == m and got_tokens == tokens
        assert row_head(row) == (rid, (3, 17), "src é", "stage1/a b")
        copy = rekey_row(row, 5, rid + "#repeat1")  # a repeated copy: new key and identity, same record
        assert copy[:8] == (5).to_bytes(8, "big") and row_head(copy) == (
            rid + "#repeat1",
            (3, 17),
            "src é",
            "stage1/a b",
        )
        assert decode_row(copy) == decode_row(row)


def test_row_rejects_nul_in_rid() -> None:
    with pytest.raises(ValueError):
        encode_row(1, "a\0b", (0, 0), "", "", "{}", [])


def test_sorted_rows_sort_by_key_then_rid() -> None:
    rng = random.Random(5)
    rids = ["a", "a0", "a/b", "ab", "a\x01", "é", "中", "z", "", "a b"]
    items = [
        (
            rng.choice([0, 1, 255, 256, 2**63, 2**64 - 1, rng.randrange(2**64)]),
            rng.choice(rids) + rng.choice(["", "x", "é"]),
        )
        for _ in range(2000)
    ]
    rows = [
        encode_row(k, rid, (0, 0), "s", "", json.dumps({"k": k}), [("/p", 1, 2, "img00.jpg")] * rng.randrange(3))
        for k, rid in items
    ]
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    keys = [(items[i][0], items[i][1]) for i in order]
    assert keys == sorted(keys)


def test_stages_without_ray_same_shards_whatever_bucket_count(tmp_path: Path) -> None:
    from mmdata.preprocess import adapters
    from mmdata.preprocess.shuffle_plan import plan_shards
    from mmdata.preprocess.stages import JobSpec, scan_unit, sort_bucket, write_shard_task
    from mmdata.dev.synth import generate_records, write_infinity_mm
    from mmdata.preprocess.validation import ValidationConfig

    raw = tmp_path / "raw input é"  # paths with spaces and non-ASCII travel through the rows
    write_infinity_mm(generate_records(60, seed=1, synthetic=True), raw, samples_per_tar=16)
    units = adapters.list_units("infinity-mm", [raw], None)
    digests = []
    for nb in (1, 3, 7):
        work, out = tmp_path / f"work{nb}", tmp_path / f"out{nb}"
        for d in ("scan", "sorted", "shards"):
            (work / d).mkdir(parents=True)
        out.mkdir()
        spec = JobSpec("infinity-mm", 0, nb, ValidationConfig(), str(work))
        for u in units:
            scan_unit(u, spec)
        counts = [sort_bucket(b, len(units), spec)["count"] for b in range(nb)]
        results = [write_shard_task(p, spec, str(out)) for p in plan_shards(counts, 16)]
        assert sum(r["samples"] for r in results) == sum(counts) > 0
        for r in results:
            _check_layout(out / r["name"], read_index_part(work / "shards" / f"{r['name']}.{INDEX_PART}"))
            assert (out / r["name"].replace(".tar", ".tar.idx")).exists()
        digests.append([r["sha256"] for r in results])
        # A rerun keeps the shards (resume markers) with the same digests.
        again = [write_shard_task(p, spec, str(out)) for p in plan_shards(counts, 16)]
        assert all(r["resumed"] for r in again) and [r["sha256"] for r in again] == digests[-1]
    assert digests[0] == digests[1] == digests[2]


def test_layout_round_trips_through_its_json_undecodable_names_included() -> None:
    """A shard's layout (written by the shard writer, read by the driver's energon index) comes
    back equal, also with a member suffix holding a surrogate escape (an undecodable name),
    which orjson cannot write and `json` then does."""
    for suffix in ("img00.jpg", "video.m\udcffp4"):
        layout = ShardLayout(
            [("0000000001", 0), ("0000000002", 2048)], [(0, "json", 512, 10), (1, suffix, 2560, 5)], 3072
        )
        assert ShardLayout.from_json(layout.to_json()) == layout
