"""Test-only entry: `mmtrain` in this process, with rank 0 SIGKILLed at one phase of one
checkpoint save (the crash-consistency tests: test_train_reliability.py, tests/gpu).

    python -m tests.workers.kill_in_save STEP:PHASE[:int] mmtrain-ARGS...

PHASE is a part staged ("model", "optimizer", ...) or "publish" (staged completely, not yet
renamed into place): `mmtrain.runtime.checkpoint.manager.SAVE_PHASE_OBSERVERS`. With ":int" the
process group gets SIGINT instead (what Ctrl-C in a terminal sends). `command` is for runs that
train in the launching process (a world of one); `env` for any run, torchrun's ranks included
(tests/workers/kill_hook/sitecustomize.py installs the observer in every process)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from mmtrain.cli import main
from mmtrain.runtime.checkpoint.manager import SAVE_PHASE_OBSERVERS


def command(kill_at: str, mmtrain_command: list[str]) -> list[str]:
    """`[python, -m, mmtrain.cli, ARGS...]` -> the same run through this entry, killed at `kill_at`."""
    python, flag, module, *args = mmtrain_command
    assert (flag, module) == ("-m", "mmtrain.cli"), mmtrain_command
    return [python, "-m", "tests.workers.kill_in_save", kill_at, *args]


def env(kill_at: str) -> dict[str, str]:
    """The environment that kills the run at `kill_at` in whichever of its processes is rank 0."""
    repo = Path(__file__).resolve().parents[2]
    path = [str(Path(__file__).parent / "kill_hook"), str(repo), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), "MMTRAIN_TEST_KILL_AT": kill_at}


def install(kill_at: str) -> None:
    step, phase, *how = kill_at.split(":")

    def kill(rank: int, at_step: int, at_phase: str) -> None:
        if rank == 0 and (at_step, at_phase) == (int(step), phase):
            if how == ["int"]:
                os.killpg(os.getpgid(0), signal.SIGINT)
            else:
                os.kill(os.getpid(), signal.SIGKILL)

    SAVE_PHASE_OBSERVERS.append(kill)


if __name__ == "__main__":
    install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
