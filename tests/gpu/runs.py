"""Shared helpers of the gpu tier: the `mmtrain` CLI in subprocesses on the GPU (or, for the
references, on the CPU with CUDA hidden), the data that makes a step end on a text-only
micro-batch, Transformer Engine hidden from a subprocess, and transformers' Emu3 oracle on CUDA.

Light at import: the CPU tiers collect tests/gpu, so nothing here builds data or models until a
test asks for it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from mmdata import shard_format as sf
from mmdata.shard_job.energon_meta import write_energon_index, write_tar_index
from mmdata.shard_job.shard_writer import SampleMembers, write_shard
from mmdata.energon_loaders.emu3 import token_format as tf
from tests.fixtures_training import REPO, free_port, metrics, read_dist_ckpt, train_env  # noqa: F401 (re-exported)

LLAVA_RECIPE = REPO / "recipes" / "llava-ov-tiny.yaml"
EMU3_RECIPE = REPO / "recipes" / "emu3-tiny.yaml"
COMMANDS = {
    "llava-ov": [sys.executable, "-m", "mmtrain.cli", "llava-ov", str(LLAVA_RECIPE)],
    "emu3": [sys.executable, "-m", "mmtrain.cli", "emu3", str(EMU3_RECIPE)],
}
SEQ_LENGTH = {"llava-ov": 1024, "emu3": 512}  # what the CPU tests train the tiny recipes at

#: the GPU configuration of a real run: bf16 params with fp32 masters, megatron's distributed
#: optimizer (so DDP's overlapped grad reduce is in force, review A1), nccl
GPU = ("parallel.precision=bf16", "parallel.distributed_optimizer=true", "parallel.backend=auto")
#: the CPU reference: fp32 on gloo, CUDA hidden from the process (review A7: gloo with CUDA visible
#: is refused or half on the GPU)
CPU = ("parallel.precision=fp32", "parallel.backend=gloo")
CPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}

#: messages the runtime logs that the tests look for
TE_FALLBACK = "Transformer Engine unusable ("
FRESH_OPTIMIZER = "starting the optimizer fresh"


# ----------------------------------------------------------------------------- training runs


def train_args(family: str, run_dir: Path, data: Path, tokenizer: Path, *overrides: str) -> list[str]:
    """The command line of `mmtrain FAMILY RECIPE` as tests/test_train_runtime.py's `train` builds it."""
    return COMMANDS[family] + [
        f"run_dir={run_dir}",
        f"data.paths=[{data}]",
        f"tokenizer.path={tokenizer}",
        "data.num_workers=1",
        f"train.seq_length={SEQ_LENGTH[family]}",
        "logging.tensorboard=false",
        "parallel.nproc_per_node=1",
        f"parallel.master_port={free_port()}",
        *overrides,
    ]


def run_env(env: dict[str, str] | None = None) -> dict[str, str]:
    return train_env(**(env or {}))


