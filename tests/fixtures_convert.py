"""`mmtrain convert` helpers and the tiny HF model fixtures shared by the conversion and generation
test modules (registered for the whole session in tests/conftest.py, so kept light at import):
the CLI in-process, a torchrun launch of a worker script, a tiny random HF LLaVA-OV dir with its
megatron conversion, and `llava_hf` (over the tiny Qwen2 tokenizer). Module-scoped: each module
that asks builds them once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_preprocess import free_port


def convert_cli(*argv: str) -> int:
    """`mmtrain convert ...` in this process; its exit status."""
    from mmtrain.cli import main

    return main(["convert", *argv])


def save_siglip_tower(dst: Path) -> None:
    """A random 3-layer SigLIP tower of the tiny vision config, saved as an HF dir (a stage-1 start's
    vision part; draws from torch's global generator, so seed before)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from tests.llava_tiny import vision_config

    config = {k: v for k, v in vision_config(num_hidden_layers=3).items() if k != "model_type"}
    SiglipVisionModel(SiglipVisionConfig(**config)).save_pretrained(dst)


def assemble_stage1(root: Path) -> int:
    """`mmtrain convert hf-to-mcore` of a stage-1 start: the HF LLM in ROOT/llm and the vision tower
    in ROOT/vis assembled into the checkpoint ROOT/ck; its exit status."""
    llm, vision, dst = (str(root / name) for name in ("llm", "vis", "ck"))
    return convert_cli("hf-to-mcore", "--model", "llava-ov", "--llm", llm, "--vision", vision, "--dst", dst)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.llava_tiny import hf_llava

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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def tp2_worker_checks(worker: str, hf_src: Path, converted: Path, tmp_path: Path) -> dict:
    """tests/workers/WORKER on two torchrun ranks over an HF dir and its TP=1 conversion (it writes
    the TP=2 checkpoint to TMP/tp2): its HF, TP=1-checkpoint and sequence-parallel comparisons are
    within 1e-4 on the logits and 1e-5 on the loss. Returns all it measured."""
    result = tmp_path / "res.json"
    torchrun(
        Path(__file__).parent / "workers" / worker, str(hf_src), str(converted), str(tmp_path / "tp2"), str(result)
    )
    res = json.loads(result.read_text())
    for key in ("from_hf", "from_tp1_ckpt", "sequence_parallel"):
        logit_diff, loss_diff = res[key]
        assert logit_diff <= 1e-4, (key, logit_diff)
        assert loss_diff <= 1e-5, (key, loss_diff)
    return res


@pytest.fixture(scope="module")
def llava_hf(tmp_path_factory):
    """A tiny LLaVA-OV over the tiny Qwen2 tokenizer (its chat template, <image> id), saved as an
    HF dir with the tokenizer files; text weights scaled up so greedy answers vary."""
    import torch
    from transformers import AutoTokenizer

    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from tests.llava_tiny import hf_llava

    root = tmp_path_factory.mktemp("gen_llava")
    tok_dir = build_tiny_qwen2_tokenizer(root / "tok")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = hf_llava(
        seed=1,
        vocab_size=len(tok),
        image_token=tok.convert_tokens_to_ids("<image>"),
        video_token=tok.convert_tokens_to_ids("<video>"),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" not in name:
                p.add_(torch.randn_like(p) * 0.3)
    out = root / "hf"
    model.save_pretrained(out)
    for f in tok_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return out, model, tok
