"""Vision-aware balancing (mmdata/packing/balance.py): the placement of a step's rows over
DP ranks and micro-batches, the tiered order of balanced plans, the figure they are judged by, the
cost of a tile, and the per-sample vision tiles of the length index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmdata.packing.balance import (
    DEFAULT_TILE_TOKENS,
    StepShape,
    assign_block,
    assign_step,
    assign_window,
    auto_window,
    plan_balance,
    row_costs,
    shuffle_tiers,
    simulate,
    step_balance,
    tiered_order,
)
from benchmarks.mixes import llava_ov_mix as _mix
from tests.fixtures_training import dp_context

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]


def test_assign_step_places_every_row_once_and_keeps_the_counts():
    rng = np.random.default_rng(0)
    micro = [[2, 2]] * 8
    costs = [rng.uniform(1, 100, 4).tolist() for _ in range(8)]
    placed = assign_step(costs, micro)
    assert sorted(ref for rank in placed for mb in rank for ref in mb) == [(r, k) for r in range(8) for k in range(4)]
    assert [[len(mb) for mb in rank] for rank in placed] == micro
    assert assign_step(costs, micro) == placed  # a pure function of the costs: ranks agree without talking
    loads = [sum(costs[r][k] for mb in rank for r, k in mb) for rank in placed]
    drawn = [sum(c) for c in costs]
    assert max(loads) / np.mean(loads) < max(drawn) / np.mean(drawn)
    assert max(loads) - min(loads) <= max(max(c) for c in costs)  # longest-first: within one row of even
    # within a rank the heavier rows spread over its micro-batches (longest first, least loaded)
    assert assign_step([[9.0, 8.0, 1.0, 0.5]], [[2, 2]]) == [[[(0, 0), (0, 3)], [(0, 1), (0, 2)]]]
    # one row per rank: nothing to gain, and no row moves
    assert assign_step([[5.0], [1.0], [3.0]], [[1], [1], [1]]) == [[[(0, 0)]], [[(1, 0)]], [[(2, 0)]]]
    with pytest.raises(ValueError, match="rank 1: 2 rows but micro-batches of"):
        assign_step([[1.0], [1.0, 2.0]], [[1], [1]])


def test_balancing_meets_the_target_on_a_mixed_stream():
    """8 DP ranks, micro-batch 2, 2 micro-batches per step: per-step max/mean vision work of the
    online packer's rows (over 1.1 with the plain knapsack's rows) drops to at most 1.10 when the
    step is placed by assign_step; a balanced plan (tiers + per-step placement) gets closer to 1."""
    from mmdata.inspect.packing import online_rank_rows
    from mmdata.packing.algorithm import plan_packing

    tokens, tiles = _mix(2400, seed=1)
    shape = StepShape(dp=8, micro_batch_size=2, global_batch_size=32)
    online = simulate(online_rank_rows(tokens, tiles, 8192, shape.dp), shape, DEFAULT_TILE_TOKENS)
    assert online["today"].steps == online["balanced"].steps >= 10
    assert simulate(_knapsack_rank_rows(tokens, tiles, 8192, shape.dp), shape, DEFAULT_TILE_TOKENS)["today"].mean > 1.1
    assert online["balanced"].mean <= 1.10 and online["balanced"].mean < online["today"].mean
    assert online["balanced"].worst < online["today"].worst
    plan = plan_packing(tokens, 8192)
    today = plan.vision_balance(tiles, shape, DEFAULT_TILE_TOKENS, balanced=False)
    balanced = plan.balanced(tiles, shape, DEFAULT_TILE_TOKENS, seed=0)
    after = balanced.vision_balance(tiles, shape, DEFAULT_TILE_TOKENS, balanced=True)
    assert today.mean > 1.1 and after.mean <= 1.03 and after.worst < today.worst
    assert sorted(np.concatenate(balanced.bins).tolist()) == list(range(len(tokens)))  # reordered, not regrouped
    assert {tuple(b) for b in balanced.bins} == {tuple(b) for b in plan.bins}
    # at one row per rank per step one step's rows cannot be evened: a window of steps (online) or
    # the plan's steps of equal-cost rows can
    one = StepShape(dp=8, micro_batch_size=1, global_batch_size=8)
    online_one = simulate(
        online_rank_rows(tokens, tiles, 8192, one.dp), one, DEFAULT_TILE_TOKENS, window=auto_window(one.rows_per_rank)
    )
    assert online_one["balanced"].mean == pytest.approx(online_one["today"].mean)
    assert online_one["today"].mean > 1.1
    assert online_one["windowed"].mean <= 1.10 and online_one["windowed"].worst < online_one["today"].worst
    plan_one = plan.balanced(tiles, one, DEFAULT_TILE_TOKENS, seed=0).vision_balance(
        tiles, one, DEFAULT_TILE_TOKENS, balanced=True
    )
    assert plan_one.mean <= 1.03


def test_assign_window_spreads_rows_over_steps_and_keeps_every_shape():
    """A window of steps: every row placed once, each step, rank and micro-batch keeping its row
    count; at one row per rank per step the steps' ranks come out even where each step alone
    cannot move a row; one step is `assign_step`; steps of different shapes are each placed alone."""
    rng = np.random.default_rng(3)
    dp, steps = 8, 8
    tiles = rng.choice([2, 3, 5, 7, 25], size=(dp, steps), p=[0.4, 0.2, 0.25, 0.13, 0.02])
    costs = (8000 + DEFAULT_TILE_TOKENS * tiles).tolist()  # full rows: tiles make the difference
    shapes = [[[1]] * dp] * steps
    placed = assign_window(costs, shapes)
    assert len(placed) == steps and all([[len(mb) for mb in rank] for rank in step] == [[1]] * dp for step in placed)
    assert sorted(ref for step in placed for rank in step for mb in rank for ref in mb) == [
        (r, k) for r in range(dp) for k in range(steps)
    ]
    assert assign_window(costs, shapes) == placed  # pure: ranks and resumed runs agree
    drawn = [step_balance([[int(tiles[r][s])] for r in range(dp)]) for s in range(steps)]
    evened = [step_balance(tiles.tolist(), step) for step in placed]
    assert np.mean(evened) < 1.10 < np.mean(drawn)
    assert assign_window([c[:1] for c in costs], [shapes[0]]) == [assign_step([c[:1] for c in costs], shapes[0])]
    # micro-batches of 2 rows, 2 per rank, over 3 steps: counts kept, rows of one step may move
    costs2 = rng.uniform(1, 100, (4, 12)).tolist()
    placed2 = assign_window(costs2, [[[2, 2]] * 4] * 3)
    assert all([[len(mb) for mb in rank] for rank in step] == [[2, 2]] * 4 for step in placed2)
    assert sorted(ref for step in placed2 for rank in step for mb in rank for ref in mb) == [
        (r, k) for r in range(4) for k in range(12)
    ]
    # steps of different shapes (a short last batch): each balanced on its own rows
    odd = [[[2]] * 2, [[1]] * 2]
    costs3 = [[5.0, 1.0, 9.0], [4.0, 2.0, 3.0]]
    assert assign_window(costs3, odd) == [assign_step([[5.0, 1.0], [4.0, 2.0]], [[2], [2]]), [[[(0, 2)]], [[(1, 2)]]]]
    with pytest.raises(ValueError, match="rank 1: 2 rows but the window"):
        assign_window([[1.0, 2.0], [1.0, 2.0]], [[[1], [1]], [[1], [2]]])
    with pytest.raises(ValueError, match="2 ranks of costs but step 1 has micro-batch sizes for 1"):
        assign_window([[1.0, 2.0], [1.0, 2.0]], [[[1], [1]], [[1]]])
    assert [auto_window(k) for k in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_tiered_order_makes_steps_of_whole_tiers_and_later_epochs_keep_them():
    rng = np.random.default_rng(3)
    costs = rng.uniform(0, 10, 45)
    order = tiered_order(costs, 4, np.random.default_rng(0))
    assert sorted(order.tolist()) == list(range(45))
    tiers = costs[order[:44]].reshape(11, 4)
    ranked = np.sort(costs)[::-1]
    assert sorted(map(tuple, np.sort(tiers, axis=1))) == sorted(map(tuple, np.sort(ranked[:44].reshape(11, 4), axis=1)))
    assert order[44] == int(np.argmin(costs))  # the short tier (the cheapest) ends the order
    moved = shuffle_tiers(45, 4, np.random.default_rng(7))
    assert sorted(moved.tolist()) == list(range(45)) and moved[44] == 44
    assert all(set(moved[4 * t : 4 * t + 4] // 4) == {moved[4 * t] // 4} for t in range(11))  # whole tiers
    assert moved.tolist() != list(range(45))


def test_assign_block_and_plan_balance_agree():
    shape = StepShape(dp=2, micro_batch_size=2, global_batch_size=8)
    costs = [8.0, 1.0, 7.0, 2.0, 6.0, 3.0, 5.0, 4.0]
    placed = assign_block(costs, shape)
    assert sorted(j for rank in placed for mb in rank for j in mb) == list(range(8))
    assert [[len(mb) for mb in rank] for rank in placed] == [[2, 2], [2, 2]]
    loads = [sum(costs[j] for mb in rank for j in mb) for rank in placed]
    assert loads == [18.0, 18.0]
    tiles = np.array([8, 1, 7, 2, 6, 3, 5, 4])
    zeros = np.zeros(8, dtype=np.int64)
    assert plan_balance(zeros, tiles, shape, 1.0, balanced=True).mean == pytest.approx(1.0)
    # the plain contract deals positions 0, 2, 4, 6 to rank 0: 26 of 36 tiles
    assert plan_balance(zeros, tiles, shape, 1.0, balanced=False).mean == pytest.approx(26 / 18)
    assert step_balance([[8, 7], [1, 2]]) == pytest.approx(15 / 9)
    assert step_balance([[0], [0]]) is None
    with pytest.raises(ValueError, match="not a multiple of dp x micro_batch_size"):
        StepShape(dp=3, micro_batch_size=2, global_batch_size=8)


def test_a_tile_costs_what_the_cost_model_says():
    from mmtrain.config import load_recipe
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.models.flops import tile_token_cost

    aquila = load_recipe(REPO / "recipes" / "aquila-vl-2b.yaml", ["action=dry_run"])
    assert tile_token_cost(LLAVA_OV.model_shapes(aquila.model)) == pytest.approx(DEFAULT_TILE_TOKENS, rel=0.01)
    tiny = load_recipe(REPO / "recipes" / "llava-ov-tiny.yaml", ["action=dry_run"])
    assert tile_token_cost(LLAVA_OV.model_shapes(tiny.model)) < 10  # a 2-layer 32-wide tower: about a token
    assert row_costs([100, 0], [1, 2], 210.0).tolist() == [310.0, 420.0]


def test_media_tiles_are_what_the_tower_encodes():
    """media_layout.media.media_tiles from header sizes = the tiles the LLaVA-OV loader cuts."""
    from PIL import Image

    from mmdata.energon_loaders.llava_ov import anyres
    from mmdata.media_layout.media import media_tiles

    for h, w in ((47, 95), (120, 61), (30, 30), (900, 200)):
        record = {"meta": {"image_sizes": [[w, h, "jpg"]]}}
        tiles = anyres.prepare_image(Image.new("RGB", (w, h)), 9, image_size=30, patch_size=14).num_tiles
        assert media_tiles(record, image_size=30) == tiles, (h, w)
    assert media_tiles({"meta": {"image_sizes": [[40, 20, "png"], [10, 50, "png"], [5, 5, "png"]]}}) == 3
    assert media_tiles({"meta": {"video_size_frames": [64, 48, 100]}}, video_frames=8) == 8
    assert media_tiles({"meta": {"video_size_frames": [64, 48, 5]}}) == 5
    assert media_tiles({"conversations": []}) == 0


def test_train_data_balances_replicated_steps(tmp_path):
    """`data.balance: true` in the train loop's data feed (DP rank 0 of 2, replicated data, so no
    exchange): each step the feed hands over its rank's share of the rows it drew, placed by
    `RowBalancer`: the two ranks' shares hold the step's samples, two micro-batches of two rows
    each, and their costs (tokens + the tiny tower's tile cost x tiles) are more even than drawn."""

    from mmdata.packing.balance import vision_balance
    from mmdata.dev.shards import write_dev_shards
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from mmtrain.config import load_recipe
    from mmtrain.llava_ov.spec import LLAVA_OV, encoder_inputs
    from mmtrain.models.flops import tile_token_cost
    from mmtrain.runtime.train_data import TrainData, batch_sample_ids
    from tests.fixtures_loader import BAD_IDS, llava_dev_samples

    shards = write_dev_shards(tmp_path / "shards", [s for s in llava_dev_samples() if s.id not in BAD_IDS])
    recipe = load_recipe(
        REPO / "recipes" / "llava-ov-tiny.yaml",
        [
            f"data.paths=[{shards}]",
            f"tokenizer.path={build_tiny_qwen2_tokenizer(tmp_path / 'tok')}",
            "data.num_workers=0",
            "train.seq_length=256",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "data.sharding=replicated",
            "data.video_frames=4",
            "data.balance=true",
            "data.balance_window=1",
        ],
    )
    ctx = dp_context(0, dp=2)
    data = TrainData(LLAVA_OV, recipe, ctx)
    place, drawn = type(data.balancer)(data.balancer.tile_tokens, data.balancer.tiles_of).balance_local, []
    data.balancer.balance_window_local = lambda ranks, me: (
        drawn.append([s[0] for s in ranks]),
        [place(drawn[-1], me)],
    )[1]
    tile_tokens = tile_token_cost(LLAVA_OV.model_shapes(recipe.model))

    def cost(micro_batches) -> float:
        return sum(mb.num_real_tokens + tile_tokens * encoder_inputs(mb) for mb in micro_batches)

    before, after = [], []
    try:
        for _ in range(4):
            step = data.next_step()
            ranks = drawn[-1]
            other = place(ranks, 1)
            assert len(ranks) == 2 and all(len(mbs) == 2 for mbs in ranks)
            assert all(mb.input_ids.shape == (2, 256) for mb in step.micro_batches + other)
            ids = sorted(step.sample_ids + [i for mb in other for i in batch_sample_ids(mb)])
            assert ids == sorted(i for mbs in ranks for mb in mbs for i in batch_sample_ids(mb))
            before.append(vision_balance([cost(mbs) for mbs in ranks]))
            after.append(vision_balance([cost(step.micro_batches), cost(other)]))
    finally:
        data.close()
    assert np.mean(after) < np.mean(before), (before, after)


def test_train_data_windows_steps_and_resumes_inside_a_window(tmp_path):
    """`data.balance_window: 4` at one row per rank per step (DP2, replicated data, so both ranks'
    feeds run here without an exchange): each window's 4 steps train exactly the rows drawn for
    them, one per rank per step, with their vision work more even than drawn; a loader state saved
    inside a window names the steps trained, and a fresh feed restored from it hands out the same
    rest of the window and the windows after, byte for byte; after a whole window the state is the
    loader's own."""
    import json

    from mmdata.packing.balance import vision_balance
    from mmdata.dev.shards import write_dev_shards
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from mmtrain.config import load_recipe
    from mmtrain.llava_ov.spec import LLAVA_OV, encoder_inputs
    from mmtrain.runtime.train_data import WINDOW_STATE_KEY, TrainData, batch_sample_ids
    from tests.fixtures_loader import BAD_IDS, llava_dev_samples

    shards = write_dev_shards(tmp_path / "shards", [s for s in llava_dev_samples() if s.id not in BAD_IDS])
    common = [
        f"data.paths=[{shards}]",
        f"tokenizer.path={build_tiny_qwen2_tokenizer(tmp_path / 'tok')}",
        "data.num_workers=0",
        "train.seq_length=256",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "data.sharding=replicated",
        "data.video_frames=4",
    ]
    recipe = load_recipe(
        REPO / "recipes" / "llava-ov-tiny.yaml", [*common, "data.balance=true", "data.balance_window=4"]
    )

    def feed(rank: int, r=recipe) -> TrainData:
        return TrainData(
            LLAVA_OV,
            r,
            dp_context(rank, dp=2),
        )

    def ids(steps) -> list[str]:
        return sorted(i for step in steps for mb in step.micro_batches for i in batch_sample_ids(mb))

    ranks, drawn_feed = [feed(0), feed(1)], feed(0, load_recipe(REPO / "recipes" / "llava-ov-tiny.yaml", common))
    try:
        assert ranks[0].window == 4
        steps: list[list] = [[], []]
        for i in range(8):
            for r in (0, 1):
                steps[r].append(ranks[r].next_step())
            if i == 1:
                inside = ranks[0].save_state()
            if i == 3:
                after_window = ranks[0].save_state()
        drawn = [drawn_feed._next_micro_batch() for _ in range(16)]  # the stream, 2 rows a step
    finally:
        for d in (*ranks, drawn_feed):
            d.close()
    assert json.loads(inside)[WINDOW_STATE_KEY] == {"steps": 4, "trained": 2}
    assert WINDOW_STATE_KEY not in json.loads(after_window)
    before, after = [], []
    for w in (0, 1):
        window_drawn = drawn[8 * w : 8 * w + 8]
        window_steps = [s for r in (0, 1) for s in steps[r][4 * w : 4 * w + 4]]
        assert all(len(s.micro_batches) == 1 and s.micro_batches[0].input_ids.shape == (1, 256) for s in window_steps)
        assert ids(window_steps) == sorted(i for mb in window_drawn for i in batch_sample_ids(mb))
        before += [vision_balance([encoder_inputs(window_drawn[2 * k + r]) for r in (0, 1)]) for k in range(4)]
        after += [
            vision_balance([encoder_inputs(steps[r][4 * w + k].micro_batches[0]) for r in (0, 1)]) for k in range(4)
        ]
    assert np.mean([b for b in after if b]) < np.mean([b for b in before if b]), (before, after)
    resumed = feed(0)
    try:
        resumed.restore_state(inside)
        rest = [resumed.next_step() for _ in range(6)]
    finally:
        resumed.close()
    assert [[mb.to_bytes() for mb in s.micro_batches] for s in rest] == [
        [mb.to_bytes() for mb in s.micro_batches] for s in steps[0][2:]
    ]


def _knapsack_rank_rows(tokens: np.ndarray, tiles: np.ndarray, context: int, dp: int) -> list[list[tuple[int, int]]]:
    """`online_rank_rows` as it was before rows were evened: the plain knapsack per buffer."""
    from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER
    from mmdata.packing.knapsack import largest_first_knapsack

    out = []
    for r in range(dp):
        part = slice(r * len(tokens) // dp, (r + 1) * len(tokens) // dp)
        n, t = np.minimum(tokens[part], context), tiles[part]
        rows: list[tuple[int, int]] = []
        for s in range(0, len(n), DEFAULT_PACKING_BUFFER):
            chunk, chunk_tiles = n[s : s + DEFAULT_PACKING_BUFFER], t[s : s + DEFAULT_PACKING_BUFFER]
            rows += [(int(chunk[b].sum()), int(chunk_tiles[b].sum())) for b in largest_first_knapsack(chunk, context)]
        out.append(rows)
    return out


def test_row_mix_packer_evens_tiles_at_the_knapsacks_fill():
    """`pack_buffer` (the online packer): on buffers of the mix, the same rows as the knapsack
    (count, so fill) with every sample once and no row over capacity or empty, tiles per row far
    more even, and so a lower per-step imbalance at one row per rank; deterministic; a buffer
    without tiles (Emu3, text) packed exactly as the knapsack packs it."""
    from mmdata.packing.knapsack import largest_first_knapsack
    from mmdata.energon_loaders.row_mix import pack_buffer
    from mmdata.inspect.packing import online_rank_rows

    tokens, tiles = _mix(1024, seed=2)
    for s in range(0, 1024, 256):
        n, t = tokens[s : s + 256].tolist(), tiles[s : s + 256].tolist()
        plain, mixed = largest_first_knapsack(n, 8192), pack_buffer(n, t, 8192)
        assert sorted(i for b in mixed for i in b) == list(range(256))
        assert len(mixed) == len(plain) and all(b and sum(n[i] for i in b) <= 8192 for b in mixed)
        assert pack_buffer(n, t, 8192) == mixed
        row_tiles = lambda bins, t=t: np.array([sum(t[i] for i in b) for b in bins])  # noqa: E731
        mean = np.mean(row_tiles(plain))  # rows without a sample of more tiles than that can be evened
        spread = [np.std(row_tiles(bins)[[max(t[i] for i in b) <= mean for b in bins]]) for bins in (plain, mixed)]
        assert spread[1] < 0.7 * spread[0]
        assert np.ptp(row_tiles(mixed)[[max(t[i] for i in b) <= mean for b in mixed]]) <= 4
        assert pack_buffer(n, [0] * 256, 8192) == largest_first_knapsack(n, 8192)
    one = StepShape(dp=8, micro_batch_size=1, global_batch_size=8)
    before = simulate(_knapsack_rank_rows(tokens, tiles, 8192, 8), one, DEFAULT_TILE_TOKENS)["today"]
    after = simulate(online_rank_rows(tokens, tiles, 8192, 8), one, DEFAULT_TILE_TOKENS)["today"]
    assert after.steps == before.steps and after.mean < before.mean - 0.03
