"""The tokenize job's defaults, in a module of their own: `mmdata tokenize-images --help` shows
them without importing the job (torch, transformers, ray)."""

from __future__ import annotations

DEFAULT_IMAGE_AREA = 512 * 512  # Emu3-Chat's image_area
DEFAULT_CHUNK_SAMPLES = 64
