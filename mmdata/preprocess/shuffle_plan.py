"""The seeded global shuffle, as pure arithmetic: every record gets a 64-bit key
blake2b(seed, record identity); the output order is ascending (key, identity). Buckets are
contiguous key ranges, so sorting each bucket and concatenating them gives the same order
whatever the number of buckets, workers, task order or retries. Shards are cut by global rank
from the bucket sizes alone, so the driver never needs the rows themselves."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache

KEY_BITS = 64


def shuffle_key(seed: int, rid: str) -> int:
    h = _keyed_hash(seed).copy()  # (copying the keyed state costs half of keying a new one)
    h.update(rid.encode("utf-8"))
    return int.from_bytes(h.digest(), "big")


@lru_cache(maxsize=8)
def _keyed_hash(seed: int):
    return hashlib.blake2b(digest_size=8, key=str(seed).encode("ascii")[:64] or b"0")


def bucket_of(key: int, num_buckets: int) -> int:
    """Range partition: bucket b holds keys in [b * 2^64 / B, (b+1) * 2^64 / B)."""
    return (key * num_buckets) >> KEY_BITS


def default_num_buckets(
    total_input_bytes: int, target_bytes_per_bucket: int = 1 << 30, floor: int = 8, cap: int = 4096
) -> int:
    """Derived from input size only (never from the worker count, so a resumed job on another
    cluster keeps its work): about 1 GiB of input per bucket, and at least `floor` buckets so
    that sorting small inputs is still spread over several cores."""
    return max(floor, min(cap, math.ceil(total_input_bytes / target_bytes_per_bucket)))


@dataclass(frozen=True)
class Slice:
    bucket: int
    start: int  # row index inside the sorted bucket
    stop: int


@dataclass(frozen=True)
class ShardPlan:
    index: int
    first_rank: int  # global output index of the shard's first sample
    slices: tuple[Slice, ...]

    @property
    def num_samples(self) -> int:
        return sum(s.stop - s.start for s in self.slices)


def plan_shards(bucket_counts: list[int], samples_per_shard: int) -> list[ShardPlan]:
    """Cut the concatenation of sorted buckets into shards of `samples_per_shard` samples."""
    if samples_per_shard <= 0:
        raise ValueError("samples_per_shard must be positive")
    bucket_starts = [0]
    for c in bucket_counts:
        bucket_starts.append(bucket_starts[-1] + c)
    total = bucket_starts[-1]
    plans = []
    b = 0
    for s, first in enumerate(range(0, total, samples_per_shard)):
        last = min(total, first + samples_per_shard)
        slices = []
        while b < len(bucket_counts) and bucket_starts[b + 1] <= first:
            b += 1
        bb = b
        while bb < len(bucket_counts) and bucket_starts[bb] < last:
            lo, hi = max(first, bucket_starts[bb]), min(last, bucket_starts[bb + 1])
            if hi > lo:
                slices.append(Slice(bb, lo - bucket_starts[bb], hi - bucket_starts[bb]))
            bb += 1
        plans.append(ShardPlan(s, first, tuple(slices)))
    return plans
