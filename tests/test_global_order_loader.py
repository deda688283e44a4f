"""The global order's loader (`build_loader(..., sharding="global")`, issue 46) with real energon
loaders over tiny LLaVA-OV shards (two sources: a preprocessed folder and its copy): at any DP size,
worker count and micro-batch, step t trains the same samples, each rank reads only its rows and
the bytes it reads add up to the step's; the layout-free state resumes at another layout exactly;
a metadataset YAML is refused. The micro-batch order per worker is checked without workers
(`unit`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tarfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from megatron.energon import WorkerConfig

from mmdata.energon_loaders.global_order import BYTES_READ, GLOBAL_ORDER_FIELDS, GlobalOrderDataset
from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader
from mmdata.energon_loaders.plan_packing import load_plan, plan_for_data
from mmdata.errors import UserError
from mmdata.global_order import OrderSource, StepPlanner, placement
from mmdata.packing.balance import StepShape
from tests.fixtures_loader import pack_balanced_tiny_plan
from tests.fixtures_preprocess import tokenized_shards

SEQ = 512  # about 4 tiny samples per row: an epoch of the two sources is about 8 steps
G = 6  # divisible by every dp x micro-batch below
TINY = {"image_size": 30, "patch_size": 14}


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> tuple[list[Path], Path]:
    """96 records through the job with the tiny tokenizer (exact lengths) and a copy of them
    under another name: two sources of the same samples, told apart by their folders."""
    root = tmp_path_factory.mktemp("globalorder")
    out, tok = tokenized_shards(root, 96, seed=5, samples_per_tar=48, samples_per_shard=32)
    other = root / "other"
    shutil.copytree(out, other)
    return [out, other], tok


def _build(data, tok, rank: int, dp: int, workers: int, micro: int, **kw):
    return build_llava_ov_loader(
        data,
        tok,
        seq_length=SEQ,
        micro_batch_size=micro,
        dp_rank=rank,
        dp_size=dp,
        num_workers=workers,
        sharding="global",
        global_batch_size=G,
        blend={"weights": {"shards": 1, "other": 1}},
        window_steps=2,
        **TINY,
        **kw,
    )


def _run(loaders, steps: int) -> tuple[dict, dict]:
    """Per step: the keys each rank trained (rank -> keys) and the bytes each rank read; the loaders'
    iterators are left open so their state can be saved after `steps` steps."""
    keys: dict[int, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    read: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for rank, loader in enumerate(loaders):
        it = iter(loader)
        while loader.next_step < steps:
            batch = next(it)
            at = batch.global_order
            assert tuple(at) == GLOBAL_ORDER_FIELDS
            keys[at["step"]][rank] += [k for row in batch.sample_keys for k in row]
            read[at["step"]][rank] += at["bytes_read"]
            assert batch.stats[BYTES_READ] == at["bytes_read"]
    return keys, read


def _close(loaders: list) -> None:
    """Stop the loaders' worker processes now (`SavableLoader.close`), so their cost counts in
    the test that started them."""
    for loader in loaders:
        loader.close()
    loaders.clear()


def _planned(planner: StepPlanner, steps: int):
    """(sample keys, bytes, the planned step) of the planner's first steps."""
    for planned, _ in planner.steps_from(planner.initial_state()):
        if planned.step >= steps:
            return
        rows = planned.rows
        size = sum(int(planner.sources[s].sample_bytes[k]) for r in rows for (s, _), k in zip(r.members, r.samples))
        yield _keys_of(planner, rows), size, planned


def _keys_of(planner: StepPlanner, rows) -> list[str]:
    """The sample keys of planned rows, as the batches name them (`DATASET#KEY`)."""
    return [
        f"{planner.sources[s].root}#{planner.sources[s].key(k)}"
        for row in rows
        for (s, _), k in zip(row.members, row.samples)
    ]


