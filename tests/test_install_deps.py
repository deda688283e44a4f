"""What a plain `pip install .` (no extras) must bring: the packages the shipped recipes' defaults
use at run time. A default that needs a test-only extra fails preflight for a new user."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].strip().lower() for r in reqs}


@pytest.mark.unit
def test_recipe_defaults_need_no_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = _requirement_names(project["dependencies"])
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    uses_tensorboard = [
        r.name for r in recipes if ((yaml.safe_load(r.read_text()) or {}).get("logging") or {}).get("tensorboard")
    ]
    assert uses_tensorboard, "no shipped recipe sets logging.tensorboard: true (update this test)"
    assert "tensorboard" in runtime, (
        f"{uses_tensorboard} set logging.tensorboard: true: tensorboard must be a "
        "runtime dependency, not only in the test extra"
    )


@pytest.mark.unit
def test_the_libraries_whose_internals_matter_are_pinned_to_what_runs_here():
    """Ray (`data` extra), megatron-core, energon and webp carry an upper bound at the tested minor version, and
    the installed versions (what CI tests) satisfy the requirement."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # Ray is in the `data` extra (the training side and a GPU node's wheelhouse go without it)
    reqs = {
        Requirement(r).name: Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["data"]
    }
    for name in ("ray", "megatron-core", "megatron-energon", "webp"):
        spec = reqs[name].specifier
        assert any(s.operator == "<" for s in spec), f"{name} has no upper bound: {spec}"
        assert spec.contains(version(name)), f"installed {name} {version(name)} is outside {spec}"
