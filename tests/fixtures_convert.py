"""`mmtrain convert` helpers and fixtures shared by the conversion test modules (registered for the
whole session in tests/conftest.py): the CLI in-process, a torchrun launch of a worker script, and
a tiny random HF LLaVA-OV dir with its megatron conversion (module-scoped: each module that asks
converts once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmtrain.cli import main
from mmtrain.runtime.distributed import free_port
from tests.llava_tiny import hf_llava


def convert_cli(*argv: str) -> int:
    """`mmtrain convert ...` in this process; its exit status."""
    return main(["convert", *argv])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = hf_llava(seed=1)
    model.save_pretrained(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return d, model


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    src, _ = hf_dir
    dst = tmp_path_factory.mktemp("ckpt")
    assert convert_cli("hf-to-mcore", "--model", "llava-ov", "--src", str(src), "--dst", str(dst)) == 0
    return dst


def torchrun(script: Path, *args: str, nproc: int = 2) -> None:
    """`script` on `nproc` torchrun ranks (gloo, CPU); fails the test with their output if one fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