def test_every_layout_trains_the_planned_steps_reads_its_rows_and_resumes_anywhere(two_sources):
    """(dp, workers, micro-batch) in (1, 1, 1), (2, 2, 1), (3, 1, 2): each step's keys over the
    ranks are the planner's (so the same at every layout), each rank trains the rows `placement`
    gives it and the ranks' bytes add up to the step's. The document saved after step 0 at DP 2
    (mid-window) restored at DP 3 without workers continues with the uninterrupted steps. Over the planned steps
    of the first epoch and a half, every key of both sources trains, none more than twice."""
    data, tok = two_sources
    steps = 2
    planner = _build(data, tok, 0, 1, 0, 1).planner
    planned = list(_planned(planner, 12))
    counts = Counter(k for keys, _, _ in planned for k in keys)
    assert len(counts) == sum(len(s) for s in planner.sources) and max(counts.values()) == 2
    units = np.sum([p.units for _, _, p in planned], axis=0)
    assert abs(units[0] / units.sum() - 0.5) < 0.05  # the blend's equal shares, in samples
    saved = None
    for dp, workers, micro in ((1, 1, 1), (2, 2, 1), (3, 1, 2)):
        loaders = [_build(data, tok, r, dp, workers, micro) for r in range(dp)]
        keys, read = _run(loaders, 1 if dp == 2 else steps)
        if dp == 2:  # every rank's document is the same, at the start of the window
            saved = loaders[0].save_state_json()
            assert all(loader.save_state_json() == saved for loader in loaders)
            assert json.loads(saved)["step"] == 1 and json.loads(saved)["window_start"]["step"] == 0
        shape = StepShape(dp, micro, G)
        for t in sorted(keys):
            want, size, step = planned[t]
            assert sorted(k for r in keys[t].values() for k in r) == sorted(want), (dp, workers, micro, t)
            assert sum(read[t].values()) == size and all(read[t][r] > 0 for r in range(dp))
            for r, micros in enumerate(placement(step, shape)):
                assert sorted(keys[t][r]) == sorted(_keys_of(planner, [step.rows[i] for m in micros for i in m]))
        _close(loaders)
    resumed = [_build(data, tok, r, 3, 0, 2) for r in range(3)]
    for loader in resumed:
        loader.restore_state_json(saved)
    keys, _ = _run(resumed, 1 + steps)
    assert sorted(keys) == [1, 2]
    assert all(sorted(k for r in keys[t].values() for k in r) == sorted(planned[t][0]) for t in (1, 2))


def test_a_packing_plan_balanced_for_another_shape_is_followed_at_any_layout_and_resumes(two_sources):
    """`packing: plan` in global order: a plan balanced for DP 2 x micro 1 x G 4 is followed at G 6
    by (dp, workers, micro) (1, 1, 1), (2, 0, 1): each step trains the plan's next 6 sequences
    (`PlanSteps`), each rank the rows `placement` gives it; the document saved after step 0 at DP 2
    resumes at DP 3 with micro-batch 2 exactly; the training preflight accepts the
    recipe."""
    from mmtrain import registry
    from mmtrain.config import load_recipe
    from mmtrain.runtime.preflight import _check_data

    root, tok = two_sources[0][0], two_sources[1]
    pack_balanced_tiny_plan(root, SEQ, dp=2, micro_batch_size=1, global_batch=4)

    def build(rank: int, dp: int, workers: int, micro: int):
        return build_llava_ov_loader(
            root, tok, seq_length=SEQ, micro_batch_size=micro, dp_rank=rank, dp_size=dp, num_workers=workers,
            sharding="global", global_batch_size=G, packing="plan", max_video_frames=8, **TINY,
        )  # fmt: skip

    steps = build(0, 1, 0, 1).planner
    planned = [s for _, (s, _) in zip(range(3), steps.resume(steps.document(0, 0)))]
    assert [r.members[0][1] for r in planned[1].rows] == [int(steps.plan.starts[b]) for b in range(G, 2 * G)]
    want = [sorted(f"{root}#{steps.sample_at(m)[2]}" for m in s.members()) for s in planned]
    saved = None
    for dp, workers, micro in ((1, 1, 1), (2, 0, 1)):
        loaders = [build(r, dp, workers, micro) for r in range(dp)]
        keys, read = _run(loaders, 1 if dp == 2 else 2)
        if dp == 2:
            saved = loaders[0].save_state_json()
            assert json.loads(saved)["step"] == 1 and json.loads(saved)["position"] == G
        for t in sorted(keys):
            assert sorted(k for r in keys[t].values() for k in r) == want[t], (dp, t)
            for r, micros in enumerate(placement(planned[t], StepShape(dp, micro, G))):
                mine = [m for i in (i for mb in micros for i in mb) for m in planned[t].rows[i].members]
                assert sorted(keys[t][r]) == sorted(f"{root}#{steps.sample_at(m)[2]}" for m in mine)
                assert sum(read[t].values()) == sum(steps.sample_at(m)[4] for m in planned[t].members())
        _close(loaders)
    resumed = [build(r, 3, 0, 2) for r in range(3)]
    for loader in resumed:
        loader.restore_state_json(saved)
    keys, _ = _run(resumed, 3)
    assert sorted(keys) == [1, 2] and all(sorted(k for r in keys[t].values() for k in r) == want[t] for t in (1, 2))
    _close(resumed)
    overrides = [f"data.paths=[{root}]", "data.packing=plan", "data.sharding=global", f"train.seq_length={SEQ}"]
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "llava-ov-tiny.yaml", overrides)
    problems: list[str] = []
    _check_data(recipe, registry.get_family("llava-ov"), problems)
    assert problems == []


def test_a_micro_batch_whose_samples_were_all_skipped_is_padding_in_its_place(two_sources, tmp_path):
    """`packing: false`, micro-batch 1: a sample whose image does not decode is skipped (counted)
    and its micro-batch becomes a row of padding (no sample, no loss token) with its place in the
    order, so every rank still yields each step's M micro-batches in order (the trainer takes M
    per step); every other sample trains as planned."""
    data, tok = two_sources
    broken = tmp_path / "shards"
    shutil.copytree(data[0], broken)

    def build(rank: int, dp: int):
        return build_llava_ov_loader(
            broken, tok, seq_length=SEQ, micro_batch_size=1, dp_rank=rank, dp_size=dp, num_workers=0,
            sharding="global", global_batch_size=G, packing=False, **TINY,
        )  # fmt: skip

    planner = build(0, 1).planner
    planned = [keys for keys, _, _ in _planned(planner, 2)]
    bad = _break_an_image(broken, [k.rsplit("#", 1)[1] for k in planned[1]])
    dp, per_step = 2, G // 2
    got: dict[int, list[str]] = defaultdict(list)
    pads = 0
    for rank in range(dp):
        loader = build(rank, dp)
        it, order = iter(loader), []
        while loader.next_step < 2:
            batch = next(it)
            at = batch.global_order
            order.append((at["step"], at["micro_batch"], at["micro_batches"]))
            keys = [k for row in batch.sample_keys for k in row]
            got[at["step"]] += keys
            if not keys:  # the padding row: read (its bytes count), nothing to train
                pads += 1
                assert batch.sample_keys == [[]] and batch.num_loss_tokens == 0 and at["bytes_read"] > 0
                assert batch.stats == {"skipped/image_decode": 1, BYTES_READ: at["bytes_read"]}
                assert (batch.labels == -100).all() and batch.pixel_values.shape[0] == 0
        assert order == [(t, m, per_step) for t in range(2) for m in range(per_step)], (rank, order)
    for t in range(2):
        assert sorted(got[t]) == sorted(k for k in planned[t] if not k.endswith(f"#{bad}")), t
    assert pads == sum(k.endswith(f"#{bad}") for keys in planned for k in keys) >= 1


