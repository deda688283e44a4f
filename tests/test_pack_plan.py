"""The per-sample length index the job writes (it counts what the loader counts) and
`mmdata pack-plan`: every sample exactly once, sequences that fit, >= 99 % efficiency on the
synthetic mix at 8K and 12K (above the online packer), deterministic; `mmdata inspect` shows
the plan against the online packer."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mmdata import shard_format as sf
from mmdata.inspect.packing import estimate_packing
from mmdata.inspect.render import summary_table_data
from mmdata.inspect.stats import summarize
from mmdata.cli import main as mmdata_main
from mmdata.packing import algorithm
from mmdata.packing.plan_file import plan_path, read_plan_info
from tests.fixtures_loader import PLAN_RESUMABLE, batches_around_saved_state
from tests.fixtures_preprocess import tokenized_shards


@pytest.fixture(scope="module")
def tok_shards(tmp_path_factory):
    """600 synthetic records through the job with the tiny tokenizer (exact text tokens)."""
    return tokenized_shards(
        tmp_path_factory.mktemp("packplan"), 600, seed=8, samples_per_tar=100, samples_per_shard=200
    )


def test_length_index_counts_what_the_loader_counts(tok_shards):
    out, tok = tok_shards
    m = json.loads((out / sf.MANIFEST_NAME).read_text())
    table = pq.read_table(out / "lengths.parquet")
    assert table.schema.metadata[b"mmdata.text_tokens"] == b"tokenizer"
    assert m["length_index"]["text_tokens"] == "tokenizer" and m["length_index"]["tokenizer_sha256"]
    idx = table.column("index").to_numpy()
    assert (idx == np.arange(m["counts"]["written"])).all()
    assert np.bincount(table.column("shard").to_numpy()).tolist() == [s["samples"] for s in m["shards"]]
    text, image = table.column("text_tokens").to_numpy(), table.column("image_tokens").to_numpy()
    assert (table.column("total_tokens").to_numpy() == text + image).all()
    # the loader's own numbers (inspect: ChatTokenizer + anyres on the header sizes) for a sample
    tiles = table.column("vision_tiles").to_numpy()  # what the vision tower encodes (no videos here)
    summary = summarize(out, sample=120, seed=2, tokenizer=tok)
    assert len(summary.samples) == 120
    for s in summary.samples:
        i = int(s.key)
        assert (text[i], image[i]) == (s.text_tokens, s.image_tokens), s.key
        assert tiles[i] == sum(im.tiles for im in s.images), s.key


def test_pack_plan_efficiency_determinism_and_inspect(tok_shards, capsys):
    from mmdata.cli import main

    out, _ = tok_shards
    lengths = pq.read_table(out / "lengths.parquet").column("total_tokens").to_numpy()
    for seq in (8192, 12288):
        assert main(["pack-plan", str(out), "--seq-length", str(seq), "--jobs", "1", "--cp", "4", "--tp", "2"]) == 0
        printed = capsys.readouterr()
        assert re.search(r"pack chunks .* 1/1", printed.err)  # its progress, on stderr
        assert re.search(
            r"packing report: bin fill \d+\.\d\d% \| executed-token efficiency \d+\.\d\d% \(CP4 TP2\)", printed.out
        )
        path = plan_path(out, seq)
        info = read_plan_info(path)
        plan = pq.read_table(path)
        bins, index, tokens = (plan.column(c).to_numpy() for c in ("bin", "index", "tokens"))
        assert sorted(index.tolist()) == list(range(len(lengths)))  # every sample exactly once
        assert (tokens == lengths[index]).all() and (np.diff(bins) >= 0).all() and bins[-1] == info["bins"] - 1
        per_bin = np.bincount(bins, weights=np.minimum(tokens, seq))
        assert per_bin.max() <= seq and info["over_length"] == int((lengths > seq).sum())
        assert info["efficiency"] == pytest.approx(per_bin.sum() / (len(per_bin) * seq), abs=1e-6)
        online = estimate_packing(lengths.tolist(), seq)
        assert info["efficiency"] >= 0.99 and info["bins"] <= online.sequences, (seq, info, online)
        assert info["bins"] <= -(-int(np.minimum(lengths, seq).sum()) // seq) + 1  # at most one over the bound
        assert info["lengths_sha256"] == json.loads((out / sf.MANIFEST_NAME).read_text())["length_index"]["sha256"]
        # the packing report in the metadata: CP4 x TP2 pads every sample and padding run to 16
        report, computed = info["packing_report"], 0
        for b in range(info["bins"]):
            row = [min(int(n), seq) for n in tokens[bins == b]]
            computed += sum(-(-n // 16) * 16 for n in row) + -(-(seq - sum(row)) // 16) * 16
        assert (report["cp"], report["tp"], report["rows"]) == (4, 2, info["bins"])
        assert report["capacity"] == info["bins"] * seq
        assert report["real_tokens"] == int(per_bin.sum()) and report["computed_tokens"] == computed
        assert report["bin_fill"] == pytest.approx(info["efficiency"], abs=1e-6) and report["bin_fill"] >= 0.99
        assert report["executed_token_efficiency"] == pytest.approx(per_bin.sum() / computed, abs=1e-6)
        assert report["executed_token_efficiency"] >= 0.97, report
        first = path.read_bytes()
        assert main(["pack-plan", str(out), "--seq-length", str(seq), "--cp", "4", "--tp", "2"]) == 0  # all CPUs: same
        assert path.read_bytes() == first
    d = summarize(out, sample=5, context_lengths=(8192, 12288), cp=4, tp=2).to_dict()["length_index"]
    assert d["samples"] == d["compared"] == len(lengths) and d["text_tokens"] == "tokenizer"
    assert (d["cp"], d["tp"]) == (4, 2)
    for seq in ("8192", "12288"):
        p = d["packing"][seq]
        assert p["plan"] >= 0.99 and p["plan"] >= p["online"] and p["plan_file"] == pytest.approx(p["plan"], abs=1e-4)
        fill, executed = p["bin_fill"], p["executed_token_efficiency"]
        assert fill["online"] == p["online"] and fill["plan"] == p["plan"] and fill["online"] >= 0.95
        assert min(executed.values()) >= 0.97 and all(executed[k] <= fill[k] for k in fill)
        made = read_plan_info(plan_path(out, int(seq)))["packing_report"]  # made at CP4 TP2
        assert executed["plan_file"] == pytest.approx(made["executed_token_efficiency"], abs=1e-4)
    capsys.readouterr()
    assert main(["inspect", str(out), "--sample", "5", "--context-lengths", "8192"]) == 0
    assert "offline plan" in capsys.readouterr().out
    assert main(["pack-plan", str(out.parent / "raw"), "--seq-length", "8192"]) == 2  # no length index


def test_plan_packing_covers_everything_whatever_chunks(monkeypatch):
    rng = np.random.default_rng(4)
    lengths = np.concatenate([rng.integers(1, 3000, 900), [0, 9000, 8192, 8191]])
    one = algorithm.plan_packing(lengths, 8192, seed=3)
    got = np.sort(np.concatenate(one.bins))
    assert (got == np.arange(len(lengths))).all() and one.over_length == 1
    assert all(np.minimum(lengths, 8192)[b].sum() <= 8192 for b in one.bins)
    assert [b.tolist() for b in algorithm.plan_packing(lengths, 8192, seed=3).bins] == [b.tolist() for b in one.bins]
    assert [b.tolist() for b in algorithm.plan_packing(lengths, 8192, seed=4).bins] != [b.tolist() for b in one.bins]
    monkeypatch.setattr(algorithm, "CHUNK", 300)  # chunks packed in parallel give the serial plan
    serial = [b.tolist() for b in algorithm.plan_packing(lengths, 8192, seed=3, jobs=1).bins]
    assert [b.tolist() for b in algorithm.plan_packing(lengths, 8192, seed=3, jobs=2).bins] == serial


def test_shard_writers_count_lengths_without_torch(tok_shards, tmp_path):
    """What a Ray worker runs to write a shard and its length index (exact counts from the file
    the driver saves, and the estimate) imports neither torch nor transformers: checked in a
    fresh interpreter, as a worker starts."""
    import subprocess
    import sys

    from mmdata.preprocess.lengths import LengthCounter, write_counting_tokenizer

    _, tok = tok_shards
    saved = write_counting_tokenizer(tok, tmp_path)
    record = {
        "conversations": [{"from": "human", "value": "<image>\nWhat is 这个?"}, {"from": "gpt", "value": "A cat."}],
        "meta": {"image_sizes": [[640, 480, "jpeg"]]},
    }
    worker = (
        "import json, sys\n"
        "from mmdata.preprocess.curation.dedup import dedup_partition, resolve_bucket\n"
        "from mmdata.preprocess.stages import merge_bucket, scan_unit, sort_bucket, write_shard_task\n"
        "from mmdata.preprocess.lengths import LengthCounter\n"
        f"record = json.loads({json.dumps(json.dumps(record))})\n"
        f"print(json.dumps([LengthCounter({saved!r})(record), LengthCounter()(record),\n"
        "                   sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, check=True).stdout
    exact, estimate, imported = json.loads(out)
    assert imported == []
    assert tuple(exact) == LengthCounter(str(tok))(record)  # the transformers-loaded tokenizer agrees
    assert tuple(estimate) == LengthCounter()(record) and estimate[1] == exact[1] > 0


def _shard_keys(batch) -> list[list[str]]:
    """A batch's rows as shard keys (a sample key may carry its dataset: `DATASET#KEY`)."""
    return [[k.rsplit("#", 1)[-1] for k in row] for row in batch.sample_keys]


