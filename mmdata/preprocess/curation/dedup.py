"""`--dedup phash[:D]`: near-duplicate removal over the whole input, inside the Ray job.

Two records are near-duplicates when they have the same number of images, each image's 64-bit
perceptual hash is within Hamming distance D of the other's at the same position, and (scope
`record`, the default) their normalised conversation text is equal; scope `image` ignores the
text. A record is dropped when a near-duplicate with a higher priority exists; the priority is
content-determined, so the survivor never depends on worker count or input order: more image
pixels first (keep the best copy), then a hash of (id, source), then of the input location. In
every group of mutually near records exactly one survives; for D = 0 the relation is an
equivalence and each group keeps exactly its best record. Records without images (text-only,
video) are not deduplicated. Multi-image records are matched on their first four images within
D; further images must have equal hashes.

Never O(N^2): candidates come from LSH banding. The 64 bits are cut into D + r blocks; two
hashes within distance D differ in at most D blocks, so they agree on at least r whole blocks,
i.e. on at least one of the C(D + r, r) bands of r blocks (r = 1 for D <= 1, 2 for D <= 5, 3 up
to D = 8: 1, 2, 6, 10, 15, 21, 84, 120, 165 bands for D = 0..8). The scan emits one fixed-size
entry per record and band, partitioned by a hash of (band, text key); one task per partition
groups equal keys and verifies only within a group. Its marks (dropped record, best neighbour)
go to the dropped record's sort bucket; one task per bucket keeps each dropped record's best
neighbour. The driver sees only counts, so its memory does not grow with N.
"""

from __future__ import annotations

import hashlib
import json
from itertools import combinations
from pathlib import Path

import numpy as np

from mmdata.preprocess.rows import load_grouped, save_grouped, work_path, write_bytes_atomic
from mmdata.preprocess.shuffle_plan import bucket_of

MAX_DISTANCE = 8
MATCHED_IMAGES = 4  # images compared within D; the hashes of any further ones must be equal
SCOPES = ("record", "image")

ENTRY = np.dtype(
    [
        ("band", "<u8"),
        ("text", "<u8"),
        ("table", "<u2"),
        ("nimg", "<u2"),  # the group key
        ("h", "<u8", (MATCHED_IMAGES,)),
        ("rest", "<u8"),  # the hashes compared
        ("neg_pixels", "<i8"),
        ("idkey", "<u8"),
        ("ridkey", "<u8"),  # priority (smaller wins)
        ("unit", "<u4"),
        ("ord", "<u4"),  # the record's handle (input file, candidate ordinal)
        ("key", "<u8"),
        ("group", "<u8"),  # shuffle key (-> sort bucket), mix group key
    ]
)
MARK = np.dtype(
    [
        ("unit", "<u4"),
        ("ord", "<u4"),
        ("group", "<u8"),  # the dropped record
        ("n_neg_pixels", "<i8"),
        ("n_idkey", "<u8"),
        ("n_ridkey", "<u8"),
        ("n_unit", "<u4"),
        ("n_ord", "<u4"),
        ("distance", "<u2"),
    ]
)
DROP = np.dtype([("unit", "<u4"), ("ord", "<u4"), ("n_unit", "<u4"), ("n_ord", "<u4"), ("distance", "<u2")])
_M64 = (1 << 64) - 1


def parse_dedup(spec: str) -> int:
    """`phash` or `phash:D` -> D."""
    method, _, d = spec.partition(":")
    if method != "phash":
        raise ValueError(f"--dedup {spec!r}: the method is `phash` (phash or phash:D)")
    try:
        distance = int(d) if d else 0
    except ValueError:
        raise ValueError(f"--dedup {spec!r}: D must be an integer Hamming distance") from None
    if not 0 <= distance <= MAX_DISTANCE:
        raise ValueError(f"--dedup {spec!r}: D must be within 0..{MAX_DISTANCE}")
    return distance


