"""Hostile inputs through `mmdata preprocess`, for both input layouts: every hostile record ends
in its named quarantine reason, every valid one (odd image modes included) is written, the
counts reconcile, and nothing is written outside the output folder. Odd but valid images decode
in the loader exactly as transformers' LLaVA-OneVision image processor decodes them.
The cases are generated in tests/hostile_inputs.py; docs/reliability.md lists them."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from mmdata import shard_format as sf
from mmdata.energon_loaders.llava_ov import anyres
from mmdata.preprocess.validation import REASONS, ValidationConfig, check_image
from tests import hostile_inputs as hi
from tests.fixtures_preprocess import run_preprocess_cli


def _tree(root: Path, skip: Path) -> dict[str, int]:
    """Every path under `root` outside `skip`, with its size (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in filenames + dirnames:
            p = Path(dirpath, name)
            out[str(p.relative_to(root))] = p.lstat().st_size if not p.is_dir() else -1
    return out


@pytest.mark.parametrize("layout", ["infinity-mm", "llava-json"])
def test_hostile_inputs_end_in_named_reasons(layout, tmp_path):
    root, raw, out = tmp_path, tmp_path / "raw", tmp_path / "out"
    if layout == "infinity-mm":
        expect, where, read = hi.write_infinity_mm(raw)
    else:
        expect, where, read = hi.write_llava_json(raw, tmp_path / "outside")
    before = _tree(root, out)
    # The inputs are mostly hostile by construction: the fail-fast check would stop the job.
    proc = run_preprocess_cli(
        "--dataset",
        layout,
        "--input",
        str(raw),
        "--output",
        str(out),
        "--num-cpus",
        "2",
        "--max-quarantine-fraction",
        "1",
    )
    assert proc.returncode == 0
    assert _tree(root, out) == before, "something was written outside --output"

    quarantine = [json.loads(line) for line in (out / sf.QUARANTINE_NAME).read_text().splitlines()]
    got: Counter[tuple[str, str]] = Counter()
    for line in quarantine:
        assert line["reason"] in REASONS and line["detail"], line
        keys = [k for k in expect if line["source_location"].endswith("/" + k)]
        assert len(keys) == 1, line
        got[(keys[0], line["reason"])] += 1
    wanted = Counter({(k, r): 1 for k, r in expect.items() if r is not None})
    if layout == "infinity-mm":
        wanted[(where["duplicate_key"], "duplicate_key")] = 2  # both copies of the key, none taken
    assert got == wanted

    m = json.loads((out / sf.MANIFEST_NAME).read_text())
    c = m["counts"]
    kept = [k for k, r in expect.items() if r is None]
    assert (c["read"], c["written"], c["quarantined"]) == (read, len(kept), read - len(kept))
    assert c["by_reason"] == dict(Counter(r for (_, r), n in wanted.items() for _ in range(n)))
    assert sum(s["samples"] for s in m["shards"]) == len(kept)

    # every valid case is in the shards once; the same id from two inputs is kept twice
    ids: Counter[str] = Counter()
    suffixes: dict[str, list[str]] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            names = tar.getnames()
            for info in tar.getmembers():
                if info.name.endswith("." + sf.JSON_MEMBER):
                    rid = json.loads(tar.extractfile(info).read())["id"]
                    ids[rid] += 1
                    key = info.name.split(".", 1)[0]
                    suffixes[rid] = sorted(n.split(".", 1)[1] for n in names if n.startswith(key + "."))
    valid = {c.kind for c in hi.cases() if c.expect is None}
    same_id = "same_id_across_inputs" if layout == "infinity-mm" else "same_id"
    assert ids == Counter({**{k: 1 for k in valid}, same_id: 2})
    assert suffixes["png_named_jpg"] == ["img00.png", "json"]  # stored under its real format
    assert suffixes["animated_gif"] == ["img00.gif", "json"]


@pytest.mark.unit
@pytest.mark.parametrize("name", list(hi.ODD_VALID_IMAGES))
def test_odd_images_are_kept_and_decode_as_the_reference_processor(name):
    """CMYK, 16-bit, palette + transparency, animated (first frame) and EXIF-rotated images: the
    validator keeps them, and the loader's pixels equal LlavaOnevisionImageProcessor's on the
    same decoded file (which, like ours, does not apply the EXIF orientation)."""
    from tests.llava_tiny import hf_image_processor

    data = hi.ODD_VALID_IMAGES[name]()
    _, w, h, _ = check_image(data, name, ValidationConfig())
    with Image.open(io.BytesIO(data)) as im:  # as the task encoder opens a media member
        im.load()
        ours = anyres.process_image(im)
    with Image.open(io.BytesIO(data)) as im:
        ref = hf_image_processor()(im, return_tensors="pt")["pixel_values"][0]
    assert ours.image_size == (h, w)
    assert ours.pixel_values.shape == ref.shape
    assert (ours.pixel_values - ref).abs().max().item() <= 1e-5
