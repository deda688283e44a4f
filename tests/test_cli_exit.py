"""The mmdata CLI's exit: garbage is collected (finalizers run) and what is still alive is frozen,
so the interpreter's teardown skips the repeated collections over Ray's whole heap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PROGRAM = """
import atexit, gc, sys
marker = sys.argv[1]
# registered before mmdata.cli's own handler, so it runs after it
atexit.register(lambda: open(marker + ".frozen", "w").write(str(gc.get_freeze_count())))
import mmdata.cli

class Cycle:
    def __del__(self):
        open(marker + ".finalized", "w").write("yes")

c = Cycle()
c.self = c
del c  # garbage, in a cycle: only a collection finalizes it
"""


def test_exit_collects_garbage_then_freezes_the_rest(tmp_path: Path):
    marker = tmp_path / "m"
    subprocess.run([sys.executable, "-c", _PROGRAM, str(marker)], check=True)
    assert (tmp_path / "m.finalized").read_text() == "yes"  # collected before the freeze
    assert int((tmp_path / "m.frozen").read_text()) > 0