def band_masks(distance: int) -> list[int]:
    """The bands: masks of r of the D + r blocks (see the module docstring)."""
    if distance == 0:
        return [_M64]
    r = 1 if distance <= 1 else 2 if distance <= 5 else 3
    blocks = distance + r
    cuts = [round(64 * i / blocks) for i in range(blocks + 1)]
    block = [((1 << (hi - lo)) - 1) << lo for lo, hi in zip(cuts, cuts[1:])]
    return [sum(block[i] for i in combo) for combo in combinations(range(blocks), r)]


def key64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "big")


class EntryBuilder:
    """Collects one input file's entries (a row per record and band) in plain lists."""

    def __init__(self, distance: int, scope: str):
        self.masks = band_masks(distance)
        self.scope = scope
        self.rows: list[tuple] = []

    def add(
        self,
        hashes: list[int],
        text_key: int,
        pixels: int,
        idkey: int,
        ridkey: int,
        unit: int,
        ordinal: int,
        key: int,
        group: int,
    ) -> None:
        h = (hashes + [0] * MATCHED_IMAGES)[:MATCHED_IMAGES]
        rest = key64(",".join(map(str, hashes[MATCHED_IMAGES:]))) if len(hashes) > MATCHED_IMAGES else 0
        text = text_key if self.scope == "record" else 0
        for t, mask in enumerate(self.masks):
            self.rows.append(
                (hashes[0] & mask, text, t, len(hashes), h, rest, -pixels, idkey, ridkey, unit, ordinal, key, group)
            )

    def save(self, work: str | Path, unit: int, num_partitions: int) -> int:
        entries = np.array(self.rows, dtype=ENTRY)
        part = _partition(entries, num_partitions)
        save_grouped(work_path(work, "dedup", f"u{unit:07d}.entries"), entries, part, num_partitions)
        return len(entries)


def _partition(entries: np.ndarray, num_partitions: int) -> np.ndarray:
    """Partition of each entry's group key: a fixed mix of (band, text, table), mod P."""
    with np.errstate(over="ignore"):
        x = (
            entries["band"]
            ^ (entries["text"] * np.uint64(0x9E3779B97F4A7C15))
            ^ (entries["table"].astype("<u8") << np.uint64(48))
        )
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
    return (x % np.uint64(num_partitions)).astype(np.int64)


def _near(h: np.ndarray, rest: np.ndarray, nimg: int, distance: int) -> tuple[np.ndarray, np.ndarray]:
    """(near[i, j], distance[i, j]) between the distinct hash signatures of one group."""
    n = min(nimg, MATCHED_IMAGES)
    dist = np.zeros((len(h), len(h)), dtype=np.int64)
    for k in range(n):
        dist = np.maximum(dist, np.bitwise_count(h[:, k][:, None] ^ h[:, k][None, :]))
    return (dist <= distance) & (rest[:, None] == rest[None, :]), dist


def _group_marks(g: np.ndarray, distance: int) -> tuple[np.ndarray, np.ndarray]:
    """(marks, their shuffle keys) of one candidate group: every member with a better near
    neighbour, and the best of those neighbours."""
    n = len(g)
    rank = np.empty(n, dtype=np.int64)  # priority rank inside the group (0 = best)
    rank[np.lexsort((g["ord"], g["unit"], g["ridkey"], g["idkey"], g["neg_pixels"]))] = np.arange(n)
    member_of_rank = np.argsort(rank)
    # Members with equal hashes share a signature; compare distinct signatures only.
    sigs, inverse = np.unique(np.concatenate([g["h"], g["rest"][:, None]], axis=1), axis=0, return_inverse=True)
    inverse = inverse.ravel()
    best = np.full(len(sigs), n, dtype=np.int64)
    np.minimum.at(best, inverse, rank)  # best member rank per signature
    near, dist = _near(sigs[:, :MATCHED_IMAGES], sigs[:, MATCHED_IMAGES], int(g["nimg"][0]), distance)
    np.fill_diagonal(near, False)
    candidates = np.where(near, best[None, :], n)
    other_sig = candidates.argmin(axis=1)  # the near signature holding the best member
    other_best = candidates.min(axis=1)
    own = np.where(best[inverse] != rank, best[inverse], n)  # a better member with the same hashes
    nb = np.minimum(own, other_best[inverse])
    dropped = np.flatnonzero(nb < rank)
    j = member_of_rank[nb[dropped]]
    s = inverse[dropped]
    marks = np.zeros(len(dropped), MARK)
    for f in ("unit", "ord", "group"):
        marks[f] = g[f][dropped]
    for f in ("neg_pixels", "idkey", "ridkey", "unit", "ord"):
        marks[f"n_{f}"] = g[f][j]
    marks["distance"] = np.where(nb[dropped] == own[dropped], 0, dist[s, other_sig[s]])
    return marks, g["key"][dropped]


