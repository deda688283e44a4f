"""The energon loader end to end on small shard sets: batch contract, media, bad samples,
exact resume across processes (DP=2, several workers) and blending."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from mmdata.energon_loaders.batch import IGNORE_INDEX
from mmdata.dev.shards import DevSample, write_dev_shards
from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, MEDIA_BASE_ONLY, MEDIA_VIDEO, LlavaOVBatch
from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
from mmdata.energon_loaders.loader import write_blend_yaml
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
from tests.fixtures_loader import BAD_IDS, TINY_TILES, llava_dev_samples, png_bytes, qa

torch.set_num_threads(1)

VISION = dict(TINY_TILES, max_video_frames=4)
SEQ = 512
#: the exact-resume tests' loader options besides the rank's: DP 2, state checkpointed every 2 samples
RESUME_DP2 = {"seq_length": SEQ, "micro_batch_size": 2, "dp_size": 2, "checkpoint_every_min_n_samples": 2}


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory) -> Path:
    return write_dev_shards(tmp_path_factory.mktemp("dev") / "shards", llava_dev_samples(), samples_per_shard=8)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok"))


def _check_batch(batch: LlavaOVBatch, seq: int, tok) -> None:
    b, s = batch.input_ids.shape
    assert s == seq and batch.labels.shape == batch.position_ids.shape == (b, s)
    cu = batch.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == b * s and all(x < y for x, y in zip(cu, cu[1:]))
    assert set(range(0, b * s + 1, s)) <= set(cu)  # rows are segment boundaries
    pos, lab = batch.position_ids.flatten(), batch.labels.flatten()
    for a, e in zip(cu[:-1], cu[1:]):
        assert pos[a:e].tolist() == list(range(e - a))
        assert lab[e - 1] == IGNORE_INDEX
    assert batch.max_seqlen == max(y - x for x, y in zip(cu, cu[1:]))
    # media bookkeeping
    n = len(batch.media_kind)
    assert batch.tiles_per_media.shape == (n,) and int(batch.tiles_per_media.sum()) == batch.pixel_values.shape[0]
    image_id, video_id = tok.convert_tokens_to_ids("<image>"), tok.convert_tokens_to_ids("<video>")
    media_positions = int(((batch.input_ids == image_id) | (batch.input_ids == video_id)).sum())
    assert media_positions == int(batch.num_media_tokens.sum())
    media_mask = (batch.input_ids == image_id) | (batch.input_ids == video_id)
    # targets are text: a label is never a media token
    assert not torch.isin(batch.labels, torch.tensor([image_id, video_id])).any()
    for kind, tiles, grid in zip(batch.media_kind.tolist(), batch.tiles_per_media.tolist(), batch.grid_shapes.tolist()):
        if kind == MEDIA_ANYRES:
            assert tiles == 1 + grid[0] * grid[1]
        elif kind == MEDIA_BASE_ONLY:
            assert tiles == 1 and grid == [0, 0]
        else:
            assert kind == MEDIA_VIDEO and 1 <= tiles <= VISION["max_video_frames"]
    assert batch.pixel_values.shape[1:] == (3, 28, 28)
    # labels are the next token where loss applies
    ids = batch.input_ids.flatten()
    keep = (lab != IGNORE_INDEX).nonzero().flatten()
    assert torch.equal(lab[keep], ids[keep + 1])
    assert batch.num_loss_tokens == len(keep)
    assert not media_mask.flatten()[keep + 1].any()
    samples_per_row = [len(r) for r in batch.sample_ids]
    assert len(cu) - 1 >= sum(samples_per_row)  # one segment per sample (+ padding runs)
    assert 0 < batch.num_real_tokens <= b * s
    assert len(batch.sample_ids) == b and all(isinstance(x, str) for r in batch.sample_ids for x in r)


def test_batches_follow_the_contract(dev_dir, tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    loader = build_llava_ov_loader(
        dev_dir, tok_dir, seq_length=SEQ, micro_batch_size=2, num_workers=0, packing_buffer_size=32, **VISION
    )
    seen: set[str] = set()
    kinds: set[int] = set()
    for step, batch in enumerate(loader):
        _check_batch(batch, SEQ, tok)
        seen.update(x for row in batch.sample_ids for x in row)
        kinds.update(batch.media_kind.tolist())
        if step >= 60 or (seen >= {s.id for s in llava_dev_samples() if s.id not in BAD_IDS} and step >= 3):
            break
    good = {s.id for s in llava_dev_samples() if s.id not in BAD_IDS}
    assert seen == good  # every good sample arrives (text-only, multi-image, video), no bad one
    assert kinds == {MEDIA_ANYRES, MEDIA_BASE_ONLY, MEDIA_VIDEO}
    skipped = loader.stats.skipped
    assert {"image_decode", "video_decode", "bad_role", "media_mismatch"} <= set(skipped)
    assert loader.stats.packing_efficiency > 0.5


def test_loss_tokens_decode_to_assistant_answers(dev_dir, tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    answers = {s.id: [t["value"] for t in s.conversations if t["from"] == "gpt"] for s in llava_dev_samples()}
    loader = build_llava_ov_loader(
        dev_dir, tok_dir, seq_length=SEQ, micro_batch_size=1, num_workers=0, packing_buffer_size=16, **VISION
    )
    batch = next(iter(loader))
    flat_lab, cu = batch.labels.flatten(), batch.cu_seqlens.tolist()
    ids_in_order = batch.sample_ids[0]
    for k, sid in enumerate(ids_in_order):
        a, e = cu[k], cu[k + 1]
        lab = flat_lab[a:e]
        targets = lab[lab != IGNORE_INDEX].tolist()
        assert tok.decode(targets) == "".join(x + "<|im_end|>" for x in answers[sid])
        assert int(batch.position_ids.flatten()[a]) == 0


def test_video_batch_uses_frames(dev_dir, tok_dir):
    loader = build_llava_ov_loader(
        dev_dir, tok_dir, seq_length=SEQ, micro_batch_size=4, num_workers=0, packing=False, **VISION
    )
    for step, batch in enumerate(loader):
        kinds = batch.media_kind.tolist()
        if MEDIA_VIDEO in kinds:
            i = kinds.index(MEDIA_VIDEO)
            assert int(batch.tiles_per_media[i]) == 4  # 10-frame clip, uniform 4-frame sampling
            assert int(batch.num_media_tokens[i]) == 4 * 1 * 1 + 1  # pooled ceil(2/2)^2 per frame + newline
            assert batch.image_sizes[i].tolist() == [48, 64]
            return
        assert step < 40
    pytest.fail("no video sample seen")


def _digest(batch: LlavaOVBatch) -> dict:
    h = hashlib.sha256()
    for t in (
        batch.input_ids,
        batch.labels,
        batch.position_ids,
        batch.cu_seqlens,
        batch.pixel_values,
        batch.tiles_per_media,
        batch.num_media_tokens,
    ):
        h.update(t.contiguous().numpy().tobytes())
    return {"sha": h.hexdigest(), "keys": batch.sample_keys}


_RESUME_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests_dir!r})
    from test_loader import _digest, VISION
    from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
    args = json.loads({args!r})
    loader = build_llava_ov_loader(args["data"], args["tok"], **args["kw"], **VISION)
    loader.restore_state_json(open(args["state"]).read())
    out = []
    for _, batch in zip(range(args["n"]), loader):
        out.append(_digest(batch))
    json.dump(out, open(args["out"], "w"))
    """
)


