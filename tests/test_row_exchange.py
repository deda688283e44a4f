"""The DP exchange of vision-aware balancing over gloo (2 processes, no model): every rank ends
with exactly the micro-batches the placement gives it, rows arrive byte-identical, and the
result equals what one process computes holding every rank's rows (`balance_local`, the
replicated path), so the ranks agree and a resumed run that draws the same rows places them the
same; the same for a window of steps (`balance_window_exchange`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORLD = 2
MICRO, ROWS = 2, 2  # micro-batches per rank, rows per micro-batch
SEQ = 64
WINDOW = 3  # steps of one row per rank balanced together


def _row(rank: int, k: int, step: int = 0) -> "object":
    """Rank `rank`'s k-th row: a LlavaOVBatch with 0-3 media of 1-5 tiles, tokens and samples."""
    from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, LlavaOVBatch

    g = torch.Generator().manual_seed(1000 * step + 100 * rank + k)
    media = int(torch.randint(0, 4, (1,), generator=g)) if rank != 1 else 3 * (k % 2)  # rank 1: heavy rows
    tiles = torch.randint(1, 6, (media,), generator=g)
    n = int(torch.randint(10, SEQ, (1,), generator=g))
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    ids[0, :n] = torch.randint(1, 50, (n,), generator=g)
    return LlavaOVBatch(
        input_ids=ids,
        labels=ids.clone(),
        position_ids=ids.clone(),
        cu_seqlens=torch.tensor([0, n, SEQ], dtype=torch.int32),
        max_seqlen=max(n, SEQ - n),
        sample_ids=[[f"r{rank}k{k}s{step}"]],
        sample_keys=[[f"d#{step}{rank:03d}{k:03d}"]],
        num_real_tokens=n,
        pixel_values=torch.randint(0, 255, (int(tiles.sum()), 3, 4, 4), dtype=torch.uint8, generator=g),
        tiles_per_media=tiles,
        media_kind=torch.full((media,), MEDIA_ANYRES),
        image_sizes=torch.ones(media, 2).long(),
        grid_shapes=torch.zeros(media, 2).long(),
        num_media_tokens=tiles * 3,
        media_per_row=[media],
        stats={"truncated": k} if k == 0 else {},
    )


def drawn(rank: int, step: int = 0) -> list:
    """Rank `rank`'s micro-batches of a step, as its loader would yield them."""
    from mmdata.energon_loaders.llava_ov.batch import LlavaOVBatch

    return [LlavaOVBatch.join_rows([_row(rank, m * ROWS + i, step) for i in range(ROWS)]) for m in range(MICRO)]


def drawn_window(rank: int) -> list:
    """Rank `rank`'s steps of a window: 3 steps of one row, one micro-batch each."""
    return [[_row(rank, 0, step)] for step in range(WINDOW)]


def _balancer():
    from mmtrain.llava_ov.spec import encoder_inputs
    from mmtrain.runtime.row_exchange import RowBalancer

    return RowBalancer(210.0, encoder_inputs)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mine = _balancer().balance_exchange(drawn(rank), dist.group.WORLD, torch.device("cpu"))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps([mb.to_bytes().hex() for mb in mine]))
        steps = _balancer().balance_window_exchange(drawn_window(rank), dist.group.WORLD, torch.device("cpu"))
        Path(out_dir, f"window{rank}.json").write_text(json.dumps([[mb.to_bytes().hex() for mb in s] for s in steps]))
    finally:
        dist.destroy_process_group()


def test_exchange_over_gloo_equals_the_local_placement(tmp_path):
    import torch.multiprocessing as mp

    from mmdata.energon_loaders.llava_ov.batch import LlavaOVBatch
    from mmtrain.llava_ov.spec import encoder_inputs

    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    everyone = [drawn(r) for r in range(WORLD)]
    balancer = _balancer()
    tiles_after = []
    for rank in range(WORLD):
        got = [
            LlavaOVBatch.from_bytes(bytes.fromhex(h)) for h in json.loads((tmp_path / f"rank{rank}.json").read_text())
        ]
        want = balancer.balance_local(everyone, rank)
        assert [mb.sample_ids for mb in got] == [mb.sample_ids for mb in want]
        assert [mb.to_bytes() for mb in got] == [mb.to_bytes() for mb in want]  # every field, every byte
        assert all(mb.input_ids.shape == (ROWS, SEQ) for mb in got)
        tiles_after.append(sum(encoder_inputs(mb) for mb in got))
    tiles_before = [sum(encoder_inputs(mb) for mb in mbs) for mbs in everyone]
    assert sum(tiles_after) == sum(tiles_before)
    assert max(tiles_after) / (sum(tiles_after) / WORLD) < max(tiles_before) / (sum(tiles_before) / WORLD)
    # rows that moved were sent: some of rank 1's heavy rows now train elsewhere
    placed_ids = {
        sid
        for rank in range(WORLD)
        for mb in balancer.balance_local(everyone, rank)
        for row in mb.sample_ids
        for sid in row
        if rank != 1
    }
    assert any(sid.startswith("r1") for sid in placed_ids)
    # a window of steps: the same as one process places it, every row trained once, one per rank per step
    windows = [drawn_window(r) for r in range(WORLD)]
    got_ids = []
    for rank in range(WORLD):
        got = [
            [LlavaOVBatch.from_bytes(bytes.fromhex(h)) for h in s]
            for s in json.loads((tmp_path / f"window{rank}.json").read_text())
        ]
        want = balancer.balance_window_local(windows, rank)
        assert [[mb.to_bytes() for mb in s] for s in got] == [[mb.to_bytes() for mb in s] for s in want]
        assert [[mb.input_ids.shape for mb in s] for s in got] == [[(1, SEQ)]] * WINDOW
        got_ids += [sid for s in got for mb in s for row in mb.sample_ids for sid in row]
    assert sorted(got_ids) == sorted(f"r{r}k0s{s}" for r in range(WORLD) for s in range(WINDOW))
