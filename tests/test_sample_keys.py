"""Sample keys (`DATASET#SHARD_KEY`): what metrics and worst-samples name samples by. Record ids
repeat across sources and shard keys across datasets; the key stays unique across a blend and
finds its sample again (`mmdata preview DATASET --key KEY`)."""

from __future__ import annotations

import pytest

from mmdata.dev.shards import DevSample, write_dev_shards
from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
from mmdata.energon_loaders.loader import write_blend_yaml
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
from mmdata.shard_format import SAMPLE_KEY_SEP as KEY_SEP
from tests.fixtures_loader import TINY_TILES

pytestmark = pytest.mark.unit


def test_sample_keys_are_unique_across_a_blend_sharing_record_ids_and_find_the_sample(tmp_path, capsys):
    from mmdata.cli import main as mmdata_main
    from mmdata.inspect.dataset import find_sample
    from mmtrain.runtime.train_data import batch_sample_ids

    tok = build_tiny_qwen2_tokenizer(tmp_path / "tok")
    records = [
        DevSample(f"rec{i}", [{"from": "human", "value": "hi"}, {"from": "gpt", "value": f"answer {i}"}])
        for i in range(8)
    ]
    a = write_dev_shards(tmp_path / "a", records, samples_per_shard=4)  # the same record ids and
    b = write_dev_shards(tmp_path / "b", records, samples_per_shard=4)  # the same shard keys
    blend = write_blend_yaml(tmp_path / "blend.yaml", [(a, 1.0), (b, 1.0)])
    loader = build_llava_ov_loader(
        blend, tok, seq_length=64, micro_batch_size=8, num_workers=0, packing=False, seed=3, **TINY_TILES
    )
    id_of: dict[str, str] = {}
    for _, batch in zip(range(6), loader):
        for key, rid in zip(batch_sample_ids(batch), [i for row in batch.sample_ids for i in row]):
            assert id_of.setdefault(key, rid) == rid  # one key, one sample
    datasets = {k.rpartition(KEY_SEP)[0] for k in id_of}
    assert datasets == {str(a), str(b)}
    shared = {rid for rid in id_of.values() if list(id_of.values()).count(rid) > 1}
    assert shared  # a record id drawn from both datasets: two keys

    key = sorted(k for k in id_of if k.startswith(str(b)))[0]
    dataset, _, shard_key = key.rpartition(KEY_SEP)
    assert find_sample(dataset, shard_key).id == id_of[key] == find_sample(dataset, key).id  # (the notebook's lookup)
    for command in ("preview", "inspect"):
        assert mmdata_main([command, dataset, "--key", key]) == 0
        assert id_of[key] in capsys.readouterr().out
    assert mmdata_main(["preview", str(a), "--key", key]) == 2  # a key of b asked of a: named
    assert f"names a sample of {b}, not of {a}" in capsys.readouterr().err
