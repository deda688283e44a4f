"""`mmdata --help`, `mmtrain --help` and every subcommand's `--help` start light: none of them
imports torch, megatron or ray (seconds of import each, before a user sees a line). The CLIs
run in a fresh interpreter (default tier: a subprocess), each help in turn, and the heavy
modules are looked for in `sys.modules` after each, so a failure names the first help that
pulled one in. The structure keeps this (the CLI dispatch imports a subcommand's module, whose
`run` starts the job), not hand-placed lazy imports; tests/test_layers.py holds those to the
named boundaries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "megatron", "ray")

# Runs in the child: every help of one CLI (the subcommands found from its own parser, nested
# ones included), printing after each the heavy top-level packages imported so far.
_PROBE = r"""
import argparse, contextlib, importlib, io, json, sys
prog, heavy = sys.argv[1], tuple(sys.argv[2:])
cli = importlib.import_module(prog + ".cli")

def helps(parser, prefix):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from helps(sub, prefix + [name])

def loaded():
    return sorted({m.split(".")[0] for m in sys.modules} & set(heavy))

for argv in [[]] + list(helps(cli.build_parser(), []))[1:]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            rc = cli.main(argv + ["--help"])
        except SystemExit as e:
            rc = e.code
    print(json.dumps({"argv": argv, "rc": rc, "printed": bool(out.getvalue()), "heavy": loaded()}), flush=True)
"""


@pytest.mark.parametrize("prog", ["mmdata", "mmtrain"])
def test_help_imports_no_torch_megatron_or_ray(prog):
    proc = subprocess.run([sys.executable, "-c", _PROBE, prog, *HEAVY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(runs) > 3, runs  # the top help and the subcommands' own
    for run in runs:
        command = " ".join([prog, *run["argv"], "--help"])
        assert run["rc"] == 0 and run["printed"], f"{command}: exit {run['rc']}"
        assert not run["heavy"], f"{command} imports {', '.join(run['heavy'])}"
