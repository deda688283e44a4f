"""Sources of the global order from real shard folders (mmdata/global_order/sources.py): image
shards (`mmdata preprocess`) and Emu3 token shards (`mmdata tokenize-images --tokenizer`, each
sample's variant drawn per epoch), their lengths, keys and bytes in the tars; planned like any other."""

from __future__ import annotations

import sqlite3

import numpy as np
import pyarrow.parquet as pq
import pytest

from mmdata.errors import UserError
from mmdata.global_order import StepPlanner, check_names, load_source
from mmdata.global_order.sources import ENERGON_INDEX, Streams, sample_bytes
from mmdata.packing.emu3_geometry import UNENCODABLE


def _bytes(root) -> dict[str, int]:
    with sqlite3.connect(root / ENERGON_INDEX) as db:
        return dict(db.execute("SELECT sample_key, byte_size FROM samples").fetchall())


def test_image_shards_become_a_source(shards_dir, tmp_path):
    src = load_source(shards_dir)
    table = pq.read_table(shards_dir / "lengths.parquet")
    assert src.name == shards_dir.name and len(src) == table.num_rows and src.keys is None and src.choices is None
    assert src.lengths.tolist() == table.column("total_tokens").to_pylist()
    assert src.tiles.tolist() == table.column("vision_tiles").to_pylist()
    sizes = _bytes(shards_dir)
    assert [src.key(k) for k in range(len(src))] == [f"{i:010d}" for i in table.column("index").to_pylist()]
    assert src.sample_bytes.tolist() == [sizes[src.key(k)] for k in range(len(src))] and src.sample_bytes.min() > 0
    with pytest.raises(UserError, match="two data sources are named") as e:
        check_names([src, load_source(shards_dir)])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="lengths.parquet not found"):
        load_source(tmp_path)


def test_emu3_token_shards_become_a_source_with_their_variants(token_dir, emu3_tok_dir):
    src = load_source(token_dir, name="emu3", tokenizer=emu3_tok_dir, seed=3)
    table = pq.read_table(token_dir / "lengths.parquet")
    assert src.name == "emu3" and src.exact and src.choices is not None and src.keys is not None
    assert 0 < len(src) <= table.num_rows and (src.lengths != UNENCODABLE).all() and not src.tiles.any()
    epochs = Streams([src], seed=3).variants(0, np.arange(4 * len(src)))
    assert {0, 1} <= set(epochs.tolist()) <= {0, 1, 2}  # (p_uncond 0.05: a caption drop is rare)
    drawn = src.choices.lengths[np.arange(len(src)), epochs[: len(src)]]
    assert (drawn != UNENCODABLE).all()  # a sample is drawn only into a variant it encodes in
    keys = table.column("key").to_pylist()
    assert all(src.key(k) in keys for k in range(len(src)))
    sizes = _bytes(token_dir)
    assert src.sample_bytes.tolist() == [sizes[src.key(k)] for k in range(len(src))]
    again = load_source(token_dir, name="emu3", tokenizer=emu3_tok_dir, seed=3)
    assert np.array_equal(again.choices.lengths, src.choices.lengths) and np.array_equal(again.lengths, src.lengths)
    planner = StepPlanner([src], None, 512, 2, seed=0)
    steps = [s for s, _ in zip(planner.window(planner.initial_state())[0], range(4))]
    for s in steps:
        for r in s.rows:
            assert r.tokens == sum(min(int(planner.streams.lengths(0, [p])[0]), 512) for _, p in r.members)
            assert r.tiles == 0


def test_sample_bytes_are_read_by_global_index_in_one_query(shards_dir):
    """Bytes by global index (energon's order: tar, then sample in it), not by key: no per-key
    strings for a folder of 10^8 samples; an index past the folder's samples is refused."""
    with sqlite3.connect(shards_dir / ENERGON_INDEX) as db:
        rows = db.execute("SELECT tar_file_id, sample_index, byte_size FROM samples").fetchall()
    in_order = [size for _, _, size in sorted(rows)]
    index = np.random.default_rng(0).permutation(len(in_order))[: len(in_order) // 2]
    assert sample_bytes(shards_dir, index).tolist() == [in_order[i] for i in index]
    with pytest.raises(UserError, match=f"holds {len(in_order)} samples, the length index names sample") as e:
        sample_bytes(shards_dir, np.asarray([0, len(in_order)]))
    assert "\n" not in str(e.value)


def test_a_linked_folder_is_named_by_the_link(shards_dir, tmp_path):
    """The name is the folder as written (symlinks not followed), as the recipe check names it."""
    link = tmp_path / "web"
    link.symlink_to(shards_dir, target_is_directory=True)
    assert load_source(link).name == "web" != shards_dir.name
