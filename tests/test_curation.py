"""Offline curation without Ray: the perceptual hash against imagehash's."""

from __future__ import annotations

import functools
import io
import operator

import imagehash
import numpy as np
import pytest
from PIL import Image

from mmdata.preprocess.curation.phash import _dct_rows, phash, phash_bytes
from mmdata.dev.synth import generate_records

pytestmark = pytest.mark.unit


def _imagehash_int(img: Image.Image) -> int:
    return int(str(imagehash.phash(img)), 16)


def _textured(i: int) -> Image.Image:
    img = Image.effect_mandelbrot((160 + i * 13, 120 + i * 7), (-2 + i * 0.02, -1.2, 0.8, 1.4), 30 + i).convert("RGB")
    noise = Image.effect_noise(img.size, 20 + i)
    return Image.merge("RGB", (noise, img.getchannel(1), img.getchannel(2))) if i % 2 else img


def test_phash_equals_imagehash():
    """Bit-equal on textured images (also after JPEG/WebP round trips, from bytes); on the
    synthetic gradients, any differing bit is a coefficient that ties with the median within
    float rounding, where imagehash's own bit is rounding noise."""
    for i in range(12):
        img = _textured(i)
        assert phash(img) == _imagehash_int(img), i
        for fmt in ("JPEG", "WEBP", "PNG"):
            buf = io.BytesIO()
            img.save(buf, format=fmt)
            assert phash_bytes(buf.getvalue()) == _imagehash_int(Image.open(io.BytesIO(buf.getvalue()))), (i, fmt)
    c = _dct_rows()
    checked = 0
    for rec in generate_records(60, seed=5, synthetic=True):
        for im in rec.images:
            img = Image.open(io.BytesIO(im.data))
            diff = phash(img) ^ _imagehash_int(img)
            checked += 1
            if diff:
                px = np.asarray(img.convert("L").resize((32, 32), Image.Resampling.LANCZOS), dtype=np.float64)
                low = (c @ px @ c.T).ravel()
                near = np.abs(low - np.median(low)) <= 1e-9 * np.abs(low).max()
                bits = [63 - b for b in range(64) if diff >> b & 1]  # bit 63 is coefficient 0
                assert all(near[b] for b in bits), (rec.id, bits)
    assert checked > 50


# ----------------------------------------------------------------------------- dedup (no Ray)


def _brute_force(recs: list[dict], distance: int) -> dict[int, int]:
    """{dropped record: its best near neighbour}, O(N^2): the definition dedup must meet."""

    def prio(r):
        return (-r["pixels"], r["idkey"], r["ridkey"], 0, r["ord"])

    def near(a, b):
        return (
            len(a["h"]) == len(b["h"])
            and a["text"] == b["text"]
            and all(bin(x ^ y).count("1") <= distance for x, y in zip(a["h"], b["h"]))
        )

    out = {}
    for a in recs:
        better = [b for b in recs if b is not a and near(a, b) and prio(b) < prio(a)]
        if better:
            out[a["ord"]] = min(better, key=prio)["ord"]
    return out