def test_plan_packing_keeps_a_micro_batch_whose_samples_were_all_skipped_as_padding(two_sources, tmp_path):
    """`packing: plan` without the global order (`data.sharding: dp`), micro-batch 1: a plan
    sequence whose samples all fail to decode is a micro-batch of padding in its place (no sample,
    no loss token, the skips counted), as in the global order, so the rank still yields every
    micro-batch of its steps; the sequences around it train as planned."""
    data, tok = two_sources
    broken = tmp_path / "shards"
    shutil.copytree(data[0], broken)
    pack_balanced_tiny_plan(broken, SEQ, dp=1, micro_batch_size=1, global_batch=1)  # step t: sequence t
    shards, path, info = plan_for_data(broken, None, SEQ)
    plan = load_plan(path, info)
    sequences = [[key for _, key, _ in plan.members(b)] for b in range(plan.num_sequences)]
    with_image = set()
    for shard in broken.glob("shard-*.tar"):
        with tarfile.open(shard) as tar:
            with_image |= {m.name.split(".")[0] for m in tar.getmembers() if ".img" in m.name}
    b = next(b for b, keys in enumerate(sequences) if set(keys) <= with_image)
    for key in sequences[b]:
        _break_an_image(broken, [key])
    loader = build_llava_ov_loader(
        broken, tok, seq_length=SEQ, micro_batch_size=1, num_workers=0, packing="plan", max_video_frames=8, **TINY
    )
    it = iter(loader)
    batches = [next(it) for _ in range(b + 2)]
    assert [sorted(k.rsplit("#", 1)[1] for k in batch.sample_keys[0]) for batch in batches] == [
        sorted(keys) if j != b else [] for j, keys in enumerate(sequences[: b + 2])
    ]
    pad = batches[b]
    assert pad.sample_keys == [[]] and pad.num_loss_tokens == 0 and (pad.labels == -100).all()
    assert pad.stats["skipped/image_decode"] == len(sequences[b])


