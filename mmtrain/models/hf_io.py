"""Streaming safetensors access for HF checkpoint directories (read one tensor at a time,
write size-bounded shards with an index) -- never pickle, never the whole model in memory."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

#: `--dtype` / config `dtype` spellings of the floating dtypes a checkpoint is written in
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: safetensors header dtype -> our spelling
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

#: non-weight files worth carrying along (tokenizer, processor, chat template, generation)
ASSET_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "processor_config.json", "video_preprocessor_config.json", "generation_config.json",
)  # fmt: skip


def file_mode() -> int:
    """0o666 & ~umask: the mode `open()` would give a new file (safetensors writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def honour_umask(path: str | os.PathLike) -> None:
    """Give a file written by a library that ignores the umask the mode `open()` would have."""
    os.chmod(path, file_mode())


#: torch.save'd (pickle) weight files, read with weights_only=True as transformers does
BIN_INDEX = "pytorch_model.bin.index.json"


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A `pytorch_model*.bin` state dict, memory-mapped (zip format) so reading it costs no RAM
    until a tensor is used; weights_only=True never runs pickled code."""
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (pre-1.6, non-zip) serialization cannot be mmapped
        return torch.load(str(path), map_location="cpu", weights_only=True)


def _safetensors_map(d: Path) -> dict[str, str] | None:
    """tensor -> file of the safetensors weights in `d`, None when there are none."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        return None
    weight_map: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            weight_map.update({k: f.name for k in h.keys()})
    return weight_map


def _bin_map(d: Path) -> dict[str, str] | None:
    """tensor -> file of the `pytorch_model*.bin` weights in `d`, None when there are none."""
    index = d / BIN_INDEX
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(d.glob("pytorch_model*.bin"))
    weight_map: dict[str, str] = {}
    for f in files:
        weight_map.update({k: f.name for k in _load_bin(f)})
    return weight_map or None


class SafetensorsReader:
    """Lazy reader over `model.safetensors` or `model.safetensors.index.json` shards, or, in a
    folder without safetensors, `pytorch_model.bin` / `pytorch_model.bin.index.json` shards
    (memory-mapped, weights_only); keys are exposed through `normalize` (e.g. the HF on-disk
    name variants -> canonical names)."""

    def __init__(self, hf_dir: str | os.PathLike, normalize: Callable[[str], str] = lambda k: k) -> None:
        self.dir = Path(hf_dir)
        weight_map = _safetensors_map(self.dir)
        self.pickled = weight_map is None
        if weight_map is None:
            weight_map = _bin_map(self.dir)
        if weight_map is None:
            raise FileNotFoundError(f"{self.dir}: no weights (*.safetensors or pytorch_model*.bin)")
        self._where: dict[str, tuple[str, str]] = {}
        for key, fname in weight_map.items():
            norm = normalize(key)
            if norm in self._where:
                raise ValueError(f"{self.dir}: tensors {self._where[norm][1]!r} and {key!r} both map to {norm!r}")
            self._where[norm] = (fname, key)

    def keys(self) -> set[str]:
        return set(self._where)

    def _locate(self, key: str) -> tuple[str, str]:
        if key not in self._where:
            raise KeyError(f"{self.dir}: tensor {key!r} not found")
        return self._where[key]

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, read from the file header (no data)."""
        fname, orig = self._locate(key)
        if self.pickled:
            return tuple(_load_bin(self.dir / fname)[orig].shape)
        with safe_open(str(self.dir / fname), "pt") as h:
            return tuple(h.get_slice(orig).get_shape())

    def dtype(self) -> str | None:
        """The floating dtype holding most of the weights (from the headers, no data), e.g.
        "bfloat16" for the published LLaVA checkpoints; None without floating tensors."""
        elements: dict[str, int] = {}
        by_file: dict[str, list[str]] = {}
        for fname, orig in self._where.values():
            by_file.setdefault(fname, []).append(orig)
        names = {v: k for k, v in DTYPE_NAMES.items()}
        for fname, keys in by_file.items():
            for name, numel in self._dtypes(fname, keys, names):
                if name is not None:
                    elements[name] = elements.get(name, 0) + numel
        return max(elements, key=elements.__getitem__) if elements else None

    def _dtypes(self, fname: str, keys: list[str], names: dict) -> list[tuple[str | None, int]]:
        """(dtype name or None, elements) of `keys` in one file."""
        if self.pickled:
            sd = _load_bin(self.dir / fname)
            return [(names.get(sd[k].dtype), sd[k].numel()) for k in keys]
        with safe_open(str(self.dir / fname), "pt") as h:
            return [
                (_ST_DTYPES.get(h.get_slice(k).get_dtype()), int(torch.Size(h.get_slice(k).get_shape()).numel()))
                for k in keys
            ]

    def get(self, key: str) -> torch.Tensor:
        fname, orig = self._locate(key)
        if self.pickled:  # cloned out of the mapping, so no page of the file stays resident
            return _load_bin(self.dir / fname)[orig].clone()
        # open per tensor: a long-lived handle keeps every page it ever touched mapped (resident),
        # which would make a streaming conversion hold the whole source checkpoint in RSS
        with safe_open(str(self.dir / fname), "pt") as h:
            return h.get_tensor(orig)


def read_config(hf_dir: str | os.PathLike) -> dict:
    f = Path(hf_dir) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing")
    return json.loads(f.read_text())


def source_dtype(hf_dir: str | os.PathLike, config: dict | None = None) -> str:
    """The dtype an HF checkpoint is stored in: its tensors' (what the files hold), else its
    config's `dtype` / `torch_dtype`, else float32."""
    found = SafetensorsReader(hf_dir).dtype()
    if found is not None:
        return found
    config = read_config(hf_dir) if config is None else config
    named = config.get("dtype") or config.get("torch_dtype")
    return named if named in DTYPE_NAMES else "float32"


def with_config_dtype(config: dict, dtype: str, key: str = "dtype") -> dict:
    """`config` saying `dtype` wherever it names one (top level and sub-configs, either
    spelling), and at the top level under `key` when it names none (transformers >= 4.56 reads
    `dtype`; the LLaVA-NeXT code's transformers `torch_dtype`)."""
    out = dict(config)
    if not any(k in out for k in ("dtype", "torch_dtype")):
        out[key] = dtype
    for k, v in out.items():
        if k in ("dtype", "torch_dtype"):
            out[k] = dtype
        elif isinstance(v, dict) and any(s in v for s in ("dtype", "torch_dtype")):
            out[k] = with_config_dtype(v, dtype)
    return out


def cast_floating(tensors: Iterable[tuple[str, torch.Tensor]], dtype: str | None) -> Iterable[tuple[str, torch.Tensor]]:
    """The stream with its floating tensors in `dtype` (None: as they are); integer buffers keep theirs."""
    target = DTYPE_NAMES[dtype] if dtype is not None else None
    for name, t in tensors:
        yield name, t.to(target) if target is not None and t.is_floating_point() else t


def write_sharded(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3
) -> list[str]:
    """Write `model-0000k-of-0000n.safetensors` + index, holding at most one shard in memory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = []
    names: list[str] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    weight_map: dict[str, int] = {}
    total = 0
    tmp_files = []

    def flush() -> None:
        nonlocal current, size
        if not current:
            return
        path = out / f"_shard_{len(tmp_files):05d}.safetensors"
        save_file(current, str(path), metadata={"format": "pt"})
        honour_umask(path)
        tmp_files.append(path)
        log.info(
            "wrote shard %d (%.2f GiB, %d tensors so far, %.2f GiB in all)",
            len(tmp_files),
            size / 1024**3,
            len(names),
            total / 1024**3,
        )  # (progress: a large export takes minutes)
        current, size = {}, 0

    for name, t in tensors:
        if name in weight_map:
            raise ValueError(f"duplicate output tensor {name!r}")
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = t.detach().contiguous().clone()
        size += nbytes
        total += nbytes
        weight_map[name] = len(tmp_files)
        names.append(name)
    flush()
    n = len(tmp_files)
    final = []
    for i, p in enumerate(tmp_files):
        target = out / (f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors")
        p.replace(target)
        final.append(target.name)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    del shards
    return names


def copy_assets(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    copied = []
    for name in ASSET_FILES:
        f = Path(src) / name
        if f.is_file():
            Path(dst).mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, Path(dst) / name)
            copied.append(name)
    return copied
