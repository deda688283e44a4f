"""`mmdata inspect` and `mmdata preview` on Emu3 VQ token shards (`mmdata tokenize-images`
output): a summary of their grids (shapes, visual tokens, codebook use), not image statistics of
zeros; the numbers agree with the job's own manifest and with the grids read directly."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mmdata.inspect.dataset import iter_samples, open_dataset
from mmdata.inspect.tokens import TOKEN_SCHEMA, is_token_dataset
from mmdata.energon_loaders.emu3 import token_format as tf


def _mmdata(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mmdata.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _grids_read_directly(root) -> list[np.ndarray]:
    """Every grid of the folder, read with the token format's own decoder (the reference)."""
    out = []
    for sample in iter_samples(open_dataset(root)):
        for g in tf.decode_vq_json(sample.members[tf.VQ_JSON_MEMBER].read()):
            out.append(tf.decode_grid(sample.members[g.member].read()))
    return out


def test_token_shards_are_recognised_and_image_shards_are_not(demo_token_dir, shards_dir):
    assert is_token_dataset(demo_token_dir)
    assert not is_token_dataset(shards_dir)


def test_inspect_json_summarises_the_grids(demo_token_dir):
    summary = json.loads(_mmdata("inspect", str(demo_token_dir), "--json", "--all").stdout)
    manifest = json.loads((demo_token_dir / "manifest.json").read_text())
    written = manifest["counts"]["tokens"]
    grids = _grids_read_directly(demo_token_dir)
    assert summary["schema"] == TOKEN_SCHEMA and summary["kind"] == "vq_tokens"
    assert summary["samples"] == manifest["counts"]["written"] and summary["sampled"]["all"]
    assert summary["grids"]["count"] == written["images"] == len(grids) > 0
    visual = summary["visual_tokens_per_sample"]
    assert round(visual["mean"] * visual["count"]) == written["visual_tokens"] == sum(g.size for g in grids)
    shapes = {}
    for g in grids:
        shapes[f"{g.shape[0]}x{g.shape[1]}"] = shapes.get(f"{g.shape[0]}x{g.shape[1]}", 0) + 1
    assert summary["grids"]["shapes"] == shapes
    assert summary["text_only_share"] == pytest.approx(written["text_only"] / summary["samples"], abs=1e-4)
    seen = np.unique(np.concatenate([g.ravel() for g in grids]))
    cb = summary["codebook"]
    assert cb["distinct_codes_seen"] == seen.size and cb["max_code"] == int(seen.max())
    assert cb["size"] == manifest["vision_tokenizer"]["config"]["codebook_size"]
    assert 0 < cb["share_used"] <= 1
    assert "images" not in summary  # no image statistics (they were all zeros)


def test_inspect_tables_and_preview_show_the_grids(demo_token_dir):
    tables = _mmdata("inspect", str(demo_token_dir)).stdout
    assert "Emu3 VQ token shards" in tables and "distinct codes seen" in tables and "grid shapes" in tables
    sample = next(
        s for s in iter_samples(open_dataset(demo_token_dir)) if tf.decode_vq_json(s.members[tf.VQ_JSON_MEMBER].read())
    )
    grid = tf.decode_vq_json(sample.members[tf.VQ_JSON_MEMBER].read())[0]
    out = _mmdata("preview", str(demo_token_dir), "--key", sample.key).stdout
    assert f"sample {sample.key}" in out and "VQ grid" in out
    assert f"grid {grid.member} (from {grid.source}" in out and f"{grid.height}x{grid.width} codes" in out
    assert sample.conversations[0]["value"].splitlines()[0] in out
    refused = subprocess.run(
        [sys.executable, "-m", "mmdata.cli", "preview", str(demo_token_dir), "--tiles-png", "/tmp/never.png"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "VQ token shards" in refused.stderr