def _break_an_image(root: Path, keys: list[str]) -> str:
    """Overwrite the first image of one of `keys` in its tar with zeros (the same size, so
    energon's index still holds): it no longer decodes. The key broken."""
    for shard in sorted(root.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            hit = next((m for m in tar.getmembers() if m.name.split(".")[0] in keys and ".img" in m.name), None)
        if hit is not None:
            with shard.open("r+b") as f:
                f.seek(hit.offset_data)
                f.write(bytes(hit.size))
            return hit.name.split(".")[0]
    raise AssertionError("no sample with an image in the step")


def test_a_carried_sample_is_read_again_in_the_next_row_and_its_bytes_count_once(two_sources):
    """Lengths the planner underestimates (half the real ones) overpack its rows: samples that
    do not fit are carried into the next row, which reads them again; the bytes read are each
    planned sample's once, not once per read."""
    data, tok = two_sources
    loader = _build(data, tok, 0, 1, 0, 1)
    real = loader.planner
    sources = [dataclasses.replace(s, lengths=s.lengths // 2) for s in real.sources]
    lying = StepPlanner(sources, real.blend, SEQ, G, window_steps=2)
    config = WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = GlobalOrderDataset(
        lying, loader.task_encoder, start=lying.document(lying.initial_state(), 0), micro_batch_size=1,
        balance=True, worker_config=config,
    )  # fmt: skip
    config.worker_activate(0)  # as energon's loader does around a dataset's iteration
    try:
        batches = [b for b, _ in zip(dataset, range(G))]
    finally:
        config.worker_deactivate()
    carried = sum(b.stats.get("plan_carried", 0) for b in batches)
    members = set(lying.window(lying.initial_state())[0][0].members())  # step 0's
    assert carried > 0 and [b.global_order["step"] for b in batches] == [0] * G
    size = sum(lying.sample_at(m)[4] for m in members)
    assert sum(b.global_order["bytes_read"] for b in batches) == size
    _close([loader])


def test_a_metadataset_yaml_is_refused_in_global_order(two_sources, tmp_path):
    from mmdata.energon_loaders.loader import write_blend_yaml

    data, tok = two_sources
    yaml_path = write_blend_yaml(tmp_path / "blend.yaml", [(data[0], 1.0)])
    with pytest.raises(UserError, match=r"not a metadataset YAML: list its folders in data.paths .* data.blend"):
        _build(yaml_path, tok, 0, 1, 0, 1)
    with pytest.raises(UserError, match="global_batch_size 6 is not a multiple of dp x micro_batch_size = 4 x 1"):
        _build(data, tok, 0, 4, 0, 1)


@pytest.mark.unit
def test_workers_and_ranks_make_every_micro_batch_of_a_step_once():
    """Without reading: a rank's worker w makes its micro-batches w, w + W, ... in step order, and
    over the ranks and workers every row of a step is made once, at any layout and start step."""
    rng = np.random.default_rng(0)
    sources = [
        OrderSource.from_arrays("a", rng.integers(50, 400, 300)),
        OrderSource.from_arrays("b", rng.integers(50, 900, 200)),
    ]
    planner = StepPlanner(sources, None, 1024, 12, seed=3)
    start = planner.document(planner.initial_state(), 0)
    for dp, workers, micro in ((1, 1, 2), (2, 3, 3), (3, 2, 1), (4, 0, 3)):
        made: dict[int, list[int]] = defaultdict(list)
        for rank in range(dp):
            for w in range(max(1, workers)):
                wc = WorkerConfig(rank=rank, world_size=dp, num_workers=workers)
                ds = GlobalOrderDataset(
                    planner, None, start=start, micro_batch_size=micro, balance=True, worker_config=wc
                )
                previous = -1
                for planned, m, rows in ds.micro_batches(w):
                    if planned.step >= 5:
                        break
                    j = planned.step * ds.shape.micro_batches + m
                    assert j % max(1, workers) == w and j > previous
                    previous = j
                    made[planned.step] += rows
        assert all(sorted(made[t]) == list(range(12)) for t in range(5)), (dp, workers, micro)


def test_emu3_token_shards_follow_the_order_with_their_planned_tasks(token_dir, emu3_tok_dir):
    """Emu3 token shards (keys with gaps, a task and caption drop drawn per sample and epoch from the
    seed): at DP 1 and DP 2 (no workers: the other test covers them), each step trains the
    planner's samples, each in its planned task, at exactly its planned length."""
    from mmdata.energon_loaders.emu3.loader import build_emu3_loader
    from mmdata.packing.emu3_geometry import GENERATE, GENERATE_UNCOND, UNDERSTAND

    encoder = {"p_uncond": 0.5, "uncond_prompt": "a picture", "tasks": {"understanding": 1.0, "generation": 2.0}}
    task = {UNDERSTAND: "understanding", GENERATE: "generation", GENERATE_UNCOND: "generation"}

    def build(rank: int, dp: int, workers: int):
        return build_emu3_loader(
            token_dir,
            emu3_tok_dir,
            seq_length=SEQ,
            micro_batch_size=1,
            dp_rank=rank,
            dp_size=dp,
            num_workers=workers,
            encoder=encoder,
            sharding="global",
            global_batch_size=2,
            seed=3,
        )

    planner = build(0, 1, 0).planner
    (source,) = planner.sources
    drawn = planner.streams.variants(0, np.arange(len(source)))
    assert source.keys is not None and {UNDERSTAND, GENERATE, GENERATE_UNCOND} <= set(drawn.tolist())
    planned = list(_planned(planner, 3))
    for dp, workers in ((1, 0), (2, 0)):
        got: dict[int, list[tuple[str, str, int]]] = defaultdict(list)
        for rank in range(dp):
            loader = build(rank, dp, workers)
            it = iter(loader)
            while loader.next_step < 3:
                batch = next(it)  # one row (micro-batch 1): its samples' segments, then padding
                (keys,) = batch.sample_keys
                lengths = np.diff(batch.cu_seqlens.tolist())[: len(keys)].tolist()
                got[batch.global_order["step"]] += list(zip(keys, batch.tasks[0], lengths))
        for t, (_, _, step) in enumerate(planned):
            expect = [
                (
                    f"{source.root}#{source.key(k)}",
                    task[planner.sample_at(m)[3]],
                    int(planner.streams.lengths(0, [m[1]])[0]),
                )
                for row in step.rows
                for m, k in zip(row.members, row.samples)
            ]
            assert sorted(got[t]) == sorted(expect), (dp, t)
    pad = loader.task_encoder.batch_rows([[]])  # a row whose samples were all skipped: padding
    assert pad.sample_keys == [[]] and pad.tasks == [[]] and pad.num_loss_tokens == 0
    assert tuple(pad.input_ids.shape) == (1, SEQ) and pad.cu_seqlens.tolist() == [0, SEQ]
