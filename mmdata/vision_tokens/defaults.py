"""The tokenize job's defaults, in a module of their own: `mmdata tokenize-images --help` shows
them without importing the job (torch, transformers, ray)."""

from __future__ import annotations

DEFAULT_IMAGE_AREA = 512 * 512  # Emu3-Chat's image_area
# The driver's cost is per chunk (an actor call, its result, about 1.5 ms of CPU): 64-sample
# chunks cost it 24 us per record, a sixth of the tiny VQ's cluster bound (issue 47,
# benchmarks/bench_preprocess_scale.py --job tokenize-images); 256 cost a quarter of that.
DEFAULT_CHUNK_SAMPLES = 256