@pytest.mark.parametrize("packing", [True])
def test_exact_resume_in_a_fresh_process(dev_dir, tok_dir, tmp_path, packing):
    """DP size 2, 2 workers per rank: state saved after k batches, restored in a new process,
    gives exactly the batches the uninterrupted run produced from k+1 on."""
    k, n = 3, 3
    for rank in (0, 1):
        kw = dict(RESUME_DP2, dp_rank=rank, num_workers=2, seed=7, packing=packing, packing_buffer_size=16)
        loader = build_llava_ov_loader(dev_dir, tok_dir, **kw, **VISION)
        it = iter(loader)
        first = [_digest(next(it)) for _ in range(k)]
        state = tmp_path / f"state{rank}.json"
        state.write_text(loader.save_state_json())
        expected = [_digest(next(it)) for _ in range(n)]
        del it, loader
        out = tmp_path / f"out{rank}.json"
        args = json.dumps(
            {"data": str(dev_dir), "tok": str(tok_dir), "kw": kw, "state": str(state), "n": n, "out": str(out)}
        )
        script = _RESUME_SCRIPT.format(tests_dir=str(Path(__file__).parent), args=args)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(out.read_text())
        assert got == expected
        assert got != first[:n]
    # the two ranks read disjoint data
    r0 = {x for d in expected for row in d["keys"] for x in row}
    assert r0


