"""Hostile inputs generated on the fly, for both input layouts (docs/reliability.md).

Each `Case` is one record (or a few) built to break something: broken or adversarial images and
videos, malformed records, hostile tar members, paths that lead out of the input. `expect` is
the quarantine reason it must end in, or None when it is valid input that must go through
(CMYK, 16-bit, palette, animated, EXIF-rotated images, an image under the wrong extension).
`write_infinity_mm` / `write_llava_json` lay the same cases out in each layout and return where
each case's quarantine line must point (its `source_location` ending)."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image


def _png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG", **kw)
    return buf.getvalue()


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _rgb(h: int = 30, w: int = 40, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_from_rows(w: int, h: int, depth: int, color_type: int, idat: bytes) -> bytes:
    """A PNG with the given header and (already deflated) image data, CRCs correct."""
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def decompression_bomb() -> bytes:
    """10000 x 10000 1-bit pixels (100 Mpx, over Pillow's 89 Mpx default) in ~15 kB."""
    w = h = 10_000
    z = zlib.compressobj(9)
    row = bytes(1 + w // 8)
    data = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return png_from_rows(w, h, 1, 0, data)


def huge_declared_png() -> bytes:
    """A 100 kB-free file declaring 100000 x 100000 pixels."""
    return png_from_rows(100_000, 100_000, 8, 2, zlib.compress(b"\0" * 64))


def huge_declared_jpeg() -> bytes:
    """A small JPEG whose frame header is rewritten to 65000 x 65000."""
    data = bytearray(_encode(_rgb(16, 16), "JPEG"))
    sof = data.find(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 65000, 65000)
    return bytes(data)


def exif_rotated_jpeg() -> bytes:
    """A 40 x 30 photo whose EXIF says "rotate 90° CW to display" (orientation 6)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return _encode(_rgb(30, 40, 5), "JPEG", exif=exif.tobytes())


def animated(fmt: str) -> bytes:
    frames = [_rgb(24, 32, s) for s in range(3)]
    if fmt == "GIF":
        frames = [f.convert("P") for f in frames]
    return _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)


def palette_with_transparency() -> bytes:
    img = _rgb(20, 28, 3).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return _png(img, transparency=0)


def sixteen_bit_png() -> bytes:
    arr = np.random.default_rng(4).integers(0, 65536, (20, 30), dtype=np.uint16)
    return _png(Image.fromarray(arr))


def cmyk_jpeg() -> bytes:
    return _encode(_rgb(30, 20, 6).convert("CMYK"), "JPEG")


def good_jpeg(seed: int = 0) -> bytes:
    return _encode(_rgb(30, 40, seed), "JPEG")


# Images that are valid input (kept) and must decode in the loader exactly as the reference
# processor decodes them. (name, bytes factory)
ODD_VALID_IMAGES = {
    "cmyk_jpeg": cmyk_jpeg,
    "16bit_png": sixteen_bit_png,
    "palette_transparency_png": palette_with_transparency,
    "animated_gif": lambda: animated("GIF"),
    "animated_png": lambda: animated("PNG"),
    "animated_webp": lambda: animated("WEBP"),
    "exif_rotated_jpeg": exif_rotated_jpeg,
}


@dataclass
class Case:
    kind: str
    expect: str | None  # quarantine reason, None: kept
    record: dict | bytes | None = None  # None: the default one-image record; bytes: raw JSON text
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (extension, bytes)
    video: tuple[str, bytes] | None = None
    layouts: tuple[str, ...] = ("infinity-mm", "llava-json")


def _turns(*values: str) -> list[dict]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": v} for i, v in enumerate(values)]


def _conversation_case(kind: str, expect: str | None, conversations: list[dict], **more) -> Case:
    """A case whose record is its kind as id and these conversations."""
    return Case(kind, expect, record={"id": kind, "conversations": conversations}, **more)


def default_record(kind: str, n_images: int = 1) -> dict:
    return {
        "id": kind,
        "source": "hostile",
        "conversations": _turns("<image>" * n_images + "\nWhat is this?", "A test."),
    }


def cases() -> list[Case]:
    good = good_jpeg
    out = [
        Case("good_a", None, images=[("jpg", good(1))]),
        Case("good_b", None, images=[("jpg", good(2))]),
        Case("png_named_jpg", None, images=[("jpg", _png(_rgb()))]),
        Case("text_named_jpg", "image_undecodable", images=[("jpg", b"this is not an image at all\n")]),
        Case("garbage_png", "image_undecodable", images=[("png", np.random.default_rng(9).bytes(3000))]),
        Case("truncated_png", "image_truncated", images=[("png", _png(_rgb(60, 60))[:-400])]),
        Case("zero_byte_png", "image_empty", images=[("png", b"")]),
        Case("decompression_bomb_png", "image_too_large", images=[("png", decompression_bomb())]),
        Case("huge_declared_png", "image_too_large", images=[("png", huge_declared_png())]),
        Case("huge_declared_jpeg", "image_too_large", images=[("jpg", huge_declared_jpeg())]),
        *(
            Case(name, None, images=[(ext, make())])
            for name, make, ext in (
                (
                    n,
                    f,
                    {
                        "cmyk_jpeg": "jpg",
                        "16bit_png": "png",
                        "palette_transparency_png": "png",
                        "animated_gif": "gif",
                        "animated_png": "png",
                        "animated_webp": "webp",
                        "exif_rotated_jpeg": "jpg",
                    }[n],
                )
                for n, f in ODD_VALID_IMAGES.items()
            )
        ),
        _conversation_case(
            "video_garbage",
            "video_undecodable",
            _turns("<video>\nWhat happens?", "Nothing."),
            video=("mp4", b"\x00\x00\x00\x18ftypmp42" + bytes(200)),
        ),
        _conversation_case(
            "video_zero_byte", "video_empty", _turns("<video>\nWhat happens?", "Nothing."), video=("mp4", b"")
        ),
        Case(
            "bad_utf8",
            "json_malformed",
            record=b'{"id": "bad_utf8", "conversations": [{"from": "human", "value": "\xff\xfe hi"}, '
            b'{"from": "gpt", "value": "x"}]}',
        ),
        Case(
            "lone_surrogate",
            "json_malformed",
            record=b'{"id": "lone_surrogate", "conversations": [{"from": "human", "value": "\\ud800"}, '
            b'{"from": "gpt", "value": "x"}]}',
        ),
        Case("json_syntax", "json_malformed", record=b'{"id": "json_syntax", "conversations": [}'),
        Case("not_an_object", "schema_invalid", record=b'["a", "list"]'),
        Case("id_ill_typed", "schema_invalid", record={"id": ["x"], "conversations": _turns("hi", "yo")}),
        Case(
            "image_ill_typed",
            "schema_invalid",
            record={"id": "image_ill_typed", "image": 7, "conversations": _turns("hi", "yo")},
        ),
        Case("no_conversations", "conversation_malformed", record={"id": "no_conversations"}),
        _conversation_case(
            "value_ill_typed", "conversation_malformed", [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]
        ),
        _conversation_case(
            "unknown_role", "conversation_malformed", [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "x"}]
        ),
        _conversation_case(
            "not_alternating", "conversation_malformed", _turns("hi", "yo") + _turns("hi again")[:1] * 2
        ),
        _conversation_case(
            "gpt_first", "conversation_malformed", [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]
        ),
        _conversation_case("too_many_turns", "conversation_too_long", _turns(*(["q", "a"] * 501))),
        _conversation_case("too_many_chars", "conversation_too_long", _turns("q", "a" * 4_000_001)),
        Case(
            "more_tags_than_images",
            "placeholder_mismatch",
            record=default_record("more_tags_than_images", 2),
            images=[("jpg", good(3))],
        ),
        Case(
            "fewer_tags_than_images",
            "placeholder_mismatch",
            record=default_record("fewer_tags_than_images", 1),
            images=[("jpg", good(4)), ("jpg", good(5))],
        ),
        _conversation_case(
            "tag_in_gpt_turn", "placeholder_mismatch", _turns("Look.", "<image> here"), images=[("jpg", good(6))]
        ),
    ]
    return out


def _record_obj(case: Case) -> dict | bytes:
    return default_record(case.kind, len(case.images)) if case.record is None else case.record


def _json_bytes(obj: dict | bytes) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0
    tar.addfile(info, io.BytesIO(data))


def write_infinity_mm(root: Path) -> tuple[dict[str, str | None], dict[str, str], int]:
    """Two tars under `root/stage1/hostile/`: every case as `{stem}.json` + its media members,
    plus the tar-level hostile members. Returns ({location suffix: expected reason}, {kind:
    location suffix}, records read)."""
    folder = root / "stage1" / "hostile"
    folder.mkdir(parents=True)
    expect: dict[str, str | None] = {}
    where: dict[str, str] = {}
    with tarfile.open(folder / "000000.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for i, case in enumerate(c for c in cases() if "infinity-mm" in c.layouts):
            stem = f"{i:06d}"
            obj = _record_obj(case)
            if isinstance(obj, dict) and case.video:
                obj = {**obj, "video": f"{stem}.{case.video[0]}"}
            _add(tar, f"{stem}.json", _json_bytes(obj))
            for k, (ext, data) in enumerate(case.images):
                _add(tar, f"{stem}.{ext}" if k == 0 else f"{stem}.{k}.{ext}", data)
            if case.video:
                _add(tar, f"{stem}.{case.video[0]}", case.video[1])
            where[case.kind] = f"000000.tar:{stem}.json"
            expect[where[case.kind]] = case.expect
        # hostile members: names leaving the folder, a duplicated key, a symlink member
        for name, kind in (("../escape", "dotdot_member"), ("/abs/escape", "absolute_member")):
            _add(tar, f"{name}.json", _json_bytes(default_record(kind)))
            _add(tar, f"{name}.jpg", good_jpeg(7))
            where[kind] = f"000000.tar:{name}.json"
            expect[where[kind]] = "unsafe_member_name"
        for copy in range(2):
            _add(tar, "dupkey.json", _json_bytes(default_record(f"duplicate_key_{copy}")))
        _add(tar, "dupkey.jpg", good_jpeg(8))
        where["duplicate_key"] = "000000.tar:dupkey.json"
        expect[where["duplicate_key"]] = "duplicate_key"  # (two records, one location)
        link = tarfile.TarInfo("symlink.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
        _add(tar, "symlink.json", _json_bytes({**default_record("symlink_member"), "image": "symlink.jpg"}))
        where["symlink_member"] = "000000.tar:symlink.json"
        expect[where["symlink_member"]] = "image_missing"
        _add(tar, "sameid.json", _json_bytes(default_record("same_id_across_inputs")))
        _add(tar, "sameid.jpg", good_jpeg(9))
        expect["000000.tar:sameid.json"] = None
    with tarfile.open(folder / "000001.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "sameid.json", _json_bytes(default_record("same_id_across_inputs")))
        _add(tar, "sameid.jpg", good_jpeg(10))
        expect["000001.tar:sameid.json"] = None
    read = len(expect) + 1  # the duplicated key is two records
    return expect, where, read


def write_llava_json(root: Path, outside: Path) -> tuple[dict[str, str | None], dict[str, str], int]:
    """`root/data.jsonl` (+ `root/images/`, `root/videos/`) with every case, the path-escape
    cases (`../`, absolute, a symlink leaving the image root) and a whole .json file that is
    not JSON. `outside` is a folder beside `root` holding a real image."""
    (root / "images").mkdir(parents=True)
    (root / "videos").mkdir()
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "secret.jpg").write_bytes(good_jpeg(11))
    (root / "images" / "link.jpg").symlink_to(outside / "secret.jpg")
    expect: dict[str, str | None] = {}
    where: dict[str, str] = {}
    lines: list[tuple[str, str | None, bytes]] = []
    for i, case in enumerate(c for c in cases() if "llava-json" in c.layouts):
        obj = _record_obj(case)
        names = []
        for k, (ext, data) in enumerate(case.images):
            names.append(f"images/{i:04d}_{k}.{ext}")
            (root / names[-1]).write_bytes(data)
        if isinstance(obj, dict) and names:
            obj = {**obj, "image": names[0] if len(names) == 1 else names}
        if isinstance(obj, dict) and case.video:
            (root / "videos" / f"{i:04d}.{case.video[0]}").write_bytes(case.video[1])
            obj = {**obj, "video": f"videos/{i:04d}.{case.video[0]}"}
        lines.append((case.kind, case.expect, _json_bytes(obj)))
    for kind, ref in (
        ("dotdot_image", f"../{outside.name}/secret.jpg"),
        ("absolute_image", str(outside / "secret.jpg")),
        ("symlink_image", "images/link.jpg"),
    ):
        lines.append((kind, "media_outside_input", _json_bytes({**default_record(kind), "image": ref})))
    lines.append(("same_id_a", None, _json_bytes({**default_record("same_id"), "image": "images/0000_0.jpg"})))
    with open(root / "data.jsonl", "wb") as f:
        for n, (kind, reason, data) in enumerate(lines, start=1):
            f.write(data.replace(b"\n", b" ") + b"\n")
            where[kind] = f"data.jsonl:{n}"
            expect[where[kind]] = reason
    (root / "other.json").write_text(json.dumps([{**default_record("same_id"), "image": "images/0001_0.jpg"}]))
    expect["other.json[0]"] = None
    (root / "broken.json").write_bytes(b'[{"id": "whole_file", "conversations": ')
    expect["broken.json"] = "json_malformed"
    return expect, where, len(expect)