def _plan_rows(path, first: int, count: int) -> list[list[str]]:
    """Shard keys of plan sequences [first, first + count), in plan order."""
    plan = pq.read_table(path)
    bins, index = plan.column("bin").to_numpy(), plan.column("index").to_numpy()
    return [[f"{i:010d}" for i in index[bins == b]] for b in range(first, first + count)]


def test_loader_follows_the_plan_and_resumes_exactly(tok_shards):
    """data.packing: plan - each micro-batch row is one plan sequence, in plan order across two
    workers, full rows of the planned tokens; a restored loader continues with the next ones."""
    from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
    from mmdata.energon_loaders.plan_packing import PlanError, plan_for_data

    out, tok = tok_shards
    seq = 8192
    assert mmdata_main(["pack-plan", str(out), "--seq-length", str(seq), "--jobs", "1"]) == 0
    path = plan_path(out, seq)

    def build():
        return build_llava_ov_loader(out, tok, seq_length=seq, micro_batch_size=2, num_workers=2, **PLAN_RESUMABLE)

    loader = build()
    first, state, rest = batches_around_saved_state(loader, 2, 2)
    assert [row for b in first + rest for row in _shard_keys(b)] == _plan_rows(path, 0, 8)
    plan = pq.read_table(path)
    planned = np.bincount(plan.column("bin").to_numpy(), weights=plan.column("tokens").to_numpy())
    assert sum(b.num_real_tokens for b in first + rest) == int(planned[:8].sum())  # the planned lengths
    assert loader.stats.skipped == {}
    resumed = build()
    resumed.restore_state_json(state)
    again = iter(resumed)
    assert [next(again).sample_keys for _ in range(2)] == [b.sample_keys for b in rest]
    # refusals: another sequence length, a stale plan, a blend
    with pytest.raises(PlanError, match="mmdata pack-plan"):
        plan_for_data(out, None, 4096)
    with pytest.raises(PlanError, match="packs 8192 tokens"):
        plan_for_data(out, path, 12288)
    with pytest.raises(PlanError, match="one shard folder"):
        plan_for_data([out, out], None, seq)
    # a recipe asking for a plan that is not there stops before anything is built; evaluation packs online
    from mmtrain.config import load_recipe
    from mmtrain.runtime.evaluation import val_recipe
    from mmtrain.runtime.preflight import _check_data

    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "llava-ov-tiny.yaml",
        [f"data.paths=[{out}]", "data.packing=plan", "train.seq_length=4096", f"data.val_paths=[{out}]"],
    )
    from mmtrain import registry

    problems: list[str] = []
    _check_data(recipe, registry.get_family("llava-ov"), problems)
    assert problems == [
        f"data.packing: plan: packing plan {out}/pack-plan-4096.parquet not found: run "
        f"`mmdata pack-plan {out} --seq-length 4096 --image-size 30 --patch-size 14 --max-tiles 9 "
        "--grid-max 6 --video-frames 8` (or `mmtrain pack-plan RECIPE.yaml`)"
    ]
    assert val_recipe(recipe).data.packing is True and val_recipe(recipe).data.packing_plan is None


