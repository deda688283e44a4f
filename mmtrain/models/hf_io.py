"""Streaming safetensors access for HF checkpoint directories (read one tensor at a time,
write size-bounded shards with an index) -- never pickle, never the whole model in memory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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


class SafetensorsReader:
    """Lazy reader over `model.safetensors` or `model.safetensors.index.json` shards; keys are
    exposed through `normalize` (e.g. the HF on-disk name variants -> canonical names)."""

    def __init__(self, hf_dir: str | os.PathLike, normalize: Callable[[str], str] = lambda k: k) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.dir}: no *.safetensors (pickle .bin checkpoints are not read)")
            weight_map = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self._where: dict[str, tuple[str, str]] = {}
        for key, fname in weight_map.items():
            norm = normalize(key)
            if norm in self._where:
                raise ValueError(f"{self.dir}: tensors {self._where[norm][1]!r} and {key!r} both map to {norm!r}")
            self._where[norm] = (fname, key)

    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, read from the file header (no data)."""
        if key not in self._where:
            raise KeyError(f"{self.dir}: tensor {key!r} not found")
        fname, orig = self._where[key]
        with safe_open(str(self.dir / fname), "pt") as h:
            return tuple(h.get_slice(orig).get_shape())

    def dtype(self) -> str | None:
        """The floating dtype holding most of the weights (from the headers, no data), e.g.
        "bfloat16" for the published LLaVA checkpoints; None without floating tensors."""
        elements: dict[str, int] = {}
        by_file: dict[str, list[str]] = {}
        for fname, orig in self._where.values():
            by_file.setdefault(fname, []).append(orig)
        for fname, keys in by_file.items():
            with safe_open(str(self.dir / fname), "pt") as h:
                for key in keys:
                    sl = h.get_slice(key)
                    name = _ST_DTYPES.get(sl.get_dtype())
                    if name is not None:
                        elements[name] = elements.get(name, 0) + int(torch.Size(sl.get_shape()).numel())
        return max(elements, key=elements.__getitem__) if elements else None

    def get(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise KeyError(f"{self.dir}: tensor {key!r} not found")
        fname, orig = self._where[key]
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


def cast_floating(tensors: Iterable[tuple[str, torch.Tensor]],
                  dtype: str | None) -> Iterable[tuple[str, torch.Tensor]]:
    """The stream with its floating tensors in `dtype` (None: as they are); integer buffers keep theirs."""
    target = DTYPE_NAMES[dtype] if dtype is not None else None
    for name, t in tensors:
        yield name, t.to(target) if target is not None and t.is_floating_point() else t


def write_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike,
                  max_shard_bytes: int = 2 * 1024**3) -> list[str]:
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
        tmp_files.append(path)
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
