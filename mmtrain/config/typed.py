"""Typed conversion: plain YAML values -> the recipe's dataclasses, and back.

Types are strict: no string becomes a number and no number a bool; an int is accepted where a
float is expected, and a float key also takes the scientific spelling `1e-3`, which YAML 1.1
(PyYAML) reads as a string. Unknown keys, wrong types and bad enum values are reported with the
key's full path (and a "did you mean" hint) to a `RecipeErrors` collector.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, TypeVar

from mmtrain.config.errors import KeyPath, RecipeError, RecipeErrors, show, suggest
from mmdata.units import plural

_YAML11_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
_NONE = type(None)
_T = TypeVar("_T")


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "anything"
    if tp is _NONE:
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return f"list of {len(args)} ({', '.join(type_name(a) for a in args)})"
    if origin is dict:
        return f"mapping of {type_name(args[1])}" if args else "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def convert(value: Any, tp: Any, path: KeyPath, errors: RecipeErrors) -> Any:
    """Check `value` against type `tp`; returns the typed value (dataclass instances for sections)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        for arg in args:
            if arg is _NONE:
                continue
            trial = RecipeErrors()
            out = convert(value, arg, path, trial)
            if not trial.items:
                return out
        errors.add(path, f"expected {type_name(tp)}, got {show(value)}")
        return None
    if origin is Literal:
        if value in args and type(value) is type(next(a for a in args if a == value)):
            return value
        hint = suggest(value, [str(a) for a in args]) if isinstance(value, str) else ""
        errors.add(path, f"expected {type_name(tp)}, got {show(value)}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        return convert_section(value, tp, path, errors)
    if origin is list:
        if not isinstance(value, list):
            errors.add(path, f"expected {type_name(tp)}, got {show(value)}")
            return []
        return [
            convert(v, args[0] if args else Any, path[:-1] + (f"{path[-1]}[{i}]",), errors) for i, v in enumerate(value)
        ]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            errors.add(path, f"expected {type_name(tp)}, got {show(value)}")
            return ()
        if len(args) == 2 and args[1] is Ellipsis:
            item_types = [args[0]] * len(value)
        else:
            item_types = list(args)
            if len(value) != len(args):
                errors.add(path, f"expected {type_name(tp)}, got {plural(len(value), 'item')}")
                return tuple(value)
        return tuple(
            convert(v, t, path[:-1] + (f"{path[-1]}[{i}]",), errors) for i, (v, t) in enumerate(zip(value, item_types))
        )
    if origin is dict:
        if not isinstance(value, dict):
            errors.add(path, f"expected {type_name(tp)}, got {show(value)}")
            return {}
        key_t, val_t = args if args else (Any, Any)
        return {
            convert(k, key_t, path + (str(k),), errors): convert(v, val_t, path + (str(k),), errors)
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _YAML11_FLOAT.match(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value
    errors.add(path, f"expected {type_name(tp)}, got {show(value)}")
    return value


def convert_section(value: Any, cls: type[_T], path: KeyPath, errors: RecipeErrors) -> _T | None:
    """A mapping -> an instance of dataclass `cls` (None when something in it is wrong; the
    problems are in `errors`). Missing keys take the dataclass's defaults."""
    if not isinstance(value, dict):
        errors.add(path, f"expected a mapping (section {cls.__name__}), got {show(value)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in value:
        if not isinstance(key, str) or key not in fields:
            errors.add(path + (str(key),), "unknown key" + suggest(str(key), list(fields)))
    kwargs: dict[str, Any] = {}
    ok = True
    for name, f in fields.items():
        if name in value:
            before = len(errors.items)
            kwargs[name] = convert(value[name], hints[name], path + (name,), errors)
            ok = ok and len(errors.items) == before
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.add(path + (name,), f"missing required key ({type_name(hints[name])})")
            ok = False
    if not ok or len(value) != sum(1 for k in value if k in fields):
        return None
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # the class's own __post_init__ checks
        errors.add(path, str(err))
        return None


def from_plain(cls: type[_T], value: Any, where: str) -> _T:
    """`convert_section` for a saved config (e.g. a checkpoint's `model_config.yaml`): raises
    RecipeError naming `where` and the key path of every problem."""
    errors = RecipeErrors()
    out = convert_section(value, cls, (), errors)
    if errors.items or out is None:
        raise RecipeError(errors.items or ["not a valid section"], where)
    return out


def to_plain(obj: Any) -> Any:
    """Dataclasses/tuples -> plain dicts/lists, ready for yaml.safe_dump."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
