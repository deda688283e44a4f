"""Vision-aware balancing of a step's rows in the train loop (`data.balance: true`, online packing).

Each DP rank's loader sees only its own stream, so the ranks balance a step together: every rank
draws its micro-batches as usual, the ranks gather each row's cost (its real tokens and the tiles
its vision tower encodes: a few integers per row) over the data-parallel group, all compute the
same placement (`mmdata.packing.balance.assign_step`: longest first, each rank and
micro-batch keeping its row count), and the rows that change rank travel whole, as bytes
(`PackedBatch.to_bytes`, no pickle), by point-to-point sends within the group; each rank joins the
rows it now holds into its micro-batches. With `data.sharding: replicated` every rank holds the
whole step already and nothing is sent.

What it keeps: the placement is a function of the rows drawn, and the loaders' states are saved
between steps, so a resumed run draws the same rows and places them the same (exact resume); a
row is the same tokens, media and `cu_seqlens` wherever it trains, so every sample's loss is
what it would have been unbalanced (megatron's per-token loss sums over all rows of all ranks).
All TP/PP/CP ranks of one DP rank hold the same batches and make the same exchange with their
peers of the other DP ranks (megatron's data-parallel group is exactly those peers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mmdata.packing.balance import RowRef, assign_window, row_costs
from mmdata.energon_loaders.batch import PackedBatch


class RowBalancer:
    """Places a step's rows by cost: `tile_tokens` is a tile's cost in tokens (the cost model's
    `tile_token_cost`), `tiles_of(batch)` the tiles/frames a batch's vision tower encodes (the
    family's `encoder_inputs`; None: no encoder)."""

    def __init__(self, tile_tokens: float, tiles_of: Callable[[Any], int] | None) -> None:
        self.tile_tokens = float(tile_tokens)
        self.tiles_of = tiles_of

    def _row_cost_inputs(self, rows: Sequence[PackedBatch]) -> tuple[list[int], list[int]]:
        tiles = [int(self.tiles_of(r)) if self.tiles_of is not None else 0 for r in rows]
        return [int(r.num_real_tokens) for r in rows], tiles

    def balance_local(self, ranks: Sequence[Sequence[PackedBatch]], me: int) -> list[PackedBatch]:
        """Rank `me`'s micro-batches of one step when every rank's are here (replicated data)."""
        return self.balance_window_local([[mbs] for mbs in ranks], me)[0]

    def balance_window_local(
        self, ranks: Sequence[Sequence[Sequence[PackedBatch]]], me: int
    ) -> list[list[PackedBatch]]:
        """Rank `me`'s micro-batches, step by step, of a window of steps when every rank's are here:
        `ranks[r][s]` is rank r's micro-batches drawn for step s."""
        rows = [[row for mbs in steps for mb in mbs for row in mb.split_rows()] for steps in ranks]
        costs = [row_costs(*self._row_cost_inputs(r), self.tile_tokens) for r in rows]
        shapes = [[[_rows(mb) for mb in ranks[r][s]] for r in range(len(ranks))] for s in range(len(ranks[0]))]
        # (type checker: numpy rows of floats are sequences of floats)
        placed = assign_window(costs, shapes)  # type: ignore[arg-type]
        return [[type(rows[me][0]).join_rows([rows[r][k] for r, k in micro]) for micro in step[me]] for step in placed]

    def balance_exchange(
        self, micro_batches: Sequence[PackedBatch], group: Any, device: torch.device
    ) -> list[PackedBatch]:
        """This rank's micro-batches of one step after the DP group's exchange (a collective)."""
        return self.balance_window_exchange([micro_batches], group, device)[0]

    def balance_window_exchange(
        self, steps: Sequence[Sequence[PackedBatch]], group: Any, device: torch.device
    ) -> list[list[PackedBatch]]:
        """This rank's micro-batches, step by step, after the DP group's exchange of a window of
        steps (a collective: every rank of `group` calls it with its own micro-batches of the same
        steps, `steps[s]` those drawn for step s)."""
        world, me = dist.get_world_size(group), dist.get_rank(group)
        rows = [row for mbs in steps for mb in mbs for row in mb.split_rows()]
        shape = [len(steps)] + [v for mbs in steps for v in (len(mbs), *(_rows(mb) for mb in mbs))]
        tokens, tiles = self._row_cost_inputs(rows)
        gathered = _all_gather_ints([len(shape), *shape, *tokens, *tiles], group, device)
        all_shapes, costs = [], []
        for g in gathered:
            head, n = g[1 : 1 + g[0]], (len(g) - 1 - g[0]) // 2
            all_shapes.append(_step_shapes(head))
            costs.append(row_costs(g[1 + g[0] : 1 + g[0] + n], g[1 + g[0] + n :], self.tile_tokens))
        # (type checker: numpy rows of floats are sequences of floats)
        placed = assign_window(costs, [[all_shapes[r][s] for r in range(world)] for s in range(len(steps))])  # type: ignore[arg-type]
        mine = [ref for step in placed for micro in step[me] for ref in micro]
        # what leaves this rank and what arrives, in one order every rank agrees on
        sends = sorted(
            (d, k) for step in placed for d in range(world) for mb in step[d] for r, k in mb if r == me and d != me
        )
        recvs = sorted((r, k) for r, k in mine if r != me)
        payload = {k: rows[k].to_bytes() for _, k in sends}
        sizes = _all_gather_ints([len(rows), *[len(payload.get(k, b"")) for k in range(len(rows))]], group, device)
        received = _exchange(sends, recvs, payload, [s[1:] for s in sizes], group, device)
        batch_type = type(rows[0]) if rows else PackedBatch
        got = {ref: batch_type.from_bytes(data) for ref, data in received.items()}
        return [
            [batch_type.join_rows([rows[k] if r == me else got[(r, k)] for r, k in mb]) for mb in step[me]]
            for step in placed
        ]


