"""Emu3's vision tokenizer: transformers' `Emu3ImageProcessor` (resize to the area target in
multiples of the spatial factor, rescale, normalise) and `Emu3VQVAE`'s encoder + quantizer.

`VQ_DIR` is either a VQ-only directory (`Emu3VQVAE.save_pretrained`: config.json with
model_type `emu3_vqgan`, safetensors weights, preprocessor_config.json; what `mmdata tiny-vq`
writes) or a whole transformers Emu3 checkpoint (model_type `emu3`, e.g. Emu3-Chat-hf), from
which only the `vqmodel.` tensors are read. Weights load from safetensors only (no pickles).

`encode_pixels` computes exactly what `Emu3VQVAE.encode` computes for an image, but runs the
2-D encoder once per image: `encode` tiles an image `temporal_downsample_factor` times along
time and runs the whole 2-D encoder on every copy before the temporal layers, i.e. 4x the
work for identical frames. The copies are made after the 2-D part instead; the token ids are
identical (tests/test_tokenize_images.py compares them with `encode`).

This module imports torch and transformers: the tokenize job and its workers use them, and
`mmdata tokenize-images --help` does not import the job (its `run` does).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from transformers import Emu3ImageProcessor, Emu3VQVAE, Emu3VQVAEConfig

# The architecture fields of Emu3VQVAEConfig: what the fingerprint and the rebuilt model use.
VQ_CONFIG_KEYS = (
    "codebook_size",
    "embed_dim",
    "latent_channels",
    "double_latent",
    "in_channels",
    "out_channels",
    "temporal_downsample_factor",
    "base_channels",
    "channel_multiplier",
    "num_res_blocks",
    "attn_resolutions",
    "hidden_size",
    "num_attention_heads",
    "attention_dropout",
)
# Where a whole Emu3 checkpoint keeps its VQ tensors (transformers 5 / 4.x layouts).
FULL_MODEL_VQ_PREFIXES = ("model.vqmodel.", "vqmodel.")
PROCESSOR_FILE = "preprocessor_config.json"


class VQError(ValueError):
    """A VQ directory that cannot be used (told to the user, exit 2)."""


@dataclass
class VQCheckpoint:
    """A VQ model's configuration and weights as read from disk (CPU tensors)."""

    path: Path
    layout: str  # "emu3_vqgan" (VQ-only dir) or "emu3" (whole Emu3 checkpoint)
    config: dict[str, Any]  # VQ_CONFIG_KEYS only
    state_dict: dict  # name -> torch.Tensor, Emu3VQVAE's own names

    def fingerprint(self) -> str:
        """sha256 of the architecture config and every tensor (name, dtype, shape, bytes):
        the same weights give the same fingerprint whichever layout they were read from."""
        h = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        for name in sorted(self.state_dict):
            t = self.state_dict[name].detach().contiguous().cpu()
            h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (
            f" (found {', '.join(pickled)}: pickled weights are not loaded; convert them to safetensors)"
            if pickled
            else ""
        )
        raise VQError(f"{path}: no *.safetensors weights{hint}")
    return files


def check_vq_dir(path: str | Path) -> tuple[str, dict]:
    """(layout, raw VQ config) of a VQ dir, from its small files only: a quick check of the
    user's --vision-tokenizer before anything slow starts."""
    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise VQError(f"{p}: not a model directory (no config.json)")
    if not (p / PROCESSOR_FILE).is_file():
        raise VQError(f"{p}: no {PROCESSOR_FILE} (the Emu3ImageProcessor settings: mean/std, spatial factor)")
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise VQError(f"{cfg_path}: not JSON ({e})") from None
    layout = raw.get("model_type")
    if layout == "emu3_vqgan":
        return layout, raw
    if layout == "emu3":
        return layout, raw.get("vq_config") or {}
    raise VQError(
        f"{p}: config.json model_type is {layout!r}; expected an Emu3 VQ model ('emu3_vqgan') "
        "or an Emu3 checkpoint ('emu3')"
    )


def read_vq_checkpoint(path: str | Path) -> VQCheckpoint:
    """Read the VQ config and tensors of a VQ-only dir or a whole Emu3 checkpoint."""
    p = Path(path)
    layout, vq_raw = check_vq_dir(p)
    prefixes = ("",) if layout == "emu3_vqgan" else FULL_MODEL_VQ_PREFIXES

    defaults = Emu3VQVAEConfig()
    config = {k: vq_raw.get(k, getattr(defaults, k)) for k in VQ_CONFIG_KEYS}
    config = {k: list(x) if isinstance(x, tuple) else x for k, x in config.items()}
    state: dict = {}
    for f in _safetensors_files(p):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                prefix = next((pre for pre in prefixes if key.startswith(pre)), None)
                if prefix is not None:
                    state[key[len(prefix) :]] = st.get_tensor(key)
    if not state:
        raise VQError(
            f"{p}: no VQ tensors found (looked for {' or '.join(repr(x) for x in prefixes if x) or 'any'} keys)"
        )
    return VQCheckpoint(p, layout, config, state)


