"""The recipe checks of `data.sharding: global` (mmdata.global_order): its blend parses against
the sources' names, and only what the global order reads is set. One line per problem, each
naming its key and the fix; the layout itself is never refused here (the order holds at any), nor a
packing plan balanced for another step shape (the order places each step's sequences itself)."""

from __future__ import annotations

from pathlib import Path

from mmdata.global_order.blend import Blend, BlendError
from mmdata.global_order.sources import source_name
from mmtrain.config.errors import RecipeErrors
from mmtrain.config.schema import Recipe


def source_names(paths: list[str]) -> list[str]:
    """The names a blend gives the sources: each shard folder's name as written (symlinks not
    followed), as `mmdata.global_order.sources.load_source` names them."""
    return [source_name(p) for p in paths]


def global_order_checks(r: Recipe, errors: RecipeErrors) -> None:
    d = r.data
    if d.sharding != "global":
        if d.blend is not None:
            errors.add(
                ("data", "blend"),
                f"is only read with data.sharding: global (got sharding: {d.sharding}); set "
                "data.sharding=global, or drop data.blend (other modes blend with a metadataset YAML)",
                [("data", "sharding")],
            )
        if d.order_window != "auto":
            errors.add(
                ("data", "order_window"),
                f"is only read with data.sharding: global (got sharding: {d.sharding}); drop it",
                [("data", "sharding")],
            )
        return
    if d.packing == "plan":
        if d.blend is not None:
            errors.add(
                ("data", "blend"),
                "mixes the sources the global order plans online; with data.packing: plan the rows are the "
                "plan's sequences of one folder: drop data.blend, or pack online (data.packing: true)",
                [("data", "packing")],
            )
        if d.order_window != "auto":
            errors.add(
                ("data", "order_window"),
                "is not read with data.packing: plan (a step is G of the plan's sequences): drop it",
                [("data", "packing")],
            )
    if d.order_window != "auto" and d.order_window < 1:
        errors.add(("data", "order_window"), f"must be >= 1 steps or auto, got {d.order_window}")
    for key, paths in (("paths", d.paths), ("val_paths", d.val_paths)):  # (evaluation reads in the same mode)
        if yamls := [p for p in paths if Path(p).suffix in (".yaml", ".yml")]:
            errors.add(
                ("data", key),
                f"{yamls[0]} is a metadataset YAML, which data.sharding: global does not read: list its shard "
                f"folders in data.{key} and put their weights in data.blend ({{weights: {{folder_name: w, ...}}}})",
                [("data", "sharding")],
            )
    if any(Path(p).suffix in (".yaml", ".yml") for p in d.paths):
        return
    names = source_names(d.paths)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        errors.add(
            ("data", "paths"),
            f"two shard folders share the name {twice[0]!r}, and data.sharding: global names each "
            "source by its folder's basename: rename (or link) one of them",
            [("data", "sharding")],
        )
        return
    if names:
        try:
            Blend.parse(d.blend, names)
        except BlendError as err:
            # (its message names the entry from `data.blend` on; the error line names the key itself)
            errors.add(("data", "blend"), str(err).removeprefix("data.blend").lstrip(". "), [("data", "sharding")])
