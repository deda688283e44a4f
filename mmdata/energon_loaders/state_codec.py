"""Loader state <-> JSON, so checkpoints hold no pickles.

Energon's `save_state_rank()` returns nested energon dataclasses, `FlexState` dicts, lists,
tuples, bytes (RNG states), small tensors and scalars. This codec round-trips exactly those, tagging
non-JSON types; dataclasses are re-created only from `megatron.energon` modules, so loading a
checkpoint never imports or runs arbitrary code.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import json
from typing import Any

import numpy as np
import torch

_ALLOWED_MODULE_PREFIX = "megatron.energon"


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, bytes):
        return {"__bytes__": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {
            "__tensor__": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(t.numpy().tobytes()).decode("ascii"),
        }
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return {
            "__ndarray__": a.dtype.str,
            "shape": list(a.shape),
            "data": base64.b64encode(a.tobytes()).decode("ascii"),
        }
    if isinstance(obj, np.generic):
        return {"__npscalar__": obj.dtype.str, "value": obj.item()}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        return {
            "__dataclass__": f"{cls.__module__}:{cls.__qualname__}",
            "fields": {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)},
        }
    if isinstance(obj, dict):
        cls = type(obj)
        tag = "dict" if cls is dict else f"{cls.__module__}:{cls.__qualname__}"
        return {"__mapping__": tag, "items": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    raise TypeError(f"loader state holds an unsupported value of type {type(obj).__name__}")


def _resolve(path: str) -> type:
    module_name, _, qualname = path.partition(":")
    if not module_name.startswith(_ALLOWED_MODULE_PREFIX):
        raise ValueError(f"refusing to rebuild {path!r}: only {_ALLOWED_MODULE_PREFIX}.* types are allowed")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__bytes__" in obj:
        return base64.b64decode(obj["__bytes__"])
    if "__tensor__" in obj:
        dtype = getattr(torch, obj["__tensor__"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"bad tensor dtype {obj['__tensor__']!r} in loader state")
        raw = bytearray(base64.b64decode(obj["data"]))
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(obj["shape"]).clone()
    if "__ndarray__" in obj:
        dtype = np.dtype(obj["__ndarray__"])
        if dtype.hasobject:
            raise ValueError("object arrays are not allowed in loader state")
        return np.frombuffer(base64.b64decode(obj["data"]), dtype=dtype).reshape(obj["shape"]).copy()
    if "__npscalar__" in obj:
        return np.dtype(obj["__npscalar__"]).type(obj["value"])
    if "__tuple__" in obj:
        return tuple(_decode(v) for v in obj["__tuple__"])
    if "__dataclass__" in obj:
        cls = _resolve(obj["__dataclass__"])
        return cls(**{k: _decode(v) for k, v in obj["fields"].items()})
    if "__mapping__" in obj:
        items = {_decode(k): _decode(v) for k, v in obj["items"]}
        return items if obj["__mapping__"] == "dict" else _resolve(obj["__mapping__"])(items)
    raise ValueError(f"malformed loader state node with keys {sorted(obj)}")


def state_to_json(state: Any) -> str:
    return json.dumps(_encode(state), separators=(",", ":"))


def state_from_json(text: str) -> Any:
    return _decode(json.loads(text))