def partition_marker(work: str | Path, partition: int) -> Path:
    return work_path(work, "dedup", f"p{partition:05d}.done.json")


def resolve_marker(work: str | Path, bucket: int) -> Path:
    return work_path(work, "dedup", f"b{bucket:05d}.done.json")


def dedup_partition(partition: int, num_units: int, num_buckets: int, distance: int, work: str) -> dict:
    """Find the dropped records of one partition; write their marks grouped by sort bucket."""
    parts = [load_grouped(work_path(work, "dedup", f"u{u:07d}.entries"), ENTRY, partition) for u in range(num_units)]
    e = np.concatenate(parts) if parts else np.zeros(0, ENTRY)
    marks, keys = [np.zeros(0, MARK)], [np.zeros(0, "<u8")]
    if len(e) > 1:
        e = e[np.lexsort((e["text"], e["band"], e["nimg"], e["table"]))]
        cols = np.stack([e["table"].astype("<u8"), e["nimg"].astype("<u8"), e["band"], e["text"]], axis=1)
        starts = np.flatnonzero(np.r_[True, (cols[1:] != cols[:-1]).any(axis=1)])
        ends = np.r_[starts[1:], len(e)]
        for lo, hi in zip(starts[ends - starts > 1], ends[ends - starts > 1]):
            m, k = _group_marks(e[lo:hi], distance)
            marks.append(m)
            keys.append(k)
    m, k = np.concatenate(marks), np.concatenate(keys)
    buckets = np.array([bucket_of(int(x), num_buckets) for x in k], dtype=np.int64)
    save_grouped(work_path(work, "dedup", f"p{partition:05d}.marks"), m, buckets, num_buckets)
    result = {"entries": len(e), "marks": len(m)}
    write_bytes_atomic(partition_marker(work, partition), json.dumps(result).encode())
    return result


def resolve_bucket(bucket: int, num_partitions: int, work: str) -> dict:
    """Each dropped record of one sort bucket with its best neighbour over all bands; returns
    the number of dropped records per mix group key (hex), for the driver's mix plan."""
    parts = [load_grouped(work_path(work, "dedup", f"p{p:05d}.marks"), MARK, bucket) for p in range(num_partitions)]
    m = np.concatenate(parts) if parts else np.zeros(0, MARK)
    if len(m):
        m = m[
            np.lexsort((m["n_ord"], m["n_unit"], m["n_ridkey"], m["n_idkey"], m["n_neg_pixels"], m["ord"], m["unit"]))
        ]
        first = np.r_[True, (m["unit"][1:] != m["unit"][:-1]) | (m["ord"][1:] != m["ord"][:-1])]
        m = m[first]
    drops = np.zeros(len(m), DROP)
    for f in DROP.names:
        drops[f] = m[f]
    write_bytes_atomic(work_path(work, "dedup", f"b{bucket:05d}.drops"), drops.tobytes())
    groups, counts = np.unique(m["group"], return_counts=True)
    result = {"dropped": len(drops), "by_group": {f"{int(g):016x}": int(n) for g, n in zip(groups, counts)}}
    write_bytes_atomic(resolve_marker(work, bucket), json.dumps(result).encode())
    return result


def load_drops(work: str, bucket: int) -> dict[tuple[int, int], tuple[int, int, int]]:
    """{(unit, ordinal): (neighbour unit, neighbour ordinal, distance)} of one sort bucket."""
    d = np.fromfile(work_path(work, "dedup", f"b{bucket:05d}.drops"), dtype=DROP)
    return {(int(r["unit"]), int(r["ord"])): (int(r["n_unit"]), int(r["n_ord"]), int(r["distance"])) for r in d}