def load_image_processor(path: str | Path, image_area: int | None):
    """The VQ dir's Emu3ImageProcessor; `image_area` (pixels) sets its min and max pixels, so
    every image is resized to about that area (Emu3's area target) in multiples of the
    spatial factor. None keeps the directory's own bounds."""
    f = Path(path) / PROCESSOR_FILE
    if not f.is_file():
        raise VQError(f"{path}: no {PROCESSOR_FILE} (the Emu3ImageProcessor settings: mean/std, spatial factor)")
    cfg = json.loads(f.read_text())
    if cfg.get("image_processor_type", "Emu3ImageProcessor") != "Emu3ImageProcessor":
        raise VQError(f"{f}: image_processor_type is {cfg['image_processor_type']!r}, expected Emu3ImageProcessor")
    if image_area is not None:
        if image_area <= 0:
            raise VQError(f"--image-area must be positive, got {image_area}")
        cfg.update(
            min_pixels=image_area, max_pixels=image_area, size={"min_pixels": image_area, "max_pixels": image_area}
        )
    return Emu3ImageProcessor.from_dict(cfg)


def processor_settings(processor) -> dict[str, Any]:
    """What decides the pixels fed to the VQ (for the manifest and the fingerprint)."""
    keys = (
        "do_convert_rgb",
        "do_resize",
        "resample",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
        "min_pixels",
        "max_pixels",
        "spatial_factor",
    )
    return {
        k: (list(v) if isinstance(v, tuple) else int(v) if k == "resample" else v)
        for k in keys
        for v in [getattr(processor, k)]
    }


def build_vq_model(ckpt: VQCheckpoint, device: str = "cpu"):
    """An Emu3VQVAE in eval mode with `ckpt`'s weights (float32), on `device`."""
    with torch.device("meta"):
        model = Emu3VQVAE(Emu3VQVAEConfig(**ckpt.config))
    missing = sorted(set(model.state_dict()) - set(ckpt.state_dict))
    unexpected = sorted(set(ckpt.state_dict) - set(model.state_dict()))
    if missing or unexpected:
        raise VQError(
            f"{ckpt.path}: VQ weights do not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.load_state_dict({k: t.to(torch.float32) for k, t in ckpt.state_dict.items()}, assign=True, strict=True)
    return model.to(device).eval()


def spatial_factor(config: dict[str, Any]) -> int:
    return 2 ** (len(config["channel_multiplier"]) - 1)


def encode_pixels(model, pixel_values):
    """VQ codes (B, H/f, W/f) of a batch of same-size images (B, 3, H, W): `Emu3VQVAE.encode`'s
    result for each image, with the 2-D encoder run once per image (see the module docstring)."""
    enc = model.encoder
    with torch.no_grad():
        x = enc.conv_in(pixel_values.to(model.dtype))
        x = enc.middle_block(enc.down_block(x))
        x = enc.norm_out(x)
        x = enc.conv_out(x * torch.sigmoid(x))
        # (B, C, h, w) -> (B, C, T, h, w): the T identical frames `encode` would have encoded
        x = x.unsqueeze(2).expand(-1, -1, model.config.temporal_downsample_factor, -1, -1)
        for conv in enc.time_conv:
            x = conv(x)
            x = x * torch.sigmoid(x)
        for layer in enc.time_res_stack:
            x = layer(x)
        x = model.quant_conv(x).permute(0, 2, 1, 3, 4)  # (B, T', C, h, w), T' = 1
        return model.quantize(x).squeeze(1)


def set_deterministic_torch(device: str, threads: int) -> None:
    """Same numbers on every run: fixed thread count, no TF32, deterministic cuDNN kernels."""
    torch.set_num_threads(max(1, threads))
    if device.startswith("cuda"):
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False


class VisionTokenizer:
    """Image -> VQ code grid, the way transformers' Emu3 processor + VQ model do it."""

    def __init__(self, vq_dir: str | Path, image_area: int | None, device: str = "cpu"):
        ckpt = read_vq_checkpoint(vq_dir)
        self.processor = load_image_processor(vq_dir, image_area)
        factor = spatial_factor(ckpt.config)
        if self.processor.spatial_factor != factor:
            raise VQError(f"{vq_dir}: processor spatial_factor {self.processor.spatial_factor} != the VQ's {factor}")
        self.fingerprint = ckpt.fingerprint()
        self.config = ckpt.config
        self.device = device
        self.model = build_vq_model(ckpt, device)
        self.factor = factor

    def preprocess(self, image) -> np.ndarray:
        """(3, H, W) float32 pixels of a PIL image: Emu3ImageProcessor's own output. Raises
        ValueError for images it refuses (e.g. aspect ratio over 200)."""
        out = self.processor.preprocess([image], return_tensors="np")
        return out["pixel_values"][0]

    def encode(self, pixels: list[np.ndarray]) -> list[np.ndarray]:
        """Code grids (H/f, W/f) of same-size preprocessed images, encoded as one batch."""
        batch = torch.from_numpy(np.stack(pixels)).to(self.device)
        codes = encode_pixels(self.model, batch).cpu().numpy()
        return list(codes)
