"""The benchmark mix as lengths: what the vision-balance tests, the global order's tests and
benchmarks/bench_global_order.py plan from without reading a shard."""

from __future__ import annotations

import numpy as np

#: the synthetic Infinity-MM mix as its length index has it: (share, tiles, tokens mean, std)
LLAVA_OV_KINDS = (
    (0.16, 0, 83, 22),
    (0.38, 2, 1513, 93),
    (0.15, 3, 2082, 221),
    (0.23, 5, 2875, 279),
    (0.07, 7, 3521, 1392),
    (0.01, 25, 7415, 41),
)


def llava_ov_mix(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample (tokens, tiles) as the synthetic Infinity-MM mix has them: text-only samples are
    short, an image's tokens per tile fall from ~750 at 2 tiles to ~300 at 25 (the anyres_max_9
    shrink), so rows of equal tokens differ in tiles."""
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(LLAVA_OV_KINDS), size=n, p=[k[0] for k in LLAVA_OV_KINDS])
    tiles = np.array([LLAVA_OV_KINDS[i][1] for i in pick])
    tokens = np.array([rng.normal(LLAVA_OV_KINDS[i][2], LLAVA_OV_KINDS[i][3]) for i in pick])
    return tokens.clip(20, 8000).astype(np.int64), tiles
