"""Small modules with one job (issue 44): no product module (a .py file under mmdata/ or mmtrain/)
grows over 500 lines, counted as `wc -l` counts them on the `ruff format`ed file. A module that
grows past it is split by concern, not cut at an arbitrary line."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("mmdata", "mmtrain")
MAX_LINES = 500


def line_count(path: Path) -> int:
    """`wc -l`: the newlines in the file."""
    return path.read_bytes().count(b"\n")


def oversized(root: Path = REPO) -> dict[str, int]:
    """Every product module over MAX_LINES, by its path relative to `root`."""
    sizes = {
        path.relative_to(root).as_posix(): line_count(path) for pkg in PACKAGES for path in (root / pkg).rglob("*.py")
    }
    return {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES}


def test_line_count_is_wc_l(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a = 1\nb = 2\n")
    assert line_count(f) == 2
    f.write_text("a = 1\nb = 2")  # no final newline: wc -l counts 1
    assert line_count(f) == 1


def test_the_product_is_read():
    counted = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    assert len(counted) > 100 and (REPO / "mmtrain/runtime/trainer.py") in counted


def test_no_product_module_over_500_lines():
    over = oversized()
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"