def _clustered_records(rng: np.random.Generator, n: int) -> list[dict]:
    """Records in clusters of near hashes (flips of 0..6 bits), some multi-image, two texts."""
    recs = []
    centers = [int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2)) for _ in range(n // 6)]
    for i in range(n):
        c = centers[int(rng.integers(0, len(centers)))]
        h = c
        for b in rng.choice(64, size=int(rng.integers(0, 7)), replace=False):
            h ^= 1 << int(b)
        hashes = [h] if rng.random() < 0.8 else [h, c ^ 1, 12345]
        recs.append(
            {
                "h": hashes,
                "text": int(rng.integers(0, 2)),
                "pixels": int(rng.choice([100, 200])),
                "idkey": int(rng.integers(0, 4)),
                "ridkey": int(rng.integers(0, 2**63)),
                "ord": i,
            }
        )
    return recs


def test_lsh_dedup_equals_brute_force(tmp_path):
    """Banding finds every pair within D (pigeonhole), the marks name the best neighbour, and
    the result does not depend on the number of partitions or how records are spread over files."""
    from mmdata.preprocess.curation import dedup as dd

    rng = np.random.default_rng(0)
    recs = _clustered_records(rng, 240)
    for distance in (0, 2, 4, 8):
        want = _brute_force(recs, distance)
        assert want and (distance == 0 or len(want) > len(_brute_force(recs, 0)))
        for partitions, files in ((1, 1), (5, 3)):
            work = tmp_path / f"d{distance}p{partitions}"
            (work / "dedup").mkdir(parents=True)
            builders = [dd.EntryBuilder(distance, "record") for _ in range(files)]
            for r in recs:
                unit = r["ord"] % files
                builders[unit].add(
                    r["h"],
                    r["text"],
                    r["pixels"],
                    r["idkey"],
                    r["ridkey"],
                    unit,
                    r["ord"],
                    key=int(rng.integers(0, 2**63)),
                    group=0,
                )
            for u, b in enumerate(builders):
                b.save(work, u, partitions)
            for p in range(partitions):
                dd.dedup_partition(p, files, 2, distance, str(work))
            got = {}
            for bucket in range(2):
                dd.resolve_bucket(bucket, partitions, str(work))
                got.update({o: nb[1] for (_, o), nb in dd.load_drops(str(work), bucket).items()})
            assert got == want, (distance, partitions)


def test_dedup_spec_and_bands():
    from mmdata.preprocess.curation import dedup as dd

    assert dd.parse_dedup("phash") == 0 and dd.parse_dedup("phash:4") == 4
    for bad in ("md5", "phash:x", "phash:-1", "phash:9"):
        with pytest.raises(ValueError):
            dd.parse_dedup(bad)
    assert [len(dd.band_masks(d)) for d in range(9)] == [1, 2, 6, 10, 15, 21, 84, 120, 165]
    for d in range(9):  # every band holds r of the D + r blocks, and the bands cover all 64 bits
        masks = dd.band_masks(d)
        assert functools.reduce(operator.or_, masks) == 2**64 - 1


# ----------------------------------------------------------------------------- filters and mix


def test_filters_parse_and_apply():
    from mmdata.preprocess.curation.filters import FilterError, first_failed, parse_filters

    rules = parse_filters(
        ["qw2vl_loss<=2.5", "source in [a, 'b c']", "min_side >= 32", "turns<=20", "modality not in [video]"]
    )
    assert [r.expr for r in rules] == [
        "qw2vl_loss<=2.5",
        "source in [a, b c]",
        "min_side>=32",
        "turns<=20",
        "modality not in [video]",
    ]
    rec = {"qw2vl_loss": 1.0, "source": "a", "min_side": 64, "turns": 2, "modality": "single_image"}
    assert first_failed(rules, rec) is None
    assert first_failed(rules, {**rec, "qw2vl_loss": 3.0, "source": "z"}).expr == "qw2vl_loss<=2.5"  # first failing
    assert first_failed(rules, {**rec, "source": "b c"}) is None
    assert first_failed(rules, {**rec, "min_side": None, "qw2vl_loss": None}) is None  # absent field: not applied
    assert first_failed(rules, {**rec, "modality": "video"}).expr == "modality not in [video]"
    for bad, why in [
        ("qw2vl_loss<=abc", "is a number"),
        ("nope>1", "unknown field"),
        ("source<=a", "is text"),
        ("source in a", "takes a list"),
        ("turns", "FIELD OP VALUE"),
        ("source in []", "empty list"),
        ("source==", "missing value"),
    ]:
        with pytest.raises(FilterError, match=why):
            parse_filters([bad])
    with pytest.raises(FilterError, match="twice"):
        parse_filters(["turns<=3", "turns <= 3"])


def test_mix_spec_targets_and_copies(tmp_path):
    from mmdata.preprocess.curation.mix import MixError, copies, group_targets, parse_mix

    inline = parse_mix("a=3,b=1")
    assert inline.by == "source" and dict(inline.weights) == {"a": 3.0, "b": 1.0}
    # no total, no repeat: the scarcest group for its weight is kept whole
    assert group_targets(inline, {"a": 300, "b": 50, "c": 40}) == {"a": 150, "b": 50, "c": 0}
    f = tmp_path / "mix.yaml"
    f.write_text("by: subset\nweights: {a: 1, '*': 1}\nrepeat: true\n")
    spec = parse_mix(str(f))
    # repeat, no total: the most plentiful group is kept whole, the others repeated up to it
    assert spec.by == "subset" and group_targets(spec, {"a": 10, "b": 40, "c": 20}) == {"a": 40, "b": 40, "c": 40}
    f.write_text("weights: {a: 1, b: 1}\ntotal: 101\n")
    assert group_targets(parse_mix(str(f)), {"a": 20, "b": 200}) == {"a": 20, "b": 50}  # capped without repeat
    for text, why in [
        ("weights: {a: -1}", ">= 0"),
        ("weights: []", "mapping"),
        ("by: colour\nweights: {a: 1}", "`by`"),
        ("weights: {a: 1}\ntotal: 1.5", "total"),
        ("weights: {a: 1}\nextra: 1", "unknown key"),
    ]:
        f.write_text(text)
        with pytest.raises(MixError, match=why):
            parse_mix(str(f))
    with pytest.raises(MixError):
        parse_mix("a:3")
    # per-record decisions: floor(f) or floor(f) + 1 copies, close to f on average, deterministic
    n = [copies(2.3, 7, f"r{i}") for i in range(4000)]
    assert (
        set(n) == {2, 3} and abs(sum(n) / len(n) - 2.3) < 0.03 and n == [copies(2.3, 7, f"r{i}") for i in range(4000)]
    )
    assert copies(1.0, 7, "x") == 1 and copies(0.0, 7, "x") == 0
