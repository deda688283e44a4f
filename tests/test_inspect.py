"""`mmdata inspect` and its library API on real shards written by `mmdata preprocess`, checked
against ground truth computed independently from the synthetic generator's records."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from mmdata.energon_loaders.llava_ov import anyres
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
from mmdata.inspect import find_sample, load_quarantine, open_dataset, random_samples
from mmdata.inspect.packing import estimate_packing
from mmdata.inspect.stats import detect_language, load_chat_tokenizer, measure_sample, summarize
from mmdata.dev.synth import (
    BROKEN_KINDS,
    EN_ANSWERS,
    EN_PROMPTS,
    TEXT_ONLY,
    ZH_ANSWERS,
    ZH_PROMPTS,
    generate_records,
)
from tests.fixtures_preprocess import SYNTH_NUM_SAMPLES, SYNTH_SEED

JSON_KEYS = {
    "schema",
    "dataset",
    "manifest",
    "samples",
    "shards",
    "bytes",
    "sources",
    "sources_from",
    "quarantine",
    "preprocess",
    "length_index",
    "sampled",
    "modality",
    "languages",
    "turns_per_sample",
    "images",
    "image_tokens_per_sample",
    "tokenizer",
    "text_tokens_per_sample",
    "loss_tokens_per_sample",
    "total_tokens_per_sample",
    "loader_skips",
    "packing",
    "vision_balance",
    "plan_files",
    "global_reads",
}
DIST_KEYS = {"count", "mean", "min", "p50", "p90", "p99", "max"}


# ----------------------------------------------------------------------------- ground truth


def _expected_modality(rec) -> str:
    n = len(rec.images)
    return "text_only" if n == 0 else "single_image" if n == 1 else "multi_image"


def _expected_language(rec) -> str:
    texts = {t["value"].replace("<image>", "").strip() for t in rec.record["conversations"]}
    zh = set(ZH_PROMPTS) | set(ZH_ANSWERS) | {s for pair in TEXT_ONLY[2:] for s in pair}
    en = set(EN_PROMPTS) | set(EN_ANSWERS) | {s for pair in TEXT_ONLY[:2] for s in pair}
    assert texts <= zh | en, texts
    return "zh" if texts & zh else "en"


@pytest.fixture(scope="module")
def truth() -> dict[str, object]:
    """The synthetic records behind `shards_dir`, by id."""
    return {r.id: r for r in generate_records(SYNTH_NUM_SAMPLES, seed=SYNTH_SEED, synthetic=True)}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok"))


def _inspect_cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mmdata.cli", "inspect", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc


# ----------------------------------------------------------------------------- tests


def test_dataset_counts_come_from_the_manifest(shards_dir):
    manifest = json.loads((shards_dir / "manifest.json").read_text())
    ds = open_dataset(shards_dir)
    assert ds.total_samples == manifest["counts"]["written"] == SYNTH_NUM_SAMPLES
    assert [s.name for s in ds.shards] == sorted(p.name for p in shards_dir.glob("*.tar"))
    assert ds.total_bytes == sum(p.stat().st_size for p in shards_dir.glob("*.tar"))


def test_summary_of_all_samples_matches_ground_truth(shards_dir, truth, tokenizer_dir):
    summary = summarize(shards_dir, all=True, tokenizer=tokenizer_dir)
    d = summary.to_dict()
    assert d["samples"] == d["sampled"]["count"] == SYNTH_NUM_SAMPLES and d["sampled"]["all"]
    assert {s.id for s in summary.samples} == set(truth)
    want_modality = Counter(_expected_modality(r) for r in truth.values())
    assert {k: v["count"] for k, v in d["modality"].items() if v["count"]} == dict(want_modality)
    assert d["languages"]["zh"]["count"] == sum(_expected_language(r) == "zh" for r in truth.values())
    assert d["sources_from"] == "manifest"
    assert {k: v["count"] for k, v in d["sources"].items()} == dict(Counter(r.subset for r in truth.values()))
    assert d["quarantine"] == {"total": 0, "reasons": {}}
    # image sizes from the headers == the generator's encoded images
    for s in summary.samples:
        rec = truth[s.id]
        want = [Image.open(io.BytesIO(im.data)).size for im in rec.images]
        assert [(i.width, i.height) for i in s.images] == want
        assert s.turns == len(rec.record["conversations"])
    assert d["images"]["count"] == sum(len(r.images) for r in truth.values())
    assert d["turns_per_sample"]["max"] == max(len(r.record["conversations"]) for r in truth.values())
    assert d["loader_skips"] == {}
    assert set(d["packing"]) == {"4096", "8192", "16384", "32768"}
    assert all(0.5 < v["efficiency"] <= 1.0 for v in d["packing"].values())


def test_header_token_counts_equal_the_pixel_path(shards_dir):
    """Tiles/tokens from header sizes == what the loader's pixel path produces."""
    checked = 0
    for sample in random_samples(shards_dir, 40, seed=5):
        stats = measure_sample(sample)
        for i, im in enumerate(stats.images):
            img = sample.open_image(i)
            out = anyres.process_image(img) if len(stats.images) == 1 else anyres.process_base_only(img)
            assert (im.tiles, im.tokens) == (out.num_tiles, out.num_tokens), (sample.key, im)
            if len(stats.images) == 1:
                assert im.grid == out.grid_shape
            checked += 1
    assert checked >= 10