def test_ranks_read_disjoint_shards(dev_dir, tok_dir):
    keys = []
    for rank in (0, 1):
        loader = build_llava_ov_loader(
            dev_dir,
            tok_dir,
            seq_length=SEQ,
            micro_batch_size=4,
            dp_rank=rank,
            dp_size=2,
            num_workers=0,
            packing=False,
            **VISION,
        )
        seen = set()
        for _, batch in zip(range(6), loader):
            seen.update(x for row in batch.sample_keys for x in row)
        keys.append(seen)
    assert keys[0] and keys[1] and not (keys[0] & keys[1])


def test_blend_weights_are_respected(tmp_path, tok_dir):
    a = write_dev_shards(
        tmp_path / "a", [DevSample(f"A{i}", qa("hi", f"a{i}")) for i in range(40)], samples_per_shard=10
    )
    b = write_dev_shards(
        tmp_path / "b",
        [DevSample(f"B{i}", qa("hi", f"b{i}")) for i in range(40)],
        samples_per_shard=10,
        key_offset=1000,
    )
    blend = write_blend_yaml(tmp_path / "blend.yaml", [(a, 3.0), (b, 1.0)])
    loader = build_llava_ov_loader(
        blend, tok_dir, seq_length=64, micro_batch_size=8, num_workers=0, packing=False, seed=3, **VISION
    )
    ids = []
    for _, batch in zip(range(75), loader):
        ids += [x for row in batch.sample_ids for x in row]
    frac_a = sum(x.startswith("A") for x in ids) / len(ids)
    sigma = (0.75 * 0.25 / len(ids)) ** 0.5
    assert abs(frac_a - 0.75) < 4 * sigma, (frac_a, len(ids))
    # several dirs without a YAML: equal weights
    loader = build_llava_ov_loader(
        [a, b], tok_dir, seq_length=64, micro_batch_size=8, num_workers=0, packing=False, **VISION
    )
    ids = [x for _, batch in zip(range(50), loader) for row in batch.sample_ids for x in row]
    frac_a = sum(x.startswith("A") for x in ids) / len(ids)
    assert abs(frac_a - 0.5) < 4 * (0.25 / len(ids)) ** 0.5


def test_over_length_samples_are_truncated_or_dropped_and_counted(tmp_path, tok_dir):
    long_text = "word " * 300
    samples = [
        DevSample("long-text", qa("Q?", long_text)),
        DevSample("huge-image", qa("<image> Q?", "A."), [("png", png_bytes(28 * 6, 28 * 6, 1))]),
        DevSample("ok", qa("Q?", "A.")),
    ]
    d = write_dev_shards(tmp_path / "d", samples)
    # 6x6 grid at 28px, shrunk to 6x6 features: 4 + 6*7 = 46 media tokens, ending past 40
    loader = build_llava_ov_loader(
        d, tok_dir, seq_length=40, micro_batch_size=1, num_workers=0, packing=False, **VISION
    )
    seen = [x for _, batch in zip(range(6), loader) for row in batch.sample_ids for x in row]
    assert set(seen) == {"long-text", "ok"}
    assert loader.stats.counters["truncated"] >= 1
    assert loader.stats.skipped.get("too_long_media", 0) >= 1


def test_close_stops_the_workers_on_torchs_signal(dev_dir, tok_dir, monkeypatch):
    """`close()` ends a loader's worker processes on torch's stop signal. With torch's status
    interval raised to 5 min, a worker that did not hear it (a loader left to the cyclic collector,
    energon's loader <-> epoch iterator, loses its index queues first) is joined for 5 min and then
    terminated (exit code -SIGTERM); one that heard it exits 0 at once."""
    from torch.utils.data import _utils

    monkeypatch.setattr(_utils.worker, "MP_STATUS_CHECK_INTERVAL", 300.0)  # the workers' wait (read at fork)
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 300.0)  # the main process's join
    loader = build_llava_ov_loader(
        dev_dir, tok_dir, seq_length=SEQ, micro_batch_size=1, num_workers=2, packing=False, **VISION
    )
    it = iter(loader)
    next(it)
    workers = list(loader.loader._iterator._workers)
    loader.close()
    assert [w.exitcode for w in workers] == [0, 0]
    loader.close()  # idempotent


