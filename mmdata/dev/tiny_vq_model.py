"""Build the tiny random Emu3 VQ model that `mmdata tiny-vq` writes (tiny_vq.py: the subcommand,
the architecture and the image processor settings)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import Emu3ImageProcessor, Emu3VQVAE, Emu3VQVAEConfig

from mmdata.dev.tiny_vq import DEFAULT_CODEBOOK_SIZE, EMU3_PROCESSOR, TINY_VQ_CONFIG


def build_tiny_vq(out_dir: str | Path, seed: int = 0, codebook_size: int = DEFAULT_CODEBOOK_SIZE) -> Path:
    """Save a random tiny Emu3VQVAE and its image processor config to `out_dir`."""
    if codebook_size < 1:
        raise ValueError(f"codebook size must be positive, got {codebook_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Emu3VQVAE(Emu3VQVAEConfig(codebook_size=codebook_size, **TINY_VQ_CONFIG)).eval()
    model.save_pretrained(out, safe_serialization=True)
    Emu3ImageProcessor(**EMU3_PROCESSOR).save_pretrained(out)
    _honour_umask(out)
    return out


def _honour_umask(out: Path) -> None:
    """safetensors writes its files 0600; give them the mode `open()` would (0o666 & ~umask)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in out.glob("*.safetensors"):
        os.chmod(f, 0o666 & ~mask)
