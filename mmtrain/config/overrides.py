"""Command-line overrides (`a.b.c=value`) and stages (`stage: NAME` over a `stages:` table),
applied to the raw recipe tree before it is typed.

A stage patch is a partial recipe (nested mappings or dotted keys) merged over the file when
`stage: name` is selected (in the file or as `stage=name` on the command line). Command-line
overrides win over the stage patch. The resolved recipe has the patch applied and no `stages:`
table; its `stage:` then only records which stage it was made from. Every key set by a patch or
an override is remembered (`origins`) so errors can say where a bad value came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import yaml

from mmtrain.config.errors import KeyPath, RecipeError, show, suggest


@dataclass(frozen=True)
class Override:
    path: KeyPath
    value: Any
    text: str


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_][A-Za-z0-9_\-]*)*$")


def parse_override(text: str) -> Override:
    """`a.b.c=value` -> Override; the value is read with yaml.safe_load (`x=` means null)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.match(key):
        raise RecipeError([f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. train.iters=100"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise RecipeError([f"override {text!r}: value is not valid YAML ({err})"]) from None
    return Override(tuple(key.split(".")), value, text)


def apply_overrides_and_stage(raw: dict, override_texts: Sequence[str]) -> tuple[dict, dict[KeyPath, str]]:
    """(the tree with the selected stage and the overrides applied, {key path: origin})."""
    parsed = [parse_override(t) for t in override_texts]
    tree = _copy(raw)
    origins: dict[KeyPath, str] = {}
    for ov in parsed:  # first pass: may select the stage or edit the stage table
        _set_path(tree, ov.path, ov.value, f"override {ov.text!r}")

    stages = tree.pop("stages", None)
    stage = _stage_name(tree.get("stage"))
    tree["stage"] = stage
    stage_override = next((ov.text for ov in parsed if ov.path == ("stage",)), None)
    if stages is None and stage is not None and stage_override is not None:
        raise RecipeError([f"override {stage_override!r}: stage: this recipe has no stages: table"])
    if stages is not None and stage is not None:
        if not isinstance(stages, dict) or not all(isinstance(v, dict) for v in stages.values()):
            raise RecipeError(["stages: expected a mapping of stage name -> partial recipe"])
        table = {_stage_name(k): v for k, v in stages.items()}
        if stage not in table:
            raise RecipeError(
                [f"stage: unknown stage {stage!r}; known: {', '.join(map(repr, table))}" + suggest(stage, list(table))]
            )
        patch = _nest(table[stage])
        if "stages" in patch or "stage" in patch:
            raise RecipeError([f"stages.{stage}: a stage may not set 'stage' or 'stages'"])
        tree = _merge(tree, patch)
        for p in _leaf_paths(patch):
            origins[p] = f"stage {stage!r}"
    for ov in parsed:  # second pass: the command line wins over the stage patch
        if ov.path[0] not in ("stages", "stage"):
            _set_path(tree, ov.path, ov.value, f"override {ov.text!r}")
            origins[ov.path] = f"override {ov.text!r}"
    return tree, origins


def _set_path(tree: dict, path: KeyPath, value: Any, what: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            raise RecipeError([f"{what}: {'.'.join(path[: i + 1])} is a {type(nxt).__name__}, not a section"])
        node = nxt
    node[path[-1]] = value


def _nest(patch: dict) -> dict:
    """Dotted keys in a stage patch -> nested mappings."""
    out: dict = {}
    for key, value in patch.items():
        value = _nest(value) if isinstance(value, dict) else value
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = _merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = value
    return out


def _merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaf_paths(tree: dict, prefix: KeyPath = ()) -> list[KeyPath]:
    paths = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            paths += _leaf_paths(value, prefix + (str(key),))
        else:
            paths.append(prefix + (str(key),))
    return paths


def _stage_name(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # `stage: 1` and `stage=1` name stage "1"
    raise RecipeError([f"stage: expected a stage name (str or int), got {show(value)}"])


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree
