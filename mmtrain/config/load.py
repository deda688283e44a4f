"""Loading a recipe: YAML -> overrides and stage -> typed sections -> cross-checks,
all problems reported at once (RecipeError); and saving the resolved recipe.

Recipes are data (DESIGN.md): the shared sections are typed by `schema.py`, the `model:` and
`data:` sections by the classes the family declares in the registry (`FamilySpec`), which also
names the parts `freeze:` and `optimizer.lr_mult:` may refer to and adds its own cross-checks.
A recipe is validated here, once; the runtime reads the typed result and trusts it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import yaml

from mmtrain.config.checks import cross_checks
from mmtrain.config.errors import RecipeError, RecipeErrors, show, suggest
from mmtrain.config.overrides import apply_overrides_and_stage
from mmtrain.config.schema import Recipe
from mmtrain.config.typed import convert_section, to_plain
from mmtrain.spec import Ref

if TYPE_CHECKING:
    from mmtrain.spec import FamilySpec

#: sections typed by the family's own classes rather than by `Recipe`
FAMILY_SECTIONS = ("model", "data")
#: the registry sits above config (its family specs type the sections with classes built on
#: `schema`), so a recipe's `family:` is looked up through the registry's "module:function"
#: boundary, imported on the first recipe loaded without a `spec`
GET_FAMILY = Ref("mmtrain.registry:get_family")
FAMILY_NAMES = Ref("mmtrain.registry:family_names")


def load_recipe(
    path: str | os.PathLike,
    overrides: Sequence[str] = (),
    family: str | None = None,
    spec: FamilySpec | None = None,
) -> Recipe:
    """Read, merge (stage, overrides) and validate a recipe file. `family` is the CLI
    subcommand (`llava-ov`, ...); the recipe's `family:` must match it. `spec` types the family
    sections instead of the registry's entry (tests of the schema itself)."""
    text = Path(path).read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RecipeError([f"not valid YAML: {err}"], str(path)) from None
    return load_recipe_dict(raw if raw is not None else {}, overrides, family, spec, source=str(path))


def load_recipe_dict(
    raw: Any,
    overrides: Sequence[str] = (),
    family: str | None = None,
    spec: FamilySpec | None = None,
    source: str = "<dict>",
) -> Recipe:
    """`load_recipe` for an already-parsed mapping (tests, programmatic use)."""
    try:
        return _load(raw, overrides, family, spec)
    except RecipeError as err:
        raise RecipeError(err.errors, source) from None


def _load(raw: Any, override_texts: Sequence[str], family: str | None, spec: FamilySpec | None) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError([f"<top level>: expected a mapping, got {show(raw)}"])
    tree, origins = apply_overrides_and_stage(raw, override_texts)
    errors = RecipeErrors(origins)
    fam = tree.get("family")
    if family is not None and isinstance(fam, str) and fam != family:
        errors.add(("family",), f"recipe is for {fam!r} but was run as `mmtrain {family}`")
    if spec is None and isinstance(fam, str):
        try:
            spec = GET_FAMILY(fam)
        except KeyError:
            names = FAMILY_NAMES()
            errors.add(("family",), f"unknown model family {fam!r}{suggest(fam, names)} (known: {', '.join(names)})")

    sections = {name: tree.pop(name) for name in FAMILY_SECTIONS if name in tree}
    tree["model"] = {}  # typed below by the family's classes
    recipe = convert_section(tree, Recipe, (), errors)
    if "model" not in sections:
        errors.add(("model",), "missing required key (the family's model config)")
    if spec is not None:
        # `model:` with no keys (null) takes every default; other sections must be mappings
        model_raw = sections.get("model")
        model = convert_section({} if model_raw is None else model_raw, spec.model_config_cls, ("model",), errors)
        data = convert_section(sections.get("data", {}), spec.data_config_cls, ("data",), errors)
        if recipe is not None and model is not None and data is not None:
            recipe.model, recipe.data = model, data
            absolute_paths(recipe)
            cross_checks(recipe, spec, errors)
    errors.raise_if_any()
    return recipe


def absolute_paths(obj: Any) -> None:
    """Make the recipe's local paths (fields with `schema.PATH` metadata, in any section)
    absolute against the working directory, in place: the recipe, its saved copy and every
    worker then mean the same files from any folder."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("path"):
            setattr(obj, f.name, [_absolute(v) for v in value] if isinstance(value, list) else _absolute(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            absolute_paths(value)


def _absolute(path: Any) -> Any:
    return os.path.abspath(os.path.expanduser(path)) if isinstance(path, str) and path else path


# ----------------------------------------------------------------------------- saving


def recipe_to_dict(recipe: Recipe) -> dict:
    return to_plain(recipe)


def dump_recipe(recipe: Recipe) -> str:
    header = (
        "# Resolved recipe (stage and command-line overrides applied, paths absolute), written by mmtrain.\n"
        f"# Re-run it as is, from any folder: mmtrain {recipe.family} THIS_FILE\n"
    )
    plain = recipe_to_dict(recipe)
    if plain.get("action") == "print_config":  # what was printed is the recipe to run
        plain["action"] = "run"
    return header + yaml.safe_dump(plain, sort_keys=False, default_flow_style=False)


def save_resolved(recipe: Recipe, path: str | os.PathLike) -> Path:
    """Write the fully resolved recipe atomically; `load_recipe(path) == recipe`."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dump_recipe(recipe))
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes it 0600; a recipe is as shareable as the run_dir
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
