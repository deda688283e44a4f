"""Media resolution as the published Infinity-MM tars need it (no Ray): the record's `image`
field is provenance, so entries resolve by exact member name, then basename, then the sample's
own `{stem}.*` members in member order; plus the llava-json start-up check with its
`--image-root` hint."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from PIL import Image

from mmdata.preprocess.adapters import infinity_mm, llava_json
from mmdata.preprocess.adapters.base import InputUnit
from mmdata.preprocess.adapters.media_resolution import member_order
from mmdata.preprocess.validation import Invalid, Valid, ValidationConfig, validate
from tests.fixtures_preprocess import run_preprocess

CONV = [{"from": "human", "value": "What is this?"}, {"from": "gpt", "value": "A square."}]
FOREIGN = "/mnt/hpfs/producer/llava_ov/images"


def _img(fmt: str, color: tuple[int, int, int], size=(24, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


JPG, PNG, WEBP = _img("JPEG", (200, 10, 10)), _img("PNG", (10, 200, 10)), _img("WEBP", (10, 10, 200))


def _tar(path: Path, members: list[tuple[str, bytes | dict]]) -> InputUnit:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            raw = json.dumps(data).encode() if isinstance(data, dict) else data
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return InputUnit(0, str(path), path.name, path.stat().st_size, 0)


def _rec(rid: str, **fields) -> dict:
    return {"id": rid, "conversations": [dict(t) for t in CONV], **fields}


def _foreign_images_rec(rid: str, names: list[str], question: str) -> dict:
    """A record of several images under the producer's folder, asked about in one turn."""
    conversations = [{"from": "human", "value": question}, {"from": "gpt", "value": "ok"}]
    return _rec(rid, image=[f"{FOREIGN}/{name}" for name in names], conversations=conversations)


def _validated(tmp_path: Path, members) -> dict[str, Valid | Invalid]:
    unit = _tar(tmp_path / "x.tar", members)
    return {raw.rid.rsplit(":", 1)[1]: validate(raw, ValidationConfig()) for raw in infinity_mm.iter_records(unit)}


def test_rules_in_order(tmp_path):
    members = [
        # foreign absolute path, other basename and extension: the sample's own member (by stem)
        ("a.json", _rec("a", image=f"{FOREIGN}/0001234_a.jpeg")),
        ("a.png", PNG),
        # exact member name (an explicit locator, even of another sample's member)
        ("b.json", _rec("b", image="a.png")),
        ("b.jpg", JPG),
        # basename under a foreign folder
        ("c.json", _rec("c", image=f"{FOREIGN}/c.webp")),
        ("c.webp", WEBP),
        # multi-image: foreign entries map in order onto {stem}.jpg, {stem}.1.png, {stem}.2.webp,
        # even though the tar holds them in name order (d.1.png, d.2.webp, d.jpg)
        ("d.json", _foreign_images_rec("d", ["x.jpg", "y.jpg", "z.jpg"], "<image><image><image>?")),
        ("d.1.png", PNG),
        ("d.2.webp", WEBP),
        ("d.JPG", JPG),
        # one entry by basename claims its member; the foreign one takes the member left over
        ("e.json", _foreign_images_rec("e", ["q.jpg", "e.1.png"], "<image> vs <image>")),
        ("e.jpg", JPG),
        ("e.1.png", PNG),
        # a basename that is another sample's member never displaces the sample's own image
        ("f.json", _rec("f", image=f"{FOREIGN}/a.png")),
        ("f.webp", WEBP),
        # no own member at all: a unique basename elsewhere in the tar is used
        ("g.json", _rec("g", image=f"{FOREIGN}/c.webp")),
        # no `image` field: the sample's own members are its images
        ("h.json", _rec("h")),
        ("h.png", PNG),
    ]
    res = _validated(tmp_path, members)
    expect = {
        "a": ("by_stem", ["a.png"]),
        "b": ("by_name", ["a.png"]),
        "c": ("by_basename", ["c.webp"]),
        "d": ("by_stem", ["d.JPG", "d.1.png", "d.2.webp"]),
        "e": ("by_stem", ["e.jpg", "e.1.png"]),
        "f": ("by_stem", ["f.webp"]),
        "g": ("by_basename", ["c.webp"]),
        "h": ("by_stem", ["h.png"]),
    }
    for stem, (rule, names) in expect.items():
        v = res[f"{stem}.json"]
        assert isinstance(v, Valid), (stem, v)
        assert v.media_rule == rule and [m.name for m, _ in v.media] == names, stem
        assert v.record["provenance"].get("media_resolution") == rule
    d = res["d.json"].record
    assert d["images"] == ["img00.jpg", "img01.png", "img02.webp"]  # suffixes from the real formats
    assert d["provenance"]["source_image"] == [f"{FOREIGN}/x.jpg", f"{FOREIGN}/y.jpg", f"{FOREIGN}/z.jpg"]
    assert "source_image" not in res["h.json"].record["provenance"]


def test_edge_cases(tmp_path):
    members = [
        # more entries than members: the third has no member -> image_missing, saying why
        ("a.json", _foreign_images_rec("a", ["1.jpg", "2.jpg", "3.jpg"], "<image><image><image>")),
        ("a.jpg", JPG),
        ("a.1.png", PNG),
        # fewer entries than members: the extra member is counted as unreferenced
        ("b.json", _rec("b", image=f"{FOREIGN}/b.jpg")),
        ("b.jpg", JPG),
        ("b.1.png", PNG),
        # explicitly text-only with a stray image member: stays text-only
        ("c.json", _rec("c", image="")),
        ("c.png", PNG),
        ("d.json", _rec("d", image=None)),
        ("d.png", PNG),
        # truly no usable member
        ("e.json", _rec("e", image=f"{FOREIGN}/e.jpg")),
        ("e.txt", b"not an image"),
    ]
    res = _validated(tmp_path, members)
    a = res["a.json"]
    assert isinstance(a, Invalid) and a.reason == "image_missing"
    assert f"{FOREIGN}/3.jpg" in a.detail and "a.jpg, a.1.png" in a.detail and "3 image entries" in a.detail
    b = res["b.json"]
    assert isinstance(b, Valid) and [m.name for m, _ in b.media] == ["b.jpg"] and b.unreferenced_members == 1
    for stem in "cd":
        v = res[f"{stem}.json"]
        assert isinstance(v, Valid) and v.media == [] and v.media_rule is None and v.unreferenced_members == 1
        assert v.record["conversations"] == CONV
    assert isinstance(res["e.json"], Invalid) and res["e.json"].reason == "image_missing"


def test_member_order():
    assert member_order(["s.10.png", "s.2.png", "s.jpg", "s.1.webp"]) == ["s.jpg", "s.1.webp", "s.2.png", "s.10.png"]
    assert member_order(["d/s.left.png", "d/s.png", "d/s.right.jpg"]) == ["d/s.png", "d/s.left.png", "d/s.right.jpg"]


def test_llava_json_image_root_hint(tmp_path):
    """Image paths relative to a folder above the annotation file: stop at start-up (before any
    Ray work) naming the folder that works; with it the job resolves them."""
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "images" / "x.png").write_bytes(PNG)
    ann = data / "annotations" / "train.jsonl"
    ann.parent.mkdir()
    ann.write_text(json.dumps(_rec("a", image="images/x.png")) + "\n" + json.dumps(_rec("b")) + "\n")
    units = llava_json.list_units([ann], None)
    problem = llava_json.check_image_root(units)
    assert problem and "images/x.png" in problem and f"--image-root {data}" in problem
    assert llava_json.check_image_root(llava_json.list_units([ann], data)) is None
    proc = run_preprocess(ann, tmp_path / "out", dataset="llava-json", check=False)
    assert proc.returncode == 2 and f"--image-root {data}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
