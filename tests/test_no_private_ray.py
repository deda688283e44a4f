"""No module of mmdata/ or mmtrain/ uses Ray's private internals (`ray._private`, `_raylet`):
those change without notice between Ray releases, and a patch on them degrades silently on an
upgrade. A use is code that reaches them: an import, an attribute (`ray._private.worker`), a bare
`_raylet` name, or a module path handed to `importlib.import_module` / `__import__`. Text is not:
comments, docstrings, and other strings, such as a logger's name given to the standard `logging`
module (mmdata/ray_job.py, RAY_AUTH_LOGGER), which matches it as text and imports nothing.

A use that is gated (a version check that fails loudly, and a test) may stay when its line
carries ALLOW_MARKER; Ray has none."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("mmdata", "mmtrain")
PRIVATE_MODULES = ("ray._private", "ray._raylet")
ALLOW_MARKER = "# gated-private-api:"


def _is_private(dotted: str) -> bool:
    return any(dotted == m or dotted.startswith(m + ".") for m in PRIVATE_MODULES) or "_raylet" in dotted.split(".")


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every use of a private Ray module in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and (dotted := _dotted(node)):
            names = [dotted]
        elif isinstance(node, ast.Name) and node.id == "_raylet":
            names = [node.id]
        elif isinstance(node, ast.Call) and _dotted(node.func) in ("importlib.import_module", "import_module",
                                                                   "__import__"):
            names = [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        found += [(node.lineno, n) for n in names if _is_private(n)]
    return sorted(set(found))


def _offences(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    return [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in private_uses(text)
            if ALLOW_MARKER not in lines[line - 1]]


@pytest.mark.unit
def test_no_module_uses_rays_private_internals() -> None:
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    assert len(files) > 50  # (the packages were found)
    offences = [o for p in files for o in _offences(p)]
    assert offences == [], "Ray private internals used (use Ray's public API):\n" + "\n".join(offences)


@pytest.mark.unit
@pytest.mark.parametrize("code", [
    "from ray._private import node",
    "import ray._private.services as s",
    "from ray._raylet import GcsClient",
    "import ray\nray._private.worker._global_node.kill_monitor()",
    "from ray import _raylet",
    "import importlib\nimportlib.import_module('ray._private.state')",
])
def test_the_check_sees_each_kind_of_use(code: str) -> None:
    assert private_uses(code), code


@pytest.mark.unit
@pytest.mark.parametrize("code", [
    "import ray\nray.init(include_dashboard=False)",
    "import logging\nlogging.getLogger('ray._private.authentication.authentication_token_setup')",
    '"""Ray\'s ray._private.node is not used here."""',
    "# from ray._private import node",
    "from mmdata.ray_job import init_ray",
])
def test_the_check_ignores_text_and_public_api(code: str) -> None:
    assert private_uses(code) == [], code


#: the texts issue 31's grep looks for in mmdata/ and mmtrain/ (Ray, libwebp's cffi module, Pillow's PNG privates)
PRIVATE_TEXTS = ("ray._private", "_raylet", "webp._webp", "PngImagePlugin._")


def test_a_text_grep_for_private_names_finds_only_marked_lines():
    """The grep a reviewer runs: every line naming a private module as text carries ALLOW_MARKER
    (the one today is Ray's logger name), so a new unmarked use shows up without reading an AST."""
    unmarked = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                stripped = line.lstrip()
                if stripped.startswith("#") or ALLOW_MARKER in line:
                    continue
                if any(text in line for text in PRIVATE_TEXTS):
                    unmarked.append(f"{path.relative_to(REPO)}:{lineno}: {stripped}")
    assert not unmarked, "\n".join(unmarked)