def test_workers_fork_without_this_process_garbage(dev_dir, tok_dir):
    """A loader collects this process's garbage before its workers fork: a reference cycle left by
    a run that ended here (one holding a gloo process group crashes the worker that frees it, where
    the group's threads were not copied) is freed in this process, never in a worker."""

    class Cycle:
        pass

    cycle = Cycle()
    cycle.me = cycle
    freed: list[int] = []
    weakref.finalize(cycle, freed.append, os.getpid())
    gc.collect()  # it survives (still referenced) into the oldest generation, as a finished run's objects do
    del cycle  # garbage now, which only a full collection frees
    loader = build_llava_ov_loader(
        dev_dir, tok_dir, seq_length=SEQ, micro_batch_size=1, num_workers=1, packing=False, **VISION
    )
    next(iter(loader))
    assert freed == [os.getpid()]
    loader.close()


def test_loader_state_json_round_trip(dev_dir, tok_dir):
    from mmdata.energon_loaders.state_codec import state_from_json, state_to_json

    loader = build_llava_ov_loader(
        dev_dir, tok_dir, seq_length=SEQ, micro_batch_size=1, num_workers=0, packing_buffer_size=8, **VISION
    )
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    text = state_to_json(state)
    assert state_from_json(text) == state
    with pytest.raises(ValueError):
        state_from_json(json.dumps({"__dataclass__": "os:system", "fields": {}}))


def test_energon_cli_info_and_preview_read_our_shards(dev_dir):
    """`energon info` / `energon preview` (its click CLI, run in-process) understand our shards
    through `--dataset-config mmdata.yaml` (our sample type; their defaults read energon's
    InterleavedSample: test_energon_without_mmdata.py)."""
    from click.testing import CliRunner
    from megatron.energon.cli.main import main as energon_main

    runner = CliRunner()
    ours = ["--dataset-config", "mmdata.yaml"]
    info = runner.invoke(energon_main, ["info", *ours, str(dev_dir)])
    assert info.exit_code == 0, info.output
    assert "ConversationSample" in info.output and "41 samples" in info.output
    preview = runner.invoke(energon_main, ["preview", *ours, "--split-parts", "train", str(dev_dir)], input="n\n")
    assert preview.exit_code == 0, preview.output
    assert "conversations" in preview.output and "__key__" in preview.output


def test_loader_reads_preprocess_output(shards_dir, tok_dir):
    """The real `mmdata preprocess` shards (shared fixture) through the loader."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    manifest_ids = set()
    for tar in sorted(shards_dir.glob("*.tar")):
        import tarfile

        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".json"):
                    manifest_ids.add(json.loads(tf.extractfile(m).read())["id"])
    loader = build_llava_ov_loader(
        shards_dir, tok_dir, seq_length=2048, micro_batch_size=2, num_workers=0, packing_buffer_size=64, **VISION
    )
    seen: set[str] = set()
    for step, batch in enumerate(loader):
        _check_batch(batch, 2048, tok)
        seen.update(x for row in batch.sample_ids for x in row)
        if seen >= manifest_ids or step > 40:
            break
    assert seen == manifest_ids
    assert not loader.stats.skipped


@pytest.mark.slow
@pytest.mark.parametrize("packing,workers,k", [(True, 3, 5), (False, 3, 4), (True, 1, 7)])
def test_exact_resume_slow_matrix(dev_dir, tok_dir, tmp_path, packing, workers, k):
    n = 4
    for rank in (0, 1):
        kw = dict(RESUME_DP2, dp_rank=rank, num_workers=workers, seed=11, packing=packing, packing_buffer_size=12)
        loader = build_llava_ov_loader(dev_dir, tok_dir, **kw, **VISION)
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = loader.save_state_json()
        expected = [_digest(next(it)) for _ in range(n)]
        del it, loader
        fresh = build_llava_ov_loader(dev_dir, tok_dir, **kw, **VISION)
        fresh.restore_state_json(state)
        got = [_digest(b) for _, b in zip(range(n), fresh)]
        assert got == expected
