"""Recipes: YAML -> a validated, typed `Recipe` (and back to YAML).

  schema.py     the shared sections and their defaults (each default written once)
  typed.py      strict conversion of YAML values into the dataclasses, with key paths
  overrides.py  `a.b.c=value` overrides and `stage:` patches, remembering who set what
  checks.py     cross-field checks (layout, batch divisibility, parts, ...)
  errors.py     RecipeError / RecipeErrors: every problem at once, with origin and suggestion
  load.py       load_recipe / load_recipe_dict / save_resolved: the whole pipeline

The family-specific sections (`model:`, the family's `data:` keys, the parts `freeze:` and
`optimizer.lr_mult:` name, extra cross-checks) come from the family's `FamilySpec`.
"""

from mmtrain.config.errors import RecipeError
from mmtrain.config.load import dump_recipe, load_recipe, load_recipe_dict, save_resolved
from mmtrain.config.overrides import parse_override
from mmtrain.config.schema import Recipe

__all__ = ["Recipe", "RecipeError", "dump_recipe", "load_recipe", "load_recipe_dict", "parse_override", "save_resolved"]
