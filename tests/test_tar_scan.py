"""`mmdata.shard_job.tar_scan.list_tar` lists exactly what `tarfile` lists (members, data
offsets, damage), and the Infinity-MM adapter built on it yields the same records as before."""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mmdata.shard_job import tar_scan
from mmdata.preprocess.adapters import infinity_mm
from mmdata.preprocess.adapters.base import InputUnit, MediaRef
from mmdata.preprocess.adapters.media_resolution import member_order
from mmdata.dev.synth import generate_records, write_infinity_mm
from mmdata.shard_job.tar_scan import list_tar

# `unit` test by test: the comparison with the system tar runs it

FORMATS = {"gnu": tarfile.GNU_FORMAT, "ustar": tarfile.USTAR_FORMAT, "pax": tarfile.PAX_FORMAT}


def _reference(path: Path) -> tuple[list[tuple[str, int, int]], bool] | str:
    """The listing logic iter_records used before tar_scan (members, and whether damage is
    reported), plus the one deliberate change: a listing that tarfile ends anywhere but at a
    zero (end-of-archive) block - a cut at a header boundary, a bad header - is damage too."""
    members: list[tuple[str, int, int]] = []
    damaged = False
    try:
        with tarfile.open(path, "r:") as tar:
            try:
                for m in tar:
                    if m.isfile():
                        members.append((m.name, m.offset_data, m.size))
            except (tarfile.TarError, EOFError, OSError):
                damaged = True
            stop = tar.offset
    except tarfile.ReadError:
        return "ReadError"
    if not damaged and members and members[-1][1] + members[-1][2] > path.stat().st_size:
        damaged = True
    if not damaged and path.read_bytes()[stop : stop + 512] != bytes(512):
        damaged = True
    return members, damaged


def _listed(path: Path) -> tuple[list[tuple[str, int, int]], bool] | str:
    try:
        listing = list_tar(str(path))
    except tarfile.ReadError:
        return "ReadError"
    return [tuple(m) for m in listing.members], bool(listing.tail_error)


def _fast_path(path: Path) -> list[tuple[str, int, int]]:
    """The header parser alone (no tarfile fallback), so these tests fail if it gives up."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return [tuple(m) for m in tar_scan._scan(fd, os.fstat(fd).st_size)]
    finally:
        os.close(fd)


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    tar.addfile(info, None if info.type not in tarfile.REGULAR_TYPES else io.BytesIO(data))


def _long_names(fmt: int) -> list[str]:
    """Names of 99/100/101/150/250 characters (split by a slash where ustar needs a prefix)."""
    split = ["a/" + "b" * 99, "c" * 49 + "/" + "d" * 100, "e" * 149 + "/" + "f" * 100]
    flat = ["g" * 99, "h" * 100]
    if fmt != tarfile.USTAR_FORMAT:
        flat += ["i" * 101, "j" * 150, "k" * 250, "长名字" * 30 + ".json"]
    return split + flat


def _write_varied(path: Path, fmt: int, samples: int = 60, **open_kw) -> None:
    rng = random.Random(fmt)
    with tarfile.open(path, "w", format=fmt, **open_kw) as tar:
        for i in range(samples):
            _add(tar, f"shard/{i:08d}.json", rng.randbytes(rng.randrange(0, 1500)))
            if i % 3 == 0:
                _add(tar, f"shard/{i:08d}.jpg", rng.randbytes(rng.randrange(1, 3000)))
        _add(tar, "empty.json")
        _add(tar, "empty2.png")
        for n, name in enumerate(_long_names(fmt)):
            _add(tar, name, b"x" * n)
        _add(tar, "图片/样本_001.json", b'{"a": 1}')
        _add(tar, "dir/", type=tarfile.DIRTYPE)
        _add(tar, "olddir/", type=tarfile.AREGTYPE)  # v7 directory: AREGTYPE + trailing slash
        _add(tar, "areg.txt", b"old style file", type=tarfile.AREGTYPE)
        _add(tar, "cont.bin", b"contiguous", type=tarfile.CONTTYPE)
        _add(tar, "link", type=tarfile.SYMTYPE, linkname="shard/00000000.json")
        _add(tar, "hard", type=tarfile.LNKTYPE, linkname="shard/00000001.json")
        _add(tar, "fifo", type=tarfile.FIFOTYPE)
        if fmt != tarfile.USTAR_FORMAT:
            _add(tar, "longlink", type=tarfile.SYMTYPE, linkname="t" * 300)
            _add(tar, "l" * 120, type=tarfile.LNKTYPE, linkname="u" * 130)  # GNU: 'K' then 'L'
        if fmt == tarfile.PAX_FORMAT:
            _add(tar, "float_mtime.json", b"{}", mtime=1.5)  # webdataset-style: a pax header per member
            _add(tar, "pax_size.bin", b"y" * 700, pax_headers={"size": "700", "comment": "hi"})
        _add(tar, "last.json", b"[]")


@pytest.mark.unit
@pytest.mark.parametrize("fmt", FORMATS)
def test_lists_like_tarfile(tmp_path: Path, fmt: str):
    path = tmp_path / f"{fmt}.tar"
    _write_varied(path, FORMATS[fmt])
    expected, damaged = _reference(path)
    assert not damaged and len(expected) > 80
    assert _fast_path(path) == expected
    listing = list_tar(str(path))
    assert [tuple(m) for m in listing.members] == expected and listing.tail_error == ""


@pytest.mark.unit
def test_pax_global_headers(tmp_path: Path):
    harmless, renaming = tmp_path / "g1.tar", tmp_path / "g2.tar"
    _write_varied(harmless, tarfile.PAX_FORMAT, pax_headers={"comment": "made by a test"})
    _write_varied(renaming, tarfile.PAX_FORMAT, pax_headers={"path": "everything.json"})
    assert _fast_path(harmless) == _reference(harmless)[0]
    with pytest.raises(tar_scan._Unusual):  # a global path renames every member: tarfile decides
        _fast_path(renaming)
    assert _listed(renaming) == _reference(renaming)


@pytest.mark.unit
def test_base256_size(tmp_path: Path):
    path = tmp_path / "b256.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "big.bin", b"z" * 1000)
        _add(tar, "after.json", b"{}")
    raw = bytearray(path.read_bytes())
    raw[124:136] = b"\x80" + (1000).to_bytes(11, "big")
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw[:512])
    path.write_bytes(bytes(raw))
    expected = _reference(path)
    assert expected == ([("big.bin", 512, 1000), ("after.json", 2048, 2)], False)
    assert _fast_path(path) == expected[0]


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs a tar binary")
@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar", "v7"])
def test_lists_system_tar_like_tarfile(tmp_path: Path, fmt: str):
    src = tmp_path / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    names = ["a.json", "sub/b.jpg", "sub/deeper/c.png", "empty.json", "样本.json"]
    if fmt in ("gnu", "posix"):
        names += ["n" * 120 + ".json", "sub/" + "m" * 200]
    for i, name in enumerate(names):
        (src / name).write_bytes(bytes(range(256)) * i)
    os.symlink("a.json", src / "sym")
    os.link(src / "a.json", src / "hard")
    path = tmp_path / f"{fmt}.tar"
    subprocess.run(["tar", f"--format={fmt}", "-cf", str(path), "-C", str(src), "."], check=True)
    expected, damaged = _reference(path)
    assert not damaged and len(expected) == len(names)  # the hard link is a link member
    assert _fast_path(path) == expected


def _cut_offsets(size: int) -> list[int]:
    return sorted({max(0, min(size, b + d)) for b in range(0, size + 512, 512) for d in (-1, 0, 1, 150, 300)})


@pytest.mark.unit
@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_copies_match_tarfile(tmp_path: Path, fmt: str):
    src = tmp_path / "src.tar"
    _write_varied(src, FORMATS[fmt], samples=6)
    raw = src.read_bytes()
    cut = tmp_path / "cut.tar"
    damaged_seen = 0
    for n in _cut_offsets(len(raw)):
        cut.write_bytes(raw[:n])
        expected = _reference(cut)
        assert _listed(cut) == expected, f"cut at {n}"
        damaged_seen += expected != "ReadError" and expected[1]
    assert damaged_seen > 50


@pytest.mark.unit
def test_damaged_and_foreign_files(tmp_path: Path):
    src = tmp_path / "src.tar"
    _write_varied(src, tarfile.GNU_FORMAT)
    members = _reference(src)[0]
    raw = bytearray(src.read_bytes())
    raw[members[10][1] - 512 + 150] ^= 0x01  # checksum of the 11th member's header
    bad_sum = tmp_path / "bad_sum.tar"
    bad_sum.write_bytes(bytes(raw))
    assert _listed(bad_sum) == _reference(bad_sum) == (members[:10], True)  # tarfile alone stops silently
    garbage, empty = tmp_path / "garbage.tar", tmp_path / "empty.tar"
    garbage.write_bytes(random.Random(0).randbytes(10_000))
    empty.write_bytes(b"")
    for path in (garbage, empty):
        assert _reference(path) == "ReadError"
        with pytest.raises(tarfile.ReadError):
            list_tar(str(path))
        with pytest.raises(tarfile.ReadError):
            list(infinity_mm.iter_records(InputUnit(0, str(path), path.name, 0, 0)))


# ----------------------------------------------------------------------------- adapter equivalence
# The tarfile-based iter_records as it was before tar_scan, kept verbatim (bar names) as the
# reference: the rewrite must yield the very same records.


@dataclass
class _OldRecord:
    """RawRecord as it was then (media by name through `resolve_media`, own images in tar order)."""

    rid: str
    location: str
    json_bytes: bytes | None
    provenance: dict
    resolve_media: "_OldTarMembers"
    error: str | None = None
    error_detail: str = ""
    default_media: list[str] = field(default_factory=list)


class _OldTarMembers:
    def __init__(self, path: str, members: dict[str, tarfile.TarInfo]):
        self.path, self.members = path, members

    def __call__(self, ref: str) -> MediaRef | None:
        name = ref.replace("\\", "/").rsplit("/", 1)[-1]
        info = self.members.get(ref) or self.members.get(name)
        if info is None:
            return None
        return MediaRef(self.path, info.offset_data, info.size, info.name)


def _old_iter_records(unit: InputUnit) -> Iterator[_OldRecord]:
    _key_of, IMAGE_EXTS = infinity_mm._key_of, infinity_mm.IMAGE_EXTS
    infos: list[tarfile.TarInfo] = []
    json_bytes_of: dict[str, bytes | None] = {}
    tail_error = ""
    with tarfile.open(unit.path, "r:") as tar:
        try:
            for m in tar:
                if m.isfile():
                    infos.append(m)
        except (tarfile.TarError, EOFError, OSError) as e:
            tail_error = f"tar listing stopped after {len(infos)} members: {type(e).__name__}: {e}"
        size = os.path.getsize(unit.path)
        if not tail_error and infos and infos[-1].offset_data + infos[-1].size > size:
            tail_error = f"file ends inside member {infos[-1].name!r}: truncated tar ({size} bytes)"
        for m in infos:
            if m.name.lower().endswith(".json"):
                try:
                    f = tar.extractfile(m)
                    json_bytes_of[m.name] = f.read() if f else b""
                except (tarfile.TarError, EOFError, OSError):
                    json_bytes_of[m.name] = None
    members = {m.name: m for m in infos}
    resolver = _OldTarMembers(unit.path, members)
    groups: dict[str, list[tarfile.TarInfo]] = {}
    order: list[str] = []
    for m in infos:
        key, _ = _key_of(m.name)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(m)
    for index, key in enumerate(order):
        group = groups[key]
        jsons = [m for m in group if _key_of(m.name)[1] == "json"]
        images = [m.name for m in group if m.name.lower().endswith(IMAGE_EXTS)]
        prov = {"dataset": "infinity-mm", "file": unit.rel, "member": key, "index": index}
        if not jsons:
            yield _OldRecord(
                f"{unit.rel}:{key}",
                f"{unit.path}:{key}",
                None,
                prov,
                resolver,
                error="json_missing",
                error_detail=f"members {[m.name for m in group]} have no .json",
                default_media=images,
            )
            continue
        jm = jsons[0]
        prov["member"] = jm.name
        data = json_bytes_of[jm.name]
        yield _OldRecord(
            f"{unit.rel}:{jm.name}",
            f"{unit.path}:{jm.name}",
            data,
            prov,
            resolver,
            error=None if data is not None else "input_truncated",
            error_detail="" if data is not None else f"{jm.name}: data cut short",
            default_media=images,
        )
    if tail_error:
        prov = {"dataset": "infinity-mm", "file": unit.rel, "member": "<rest of file>", "index": len(order)}
        yield _OldRecord(
            f"{unit.rel}:<rest>",
            f"{unit.path}:<after member {len(infos)}>",
            None,
            prov,
            resolver,
            error="input_truncated",
            error_detail=tail_error,
        )


def _assert_same_records(unit: InputUnit, cut: bool = False) -> int:
    """Same records as the old code; for a cut file (`cut`), the new code may add the one
    `<rest>` record the old code missed when the cut fell on a header boundary."""
    old, new = list(_old_iter_records(unit)), list(infinity_mm.iter_records(unit))
    fields = ("rid", "location", "json_bytes", "provenance", "error", "error_detail")
    if cut and new[-1].rid.endswith(":<rest>") and not old[-1].rid.endswith(":<rest>"):
        new = new[:-1]
    assert [[getattr(r, f) for f in fields] for r in new] == [[getattr(r, f) for f in fields] for r in old]
    # the same own images, now in webdataset numbering order ({stem}.jpg, {stem}.1.png, ...)
    assert [r.own_images for r in new] == [member_order(r.default_media) for r in old]
    with tarfile.open(unit.path, "r:") as tar:
        try:
            names = [m.name for m in tar] + ["nope.jpg", "dir/00000000.json"]
        except tarfile.TarError:
            names = [m.name for m in tar.members]
    for r_old, r_new in zip(old, new):
        for ref in names:  # exact member names resolve as before (basenames: media_resolution's rules)
            if ref in r_old.resolve_media.members:
                assert r_new.locator.by_name(ref) == r_old.resolve_media(ref)
            else:
                assert r_new.locator.by_name(ref) is None
    return len(new)


@pytest.mark.unit
def test_iter_records_unchanged(tmp_path: Path):
    files = write_infinity_mm(
        generate_records(60, seed=0, broken_fraction=0.2, synthetic=True), tmp_path / "raw", samples_per_tar=20
    )
    units = infinity_mm.list_units([tmp_path / "raw"])
    assert len(units) == len(files) and sum(_assert_same_records(u) for u in units) >= 60
    # a hand-made tar with orphan images, duplicate names, upper-case and dotted suffixes
    odd = tmp_path / "odd.tar"
    members = [
        ("a.json", b"{}"),
        ("a.jpg", b"j"),
        ("b.png", b"p"),
        ("c.JSON", b"[1]"),
        ("c.x.json", b"2"),
        ("a.jpg", b"j2"),
        ("d/e.1.webp", b"w"),
        ("d/e.json", b"{}"),
    ]
    with tarfile.open(odd, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            _add(tar, name, data)
    _assert_same_records(InputUnit(0, str(odd), odd.name, 0, 0))
    # a repeated JSON member is a changed rule: every copy is a `duplicate_key` record (the old
    # code silently took the first), the other samples are unchanged
    with tarfile.open(odd, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members + [("a.json", b'{"dup": 1}')]:
            _add(tar, name, data)
    records = list(infinity_mm.iter_records(InputUnit(0, str(odd), odd.name, 0, 0)))
    assert [(r.location.rsplit(":", 1)[1], r.error) for r in records if r.provenance["member"] == "a.json"] == [
        ("a.json", "duplicate_key")
    ] * 2
    # truncated copies of one synthetic tar: inside headers, JSON data, image data, the end blocks
    raw = Path(units[0].path).read_bytes()
    cut = tmp_path / "cut.tar"
    for n in list(range(600, len(raw), 997)) + [len(raw) - 1024, len(raw) - 700, len(raw) - 1]:
        cut.write_bytes(raw[:n])
        _assert_same_records(InputUnit(1, str(cut), cut.name, n, 0), cut=True)


@pytest.mark.unit
def test_chunk_samples_read_by_the_tar_index_equal_the_full_listing(tmp_path: Path):
    """tokenize-images reads a chunk's samples by their byte range from the shard's `.tar.idx`:
    the same samples as slicing the whole listing, for any range; and with the index missing,
    short, or pointing elsewhere (not at those samples' headers), the whole listing decides."""
    from mmdata.shard_job.energon_meta import write_tar_index
    from mmdata.shard_job.shard_writer import SampleMembers, write_shard
    from mmdata.shard_job.shard_samples import chunk_samples, indexed_samples, shard_samples

    path = tmp_path / "shard-000000.tar"
    samples = [
        SampleMembers(
            f"{i:010d}", [("json", b"{}" * (i % 5)), *[(f"img{j:02d}.jpg", b"x" * (i + j)) for j in range(i % 3)]]
        )
        for i in range(40)
    ]
    _, layout = write_shard(path, samples, direct=False)
    write_tar_index(path, layout)
    idx = path.with_name("shard-000000.tar.idx")
    full = shard_samples(path)
    assert len(full) == 40
    ranges = [(0, 40), (0, 1), (3, 17), (39, 40), (20, 20)]
    for start, stop in ranges:
        assert indexed_samples(path, start, stop) == chunk_samples(path, start, stop) == full[start:stop]
    good = idx.read_bytes()
    for damaged in (b"", good[:80], good[8:] + good[:8], bytes(len(good))):  # none, short, shifted, zeros
        idx.write_bytes(damaged)
        for start, stop in ranges:
            assert indexed_samples(path, start, stop) is None
            assert chunk_samples(path, start, stop) == full[start:stop]
    idx.unlink()
    assert chunk_samples(path, 5, 9) == full[5:9]
    # a range that does not end at a header (the fast path refuses it; the caller lists the file)
    assert tar_scan.list_tar_range(str(path), 0, layout.samples[1][1] + 1) is None