def train(
    family: str,
    run_dir: Path,
    data: Path,
    tokenizer: Path,
    *overrides: str,
    env: dict[str, str] | None = None,
    expect_rc: int = 0,
) -> subprocess.CompletedProcess:
    """One `mmtrain` training subprocess; AssertionError with its output tail on another exit code."""
    cmd = train_args(family, run_dir, data, tokenizer, *overrides)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env(env), cwd=REPO)
    if proc.returncode != expect_rc:
        raise AssertionError(
            f"training exited {proc.returncode}, expected {expect_rc}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def train_killed(
    family: str,
    run_dir: Path,
    data: Path,
    tokenizer: Path,
    *overrides: str,
    log: Path,
    kill_at: str,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """A training SIGKILLed at `kill_at` ("STEP:PHASE" of a checkpoint save: tests/workers/kill_in_save.py),
    its process group with it: tests/test_train_reliability.py's `_run_killed`. (exit status, stderr)."""
    from tests.fixtures_training import run_killed
    from tests.workers import kill_in_save

    return run_killed(
        kill_in_save.command(kill_at, train_args(family, run_dir, data, tokenizer, *overrides)), log, **(env or {})
    )


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`mmtrain ARGS` (convert, generate) in a subprocess that must exit 0."""
    cmd = [sys.executable, "-m", "mmtrain.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env(env), cwd=REPO)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


def assert_finite(m: dict[int, dict], steps: Sequence[int]) -> None:
    assert sorted(m) == list(steps), sorted(m)
    for step in steps:
        assert math.isfinite(m[step]["loss"]) and math.isfinite(m[step]["grad_norm"]), m[step]
        assert m[step]["num_loss_tokens"] > 0


def assert_loss_falls(m: dict[int, dict]) -> None:
    """Over 4 steps: the last two steps' mean below step 1 (one noisy step may go up)."""
    assert (m[3]["loss"] + m[4]["loss"]) / 2 < m[1]["loss"], [m[s]["loss"] for s in sorted(m)]


# ----------------------------------------------------------------------------- data


def llava_mixed_samples(n: int = 32, seed: int = 0) -> list:
    """`n` dev samples alternating image / text-only by shard key: even keys hold one image, odd
    keys none. Read in key order (no shuffle buffer, one worker, one shard slice), 2 micro-batches
    of one unpacked sample per step end every step on a text-only micro-batch."""
    import numpy as np

    from mmdata.dev.shards import DevSample
    from tests.emu3_tiny import encode_image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            conv = [
                {"from": "human", "value": "<image>\nWhat is in the picture?"},
                {"from": "gpt", "value": "Some coloured noise."},
            ]
            out.append(DevSample(f"img-{i}", conv, [("png", encode_image(rng, 60 + i, 45))]))
        else:
            conv = [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi! Nice to meet you."}]
            out.append(DevSample(f"txt-{i}", conv))
    return out


#: loader settings that keep the dev shards in key order, one sample per micro-batch
LLAVA_ORDERED = ("data.packing=false", "data.shuffle_buffer_size=0")


#: 4 steps, checkpoints at 2 and 4 (the resume test's reference shape)
FOUR_STEPS = ("train.iters=4", "checkpoint.interval=2", "checkpoint.keep_last=2")


def llava_4_steps(freeze: str) -> tuple[str, ...]:
    """The overrides of a 4-step LLaVA-OV run over the mixed shards with `freeze` (e.g. "[]")."""
    return (f"freeze={freeze}", *FOUR_STEPS, *LLAVA_ORDERED)


def write_llava_mixed_shards(out: Path) -> Path:
    from mmdata.dev.shards import write_dev_shards

    samples = llava_mixed_samples()
    return write_dev_shards(out, samples, samples_per_shard=len(samples))


def write_llava_halves_shards(out: Path) -> Path:
    """`llava_mixed_samples` reordered: the 16 image samples first, then the 16 text-only ones. Read
    in key order by 2 DP ranks (`data.sharding=dp`: energon gives each rank one half), one rank
    draws only images and the other only text: what vision-aware balancing exchanges rows for."""
    from mmdata.dev.shards import write_dev_shards

    samples = llava_mixed_samples()
    ordered = [s for s in samples if s.images] + [s for s in samples if not s.images]
    return write_dev_shards(out, ordered, samples_per_shard=len(ordered))


def write_emu3_token_shards(out: Path, n: int = 48, seed: int = 0, codebook_size: int = 512) -> Path:
    """Emu3 token shards written directly (token_format.py's contract, the shard writer and energon
    index `mmdata tokenize-images` uses), without Ray or the VQ (review 2, N4: the gpu tier tests
    the GPU path, and a node's wheelhouse has no Ray): captions (one image each, so both tasks
    draw them), two-image chats and text-only records, random 8x8 code grids of the tiny VQ's
    512-code book (the tiny recipe's tokenizer), in shards of 16."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    names, layouts, per_shard = [], [], 16
    for shard_i, start in enumerate(range(0, n, per_shard)):
        items = []
        for i in range(start, min(n, start + per_shard)):
            images = (1, 2, 0)[i % 3]
            prompt = "<image>\n" * images + ("Describe the picture." if images else "Tell me a fact.")
            conv = [
                {"from": "human", "value": prompt},
                {"from": "gpt", "value": f"Answer {i}: {'a noisy picture' if images else 'the sea is salty'}."},
            ]
            sources = [sf.image_member_name(k, "png") for k in range(images)]
            record = sf.SampleRecord(id=f"tok-{i}", source="gpu-tier", conversations=conv, images=sources, video=None)
            members = [(sf.JSON_MEMBER, json.dumps(record.__dict__).encode())]
            grids = []
            for src in sources:
                member = tf.grid_member_name(src)
                members.append((member, tf.encode_grid(rng.integers(0, codebook_size, (8, 8)), codebook_size)))
                grids.append(tf.GridInfo(member=member, source=src, height=8, width=8, pixels=[64, 64]))
            members.append((tf.VQ_JSON_MEMBER, tf.encode_vq_json(grids)))
            items.append(SampleMembers(f"{i:010d}", sorted(members)))
        name = sf.SHARD_NAME_TEMPLATE.format(shard_i)
        _, layout = write_shard(out / name, items)
        write_tar_index(out / name, layout)
        names.append(name)
        layouts.append(layout)
    write_energon_index(out, names, layouts, sample_type=tf.SAMPLE_TYPE)
    return out


def is_text_only(sample_key: str) -> bool:
    """A `DATASET#SHARD_KEY` of `llava_mixed_samples`: odd keys are text-only."""
    return int(sample_key.rsplit("#", 1)[-1]) % 2 == 1


def visible_gpus() -> int:
    """CUDA devices this process sees (0 in the CPU tiers: tests/conftest.py hides CUDA there)."""
    import torch

    return torch.cuda.device_count()


def needs_gpus(n: int):
    """A test's mark: skip it at collection when fewer than `n` GPUs are visible (one rank per GPU:
    NCCL refuses two ranks of a communicator on one device). Decided before any of its fixtures is
    built, so one GPU does not train a reference run for tests that then skip (review 2, N5)."""
    import pytest

    have = visible_gpus()
    return pytest.mark.skipif(have < n, reason=f"needs {n} GPUs (one rank per GPU), {have} visible")


def by_sample(record: dict) -> list[tuple[str, float]]:
    """A metrics record's (sample id, loss) pairs, sorted: the same samples whatever micro-batch
    or DP rank balancing moved them to."""
    return sorted(zip(record["sample_ids"], record["sample_losses"]))


# ----------------------------------------------------------------------------- Transformer Engine


def hidden_te_env(root: Path) -> dict[str, str]:
    """An environment whose `import transformer_engine` fails as on a host without TE (a package of
    that name first on PYTHONPATH raising ModuleNotFoundError): megatron binds its MagicMocks
    (review A2). Not a bare ImportError: megatron 0.16's tensor_parallel/random.py catches only
    ModuleNotFoundError, so megatron itself would not import."""
    pkg = root / "no_te" / "transformer_engine"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        'raise ModuleNotFoundError("transformer_engine hidden by the gpu tier", name="transformer_engine")\n'
    )
    path = os.pathsep.join(p for p in (str(pkg.parent), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


def te_probe(env: dict[str, str] | None = None) -> dict:
    """`mmtrain.models.te_support.te_status()` as a subprocess with `env` sees it."""
    code = (
        "import dataclasses, json; from mmtrain.models.te_support import te_status; "
        "print(json.dumps(dataclasses.asdict(te_status())))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env(env), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- checkpoints


def write_llava_hf(out: Path, noise: float = 0.3, seed: int = 0) -> Path:
    """A random HF LLaVA-OV with the tiny recipe's sizes (tests/test_train_runtime.py's
    `write_tiny_hf_model`), its text weights spread by `noise` so the loss sits far from the
    uniform ln(vocab) that a model with lost weights would also give."""
    import torch
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    from mmtrain.config import load_recipe
    from mmtrain.llava_ov.state_dict_adapter import hf_config_from_llava

    cfg = hf_config_from_llava(load_recipe(LLAVA_RECIPE, ["action=dry_run"]).model)
    cfg.pop("model_type", None)
    cfg.pop("architectures", None)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" not in name:
                p.add_(torch.randn_like(p) * noise)
    model.save_pretrained(out)
    return out


def model_tensors(ckpt_iter_dir: Path) -> dict:
    """Every model tensor of one iteration directory (`.../iter_NNNNNNN`), unsharded."""
    return read_dist_ckpt(ckpt_iter_dir / "model")


def iter_dir(run_or_ckpts: Path, step: int) -> Path:
    root = run_or_ckpts / "checkpoints" if (run_or_ckpts / "checkpoints").is_dir() else run_or_ckpts
    return root / f"iter_{step:07d}"


# ----------------------------------------------------------------------------- generation oracle


def hf_emu3_tokens(model, prompt_ids, negative_ids, rows: int, cols: int, scale: float) -> list[int]:
    """transformers' Emu3 text-to-image generate as its docs run it (tests/test_generate.py's
    `_hf_emu3_generate`), on the model's device: guidance, negative prompt, prefix constraint, greedy."""
    import torch

    from mmtrain.emu3.hf_reference import emu3_prefix_constraint

    vocab = model.model.vocabulary_mapping
    cfg = model.config.text_config
    m = vocab.vocab_map
    allowed = emu3_prefix_constraint(
        rows,
        cols,
        m["<|image token|>"],
        m["<|extra_200|>"],
        m["<|extra_201|>"],
        m["<|image end|>"],
        cfg.eos_token_id,
        cfg.pad_token_id,
        vocab.image_tokens,
    )
    ids = torch.as_tensor(list(prompt_ids), device=model.device)[None]
    kw = {}
    if scale != 1:
        kw = dict(
            guidance_scale=scale, negative_prompt_ids=torch.as_tensor(list(negative_ids), device=model.device)[None]
        )
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=(cols + 1) * rows + 10, do_sample=False, prefix_allowed_tokens_fn=allowed, **kw
        )
    return out[0, ids.shape[1] :].tolist()
