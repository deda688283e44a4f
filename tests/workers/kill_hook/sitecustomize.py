"""Test-only: every Python process started with this folder on PYTHONPATH installs the kill
observer of tests/workers/kill_in_save.py when MMTRAIN_TEST_KILL_AT names a save phase, so the
ranks torchrun starts get it too (they inherit the environment). `kill_in_save.env` sets both."""

import os

if os.environ.get("MMTRAIN_TEST_KILL_AT"):
    from tests.workers import kill_in_save

    kill_in_save.install(os.environ["MMTRAIN_TEST_KILL_AT"])