def test_plan_positions_cover_every_sequence_once_per_epoch(tok_shards):
    """Ranks take sequences r, r + D, ...; epoch 1 visits the same sequences in another order."""
    from megatron.energon import WorkerConfig

    from mmdata.energon_loaders.plan_packing import PlanPackedDataset, load_plan, plan_for_data

    out, tok = tok_shards
    shards, path, info = plan_for_data(out, None, 8192)
    plan = load_plan(path, info)
    for dp in (1, 3):
        epochs = {0: [], 1: []}
        for rank in range(dp):
            ds = PlanPackedDataset(
                shards,
                plan,
                None,
                micro_batch_size=2,
                seed=5,
                worker_config=WorkerConfig(rank=rank, world_size=dp, num_workers=2),
            )
            n = ds.rank_sequences
            for e in epochs:
                epochs[e] += [ds.sequence_at(e * n + k) for k in range(n)]
        assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(plan.num_sequences))
        assert epochs[0] != epochs[1]


def test_balanced_plan_places_each_step_by_cost_and_resumes(tok_shards, capsys):
    """`pack-plan --dp 2 --micro-batch-size 2 --global-batch-size 8`: the plan records the step
    shape and the vision balance before and after; the loader hands each DP rank (and, without DP
    sharding, every rank in turn) the sequences `assign_block` places in each step, every sequence
    once per epoch (epoch 1: whole tiers shuffled), resumes exactly, and another step shape is
    refused, by the loader and by the training preflight."""
    from megatron.energon import WorkerConfig

    from mmdata.cli import main
    from mmdata.packing.balance import StepShape, assign_block
    from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
    from mmdata.energon_loaders.plan_packing import PlanError, PlanPackedDataset, load_plan, plan_for_data

    out, tok = tok_shards
    seq, shape = 6144, StepShape(dp=2, micro_batch_size=2, global_batch_size=8)
    assert (
        main(
            [
                "pack-plan",
                str(out),
                "--seq-length",
                str(seq),
                "--dp",
                "2",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "8",
                "--jobs",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    line = re.search(
        r"vision balance \(DP2, micro-batch 2, global batch 8; .*\): today (\d\.\d+) .* -> balanced "
        r"(\d\.\d+)",
        capsys.readouterr().out,
    )
    assert line and float(line[2]) < float(line[1])
    shards, path, info = plan_for_data(out, None, seq, step_shape=shape)
    assert info["balance"] == {**shape.as_dict(), "tile_tokens": 210.0}
    assert info["vision_balance"]["balanced"]["mean"] == pytest.approx(float(line[2]), abs=5e-4)
    table = pq.read_table(path)
    index = table.column("index").to_numpy()
    assert sorted(index.tolist()) == list(range(len(index)))
    vision = pq.read_table(out / "lengths.parquet").column("vision_tiles").to_numpy()
    assert (table.column("tiles").to_numpy() == vision[index]).all()
    plan = load_plan(path, info)
    n, g = plan.num_sequences, shape.global_batch_size

    def dataset(rank: int, world: int, micro: int = 2) -> PlanPackedDataset:
        return PlanPackedDataset(
            shards,
            plan,
            None,
            micro_batch_size=micro,
            seed=5,
            worker_config=WorkerConfig(rank=rank, world_size=world, num_workers=1),
        )

    ranks, replicated = [dataset(0, 2), dataset(1, 2)], dataset(0, 1)
    stream = [ranks[0].stream_sequence(p) for p in range(2 * n)]  # two epochs
    steps = 2 * n // g
    assert (
        stream[:n] == list(range(n)) and sorted(stream[n : 2 * n]) == list(range(n)) and stream[n : 2 * n] != stream[:n]
    )
    for t in range(steps):
        block = stream[t * g : (t + 1) * g]
        placed = assign_block(plan.costs[block].tolist(), shape)
        for r, ds in enumerate(ranks):
            for m in range(shape.micro_batches):
                got = ds.sequences_of_batch(t * shape.micro_batches + m)
                assert got == [block[j] for j in placed[r][m]]
                assert replicated.sequences_of_batch((t * 2 + r) * shape.micro_batches + m) == got

    # the loader reads them and resumes after its first micro-batch (30-px tiles to keep it cheap: the
    # rows hold the planned samples whatever their tokens, none over length at that size)
    def build():
        options = dict(dp_rank=1, dp_size=2, num_workers=0, image_size=30, patch_size=14, **PLAN_RESUMABLE)
        return build_llava_ov_loader(out, tok, seq_length=seq, micro_batch_size=2, **options)

    loader = build()
    [first], state, [second] = batches_around_saved_state(loader, 1, 1)
    keys = lambda b: [[k.rsplit("#", 1)[-1] for k in row] for row in b.sample_keys]  # noqa: E731
    for b, batch in enumerate((first, second)):
        assert keys(batch) == [[f"{i:010d}" for i in plan.sequence(s).tolist()] for s in ranks[1].sequences_of_batch(b)]
    resumed = build()
    resumed.restore_state_json(state)
    assert keys(next(iter(resumed))) == keys(second)
    # another step shape: refused by the plan check (the recipe's), the loader and the preflight
    with pytest.raises(PlanError, match=r"balanced for another step shape: dp 2 \(recipe: 4\), global_batch_size 8 "):
        plan_for_data(out, None, seq, step_shape=StepShape(dp=4, micro_batch_size=2, global_batch_size=16))
    with pytest.raises(PlanError, match="balanced for DP2, micro-batch 2, global batch 8"):
        dataset(0, 2, micro=1)
    from mmtrain import registry
    from mmtrain.config import load_recipe
    from mmtrain.runtime.preflight import _check_data

    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "llava-ov-tiny.yaml",
        [
            f"data.paths=[{out}]",
            "data.packing=plan",
            f"train.seq_length={seq}",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "model.vision.image_size=384",
            "data.video_frames=32",
        ],
    )  # the plan's (default) geometry
    problems: list[str] = []
    _check_data(recipe, registry.get_family("llava-ov"), problems)
    assert len(problems) == 1 and "balanced for another step shape: dp 2 (recipe: 1)" in problems[0], problems


def test_inspect_keeps_one_geometry_per_row_and_lists_every_plan_file(tok_shards, tmp_path, capsys):
    """Issue 45: a plan counted with a recipe's 30-px tiles sat in the column of lengths counted
    at 384 px (`98.0% / 99.5% / 92.9%`), a plan at 2,048 was not shown without --context-lengths,
    and a second pack-plan with other settings replaced the first without a word."""
    out = tmp_path / "shards"
    shutil.copytree(tok_shards[0], out, ignore=shutil.ignore_patterns("pack-plan-*"))  # other tests' plans
    tiny = ["--image-size", "30", "--patch-size", "14"]
    for argv in (["--seq-length", "8192"], ["--seq-length", "2048"], ["--seq-length", "8192", *tiny]):
        capsys.readouterr()
        assert mmdata_main(["pack-plan", str(out), "--no-progress", "--jobs", "1", *argv]) == 0
    printed = capsys.readouterr().out
    assert "replaced pack-plan-8192.parquet, a plan made with other settings: geometry.image_size 384 → 30" in printed
    assert mmdata_main(["pack-plan", str(out), "--no-progress", "--jobs", "1", "--seq-length", "2048"]) == 0
    assert "replaced" not in capsys.readouterr().out  # the same settings again: nothing to say

    summary = summarize(out, sample=5, context_lengths=(8192,))
    d = summary.to_dict()
    assert d["length_index"]["packing"]["8192"]["plan_file"] is None  # other lengths: not in the index's row
    files = {f["file"]: f for f in d["plan_files"]}
    assert list(files) == ["pack-plan-2048.parquet", "pack-plan-8192.parquet"]
    assert files["pack-plan-2048.parquet"]["index_geometry"] and not files["pack-plan-8192.parquet"]["index_geometry"]
    assert files["pack-plan-8192.parquet"]["geometry"]["image_size"] == 30
    (rows,) = [rows for title, _, rows in summary_table_data(summary) if title.startswith("Pack-plan files")]
    assert [r[:3] for r in rows] == [
        ["2,048", "the index's (384-px tiles)", "exact"],
        ["8,192", "image size 30", "exact"],
    ]
    (index_rows,) = [rows for title, _, rows in summary_table_data(summary) if "the index's geometry (384-px" in title]
    assert index_rows[0][0] == "8,192" and index_rows[0][-1] == "—"
    assert mmdata_main(["inspect", str(out), "--sample", "5", "--context-lengths", "8192"]) == 0
    assert "Pack-plan files" in capsys.readouterr().out
