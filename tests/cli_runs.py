"""Command lines the tests share: option lists from keyword arguments, and a CLI run in a subprocess.

`flags(dataset="infinity-mm", input=raw, samples_per_shard=40)` reads as the command it stands for
(`--dataset infinity-mm --input RAW --samples-per-shard 40`), so a test states only its values."""

from __future__ import annotations

import os
import subprocess
import sys


def flags(**options: object) -> list[str]:
    """`--name value` for each option, in the order given (`_` in a name becomes `-`): True gives
    the bare `--name`, None or False leaves the option out, a list gives `--name item` for each
    item, anything else is passed as `str(value)`."""
    argv: list[str] = []
    for name, value in options.items():
        option = "--" + name.replace("_", "-")
        if value is True:
            argv.append(option)
        elif isinstance(value, list):
            argv += [arg for item in value for arg in (option, str(item))]
        elif value is not None and value is not False:
            argv += [option, str(value)]
    return argv


def run_module(
    module: str, *args: str, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` with this interpreter, its output captured as text. `env` is the
    whole environment (default: this process's); `check` fails the test with the output on a
    non-zero exit status."""
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ if env is None else env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