def _step_shapes(head: Sequence[int]) -> list[list[int]]:
    """`[steps, m_0, rows..., m_1, rows..., ...]` back into each step's micro-batch row counts."""
    out, i = [], 1
    for _ in range(head[0]):
        m = head[i]
        out.append(list(head[i + 1 : i + 1 + m]))
        i += 1 + m
    return out


def _rows(batch: PackedBatch) -> int:
    return int(batch.input_ids.shape[0])


def _all_gather_ints(values: Sequence[int], group: Any, device: torch.device) -> list[list[int]]:
    """Every rank's list of ints (lists of any lengths), in group-rank order."""
    n = torch.tensor([len(values)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, n, group=group)
    longest = max(int(x) for x in lengths)
    mine = torch.zeros(longest, dtype=torch.int64, device=device)
    mine[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in lengths]
    dist.all_gather(out, mine, group=group)
    return [t[: int(k)].tolist() for t, k in zip(out, lengths)]


def _exchange(
    sends: list[tuple[int, int]],
    recvs: list[tuple[int, int]],
    payload: dict[int, bytes],
    sizes: list[list[int]],
    group: Any,
    device: torch.device,
) -> dict[RowRef, bytes]:
    """Point-to-point: this rank's row `k` to group rank `d` for each (d, k) of `sends`; row `k`
    of group rank `r` from it for each (r, k) of `recvs` (`sizes[r][k]` bytes). Both sides list
    a pair's rows in the same order, which is how NCCL matches them (gloo by the tag as well)."""
    ops, inbox = [], {}
    for d, k in sends:
        data = torch.frombuffer(bytearray(payload[k]), dtype=torch.uint8).to(device)
        ops.append(dist.P2POp(dist.isend, data, dist.get_global_rank(group, d), group, tag=k))
    for r, k in recvs:
        inbox[(r, k)] = torch.empty(sizes[r][k], dtype=torch.uint8, device=device)
        ops.append(dist.P2POp(dist.irecv, inbox[(r, k)], dist.get_global_rank(group, r), group, tag=k))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {ref: t.cpu().numpy().tobytes() for ref, t in inbox.items()}