def test_token_counts_equal_the_loaders_task_encoder(shards_dir, tokenizer_dir):
    """Text, image and loss tokens == the loader's own preencode of the same sample."""
    from megatron.energon import SkipSample

    from mmdata.energon_loaders.sample import ConversationSample
    from mmdata.energon_loaders.llava_ov.task_encoder import LlavaOVEncoderConfig, LlavaOVTaskEncoder

    encoder = LlavaOVTaskEncoder(str(tokenizer_dir), LlavaOVEncoderConfig(seq_length=1 << 20))
    chat = load_chat_tokenizer(tokenizer_dir)
    for sample in random_samples(shards_dir, 25, seed=11):
        stats = measure_sample(sample, chat)
        cs = ConversationSample(
            __key__=sample.key, __restore_key__=(), __subflavors__=None, __sources__=(), **sample.to_energon_fields()
        )
        try:
            enc = encoder.preencode_sample(cs)
        except SkipSample:
            assert stats.error is not None
            continue
        media = sum(m.num_tokens for m in enc.media)
        assert stats.image_tokens == media
        assert stats.total_tokens == len(enc.input_ids)
        assert stats.loss_tokens == int((enc.labels != -100).sum())


def test_text_tokens_equal_the_hf_chat_template(shards_dir, tokenizer_dir):
    """Independent check: tokens of the HF chat template minus the `<image>` placeholders."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    chat = load_chat_tokenizer(tokenizer_dir)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    image_id = tok.convert_tokens_to_ids("<image>")
    for sample in random_samples(shards_dir, 15, seed=2):
        msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in sample.conversations]
        ids = tok.apply_chat_template(msgs, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        stats = measure_sample(sample, chat)
        assert stats.text_tokens == len(ids) - ids.count(image_id)
        assert ids.count(image_id) == len(stats.images)


def test_random_sample_is_bounded_and_seeded(shards_dir):
    a = summarize(shards_dir, sample=10, seed=1)
    b = summarize(shards_dir, sample=10, seed=1)
    c = summarize(shards_dir, sample=10, seed=2)
    keys = [s.key for s in a.samples]
    assert len(keys) == len(set(keys)) == 10 and not a.sampled_all
    assert keys == [s.key for s in b.samples]
    assert keys != [s.key for s in c.samples]
    assert a.to_dict()["samples"] == SYNTH_NUM_SAMPLES  # totals still exact, from the manifest
    assert a.to_dict()["text_tokens_per_sample"] is None and a.to_dict()["packing"] is None


def test_reading_without_energon_offsets_gives_the_same_samples(shards_dir, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(shards_dir, plain)
    for idx in plain.glob("*.tar.idx"):
        idx.unlink()
    with_idx = random_samples(shards_dir, 12, seed=4)
    without = random_samples(plain, 12, seed=4)
    assert [(s.key, s.record) for s in with_idx] == [(s.key, s.record) for s in without]
    assert [s.media_bytes(n) for s in with_idx for n in s.image_names] == [
        s.media_bytes(n) for s in without for n in s.image_names
    ]


def test_find_sample_by_key_and_by_record_id(shards_dir, truth):
    target = random_samples(shards_dir, 1, seed=9)[0]
    by_key = find_sample(shards_dir, target.key)
    by_id = find_sample(shards_dir, target.id)
    assert by_key is not None and by_id is not None
    assert (by_key.key, by_key.record) == (by_id.key, by_id.record) == (target.key, target.record)
    assert target.id in truth
    data = [by_id.media_bytes(n) for n in by_id.image_names]
    assert data == [im.data for im in truth[target.id].images]  # original bytes, never re-encoded
    assert find_sample(shards_dir, "no-such-id") is None
    assert find_sample(shards_dir, "9999999999") is None


def test_quarantine_reasons_and_counts(broken_dataset):
    out, recs = broken_dataset
    broken = [r for r in recs if r.broken]
    assert broken
    want = Counter(BROKEN_KINDS[r.broken] for r in broken)
    d = summarize(out, sample=5).to_dict()
    assert d["quarantine"] == {"total": len(broken), "reasons": dict(sorted(want.items()))}
    assert d["samples"] == len(recs) - len(broken)
    rows = load_quarantine(out)
    assert Counter(q.reason for q in rows) == want
    parsed = {r.id for r in broken if r.broken != "malformed_json"}  # a malformed record has no id
    assert parsed <= {q.id for q in rows}


def test_cli_json_and_table(broken_dataset, tokenizer_dir, capsys):
    out, recs = broken_dataset
    d = json.loads(
        _inspect_cli(str(out), "--json", "--all", "--tokenizer", str(tokenizer_dir), "--cp", "2", "--tp", "2").stdout
    )
    assert set(d) == JSON_KEYS and d["schema"] == "mmdata.inspect/5"
    for v in d["packing"].values():  # the packing report: CP2 x TP2 pads every segment to 8 tokens
        assert v["bin_fill"] == pytest.approx(v["efficiency"], abs=1e-4)
        assert 0.5 < v["executed_token_efficiency"] <= v["bin_fill"]
    vb = d["vision_balance"]  # DP8, micro-batch 2, global batch 32: 4 rows per rank, windows of 2 steps
    assert (vb["dp"], vb["window"]) == (8, 2)
    for v in vb["packing"].values():
        assert set(v["online"]) == {"today", "balanced", "windowed"}
    gr = d["global_reads"]  # data.sharding: global at DP8: each rank reads its rows, about an eighth of the step
    for v in gr["packing"].values():
        assert v["rank_share"] == pytest.approx(1 / 8) and v["step_bytes"] >= v["rank_max"] >= v["rank_mean"] > 0
    valid = [r for r in recs if not r.broken]
    assert d["samples"] == d["sampled"]["count"] == len(valid)
    assert {k: v["count"] for k, v in d["modality"].items() if v["count"]} == dict(
        Counter(map(_expected_modality, valid))
    )
    for key in ("turns_per_sample", "image_tokens_per_sample", "text_tokens_per_sample", "total_tokens_per_sample"):
        assert set(d[key]) == DIST_KEYS
    assert d["text_tokens_per_sample"]["count"] == len(valid)
    assert d["quarantine"]["total"] == len(recs) - len(valid)
    media = d["preprocess"]["media_resolution"]
    assert sum(media[k] for k in ("by_name", "by_basename", "by_stem")) == sum(1 for r in valid if r.images or r.video)
    from mmdata.cli import main

    capsys.readouterr()
    assert main(["inspect", str(out), "--sample", "8"]) == 0
    table = capsys.readouterr().out
    for word in (
        "Dataset",
        "Sources",
        "Quarantine",
        "Media resolution",
        "by stem",
        "Modality",
        "single_image",
        "image_empty",
        "tiles / image",
    ):
        assert word in table, word
    assert f"{len(valid)}" in table
    assert "bin fill / executed" in table and "online, window of 2 steps" in table
    assert "Reads per step with data.sharding: global" in table
    assert main(["inspect", str(out / "missing")]) == 2
    assert "not a shards directory" in capsys.readouterr().err
    assert main(["inspect", str(out), "--cp", "0"]) == 2
    assert "--cp must be >= 1" in capsys.readouterr().err


@pytest.mark.unit
def test_language_heuristic():
    assert detect_language("Describe this image in detail.") == "en"
    assert detect_language("请详细描述这张图片。") == "zh"
    assert detect_language("Translate: 今天天气很好，我们去公园吧") == "zh"
    assert detect_language("Привет, как дела?") == "other"
    assert detect_language("17 * 23 = 391") == "other"


@pytest.mark.unit
def test_packing_estimate_packs_like_the_loader():
    from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER
    from mmdata.inspect.packing import PACKING_BUFFER

    assert PACKING_BUFFER == DEFAULT_PACKING_BUFFER
    # packs never mix samples of different buffers, exactly like the loader's buffers
    mixed = estimate_packing([3000, 1000, 3000, 1000], 4096, buffer=2)
    assert (mixed.sequences, mixed.efficiency) == (2, pytest.approx(8000 / (2 * 4096)))
    split = estimate_packing([3000, 3000, 1000, 1000], 4096, buffer=2)
    assert (split.sequences, split.efficiency) == (3, pytest.approx(8000 / (3 * 4096)))
    assert estimate_packing([3000, 3000, 1000, 1000], 4096, buffer=4).sequences == 2
    # the packing report: CP2 x TP2 pads 3001 -> 3008, 999 -> 1000 and each row's padding run 96 -> 96
    cp = estimate_packing([3001, 999, 3001, 999], 4096, buffer=2, cp=2, tp=2).report
    assert (cp.rows, cp.real_tokens, cp.computed_tokens) == (2, 8000, 2 * (3008 + 1000 + 96))
    assert cp.bin_fill == pytest.approx(8000 / 8192) and cp.executed_token_efficiency == pytest.approx(8000 / 8208)
    assert mixed.report.executed_token_efficiency == mixed.report.bin_fill == mixed.efficiency  # no CP: the rows


@pytest.mark.unit
def test_packing_estimate_uses_every_length_once():
    est = estimate_packing([3000, 3000, 2000, 1000, 500, 9000], 4096)
    assert est.over_length == 1
    # 4096(clipped) | 3000+1000 | 3000+500 | 2000  -> 4 sequences
    assert est.sequences == 4
    assert est.efficiency == pytest.approx((4096 + 3000 + 3000 + 2000 + 1000 + 500) / (4 * 4096))


def test_bit_rot_is_reported_not_fatal(shards_dir, tmp_path, truth, tokenizer_dir):
    """An image that no longer decodes is counted as the loader's skip reason, not a crash."""
    rotten = tmp_path / "rotten"
    shutil.copytree(shards_dir, rotten)
    victim = next(s for s in random_samples(rotten, 30, seed=6) if len(s.image_names) == 1)
    ref = victim.members[victim.image_names[0]]
    with open(ref.path, "r+b") as f:  # zero the member's bytes in place; the tar stays valid
        f.seek(ref.offset)
        f.write(b"\0" * ref.size)
    d = summarize(rotten, all=True, tokenizer=tokenizer_dir).to_dict()
    assert d["loader_skips"] == {"image_decode": 1}
    assert d["sampled"]["count"] == SYNTH_NUM_SAMPLES
    assert d["modality"]["single_image"]["count"] == sum(len(r.images) == 1 for r in truth.values())
    assert d["images"]["count"] == sum(len(r.images) for r in truth.values()) - 1


def test_bare_tar_directory_without_manifest(shards_dir, tmp_path, truth):
    """Any dir of our tars works: counts come from walking the tar headers instead."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for tar in shards_dir.glob("*.tar"):
        shutil.copy(tar, bare / tar.name)
    d = summarize(bare, sample=SYNTH_NUM_SAMPLES).to_dict()
    assert (d["manifest"], d["samples"], d["sources_from"]) == (False, SYNTH_NUM_SAMPLES, "all")
    assert {k: v["count"] for k, v in d["sources"].items()} == dict(Counter(r.subset for r in truth.values()))
    assert d["quarantine"] == {"total": 0, "reasons": {}}
