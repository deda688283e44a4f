"""Files written through atomic / library writers honour the umask (issue 30): a run's
config.yaml (mkstemp makes 0600), exported safetensors and the tiny VQ's weights (safetensors
writes 0600) come out 0o666 & ~umask, e.g. 0644 under umask 022."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "llava-ov-tiny.yaml"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.unit
def test_resolved_recipe_is_0644(umask_022, tmp_path):
    from mmtrain.config import load_recipe, save_resolved

    out = save_resolved(load_recipe(RECIPE, family="llava-ov"), tmp_path / "run" / "config.yaml")
    assert _mode(out) == 0o644


@pytest.mark.unit
@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 64])
def test_exported_shards_and_index_are_0644(umask_022, tmp_path, max_shard_bytes):
    from mmtrain.models.hf_io import write_sharded

    write_sharded(((f"t{i}", torch.zeros(8)) for i in range(3)), tmp_path, max_shard_bytes)
    files = sorted(tmp_path.iterdir())
    assert files and all(_mode(f) == 0o644 for f in files), {f.name: oct(_mode(f)) for f in files}
    old = os.umask(0o077)  # the umask decides, not a fixed mode: under 077 they stay private
    try:
        write_sharded([("t", torch.zeros(2))], tmp_path / "private")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "private" / "model.safetensors") == 0o600


@pytest.mark.unit
def test_tiny_vq_weights_are_0644(umask_022, tmp_path):
    from mmdata.dev.tiny_vq_model import build_tiny_vq

    out = build_tiny_vq(tmp_path / "vq", codebook_size=8)
    files = sorted(out.iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    assert all(_mode(f) == 0o644 for f in files), {f.name: oct(_mode(f)) for f in files}
