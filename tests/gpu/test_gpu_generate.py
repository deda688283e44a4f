"""`mmtrain generate` on CUDA against transformers' `generate` on CUDA: the GPU versions of
tests/test_generate.py's parity tests, on the same tiny random models (its fixtures) and oracles.

The product runs as users run it (the CLI in a subprocess, `--device cuda`), the oracle in this
process. Both in float32: greedy tokens are then a strict, robust comparison (the logits differ
only by kernel rounding, TF32 at most, far below the spread models' top-2 margins). In bf16 the two
implementations round differently (review D: RMSNorm's cast order), so greedy paths may
legitimately part after a near tie; that dtype is not compared token for token.

Review findings proved here: A2 (the generation model builds on a CUDA host, TE or not) and A4
(standalone inference sets its CUDA device before NCCL starts, `ensure_model_parallel`).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from tests.emu3_tiny import emu3_tok_dir, tiny_vq_dir  # noqa: F401
from tests.gpu import runs
from tests.llava_tiny import images
from tests.llava_tiny import hf_greedy_answer, hf_llava_processor

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


def generate_args() -> tuple[str, ...]:
    return ("--device", DEVICE, "--dtype", "float32", "--greedy", "--no-progress")


def _generate(family: str, checkpoint, prompts, out, *options: str) -> None:
    """`mmtrain generate FAMILY` of `prompts` from `checkpoint` into `out`: greedy, fp32, on the device."""
    where = ("--checkpoint", str(checkpoint), "--prompts", str(prompts), "--output", str(out))
    runs.cli("generate", family, *where, *options, *generate_args())


def test_llava_ov_greedy_on_cuda_equals_transformers(llava_hf, tmp_path):
    """Batched greedy answers on CUDA (two questions with images of different anyres grids, one
    text-only) are transformers' `generate` tokens on CUDA from the HF processor's inputs."""

    hf_dir, model, tok = llava_hf
    pictures = images()
    questions = [("What is shown in this picture?", 0), ("Say hi.", None), ("Describe it.", 1)]
    for i in (0, 1):
        pictures[i].save(tmp_path / f"img{i}.png")  # lossless: the CLI reads the same pixels
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": q, **({"image": f"img{i}.png"} if i is not None else {})}) + "\n"
            for q, i in questions
        )
    )
    out = tmp_path / "answers.jsonl"
    _generate("llava-ov", hf_dir, prompts, out, "--max-new-tokens", "12", "--batch-size", "3")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == len(questions)

    oracle = copy.deepcopy(model).to(DEVICE).eval()
    processor = hf_llava_processor(tok)
    for line, (q, i) in zip(lines, questions):
        text = tok.apply_chat_template(
            [{"role": "user", "content": ("<image>\n" if i is not None else "") + q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        inputs = (
            processor(images=[pictures[i]], text=[text], return_tensors="pt")
            if i is not None
            else tok([text], return_tensors="pt")
        ).to(DEVICE)
        assert line["tokens"] == hf_greedy_answer(oracle, inputs, tok, max_new_tokens=12), q
    assert len(set(lines[0]["tokens"])) > 3  # a real answer, not one repeated token


def test_emu3_cfg_greedy_on_cuda_equals_transformers(emu3_hf, tmp_path):
    """Two guided prompts of different lengths and sizes, batched with their negative prompts, on
    CUDA: each image's code grid is the one of transformers' guidance_scale generate on CUDA with
    the prefix constraint of its Emu3 docs (the same prompt ids: `generation_prompt`, which
    tests/test_generate.py proves equal to `Emu3Processor`'s)."""
    from transformers import AutoTokenizer

    from mmdata.energon_loaders.emu3.serialize import Emu3Vocab, generation_prompt, hf_text_encoder

    hf_dir, model = emu3_hf
    asks = [
        ("a red bus parked next to a tall building", 32, 40, "lowres, bad anatomy", 3.0),
        ("a cat", 24, 32, "blurry", 2.5),
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": t, "height": h, "width": w, "negative_prompt": n, "cfg_scale": s}) + "\n"
            for t, h, w, n, s in asks
        )
    )
    out = tmp_path / "imgs"
    _generate("emu3", hf_dir, prompts, out, "--batch-size", "2")
    lines = [json.loads(x) for x in (out / "images.jsonl").read_text().splitlines()]
    assert len(lines) == len(asks)

    import torch

    tok = AutoTokenizer.from_pretrained(hf_dir)
    vocab, encode = Emu3Vocab.from_tokenizer(tok), hf_text_encoder(tok)
    oracle = copy.deepcopy(model).to(DEVICE).eval()
    for line, (text, h, w, negative, scale) in zip(lines, asks):
        rows, cols = h // 8, w // 8
        ref = runs.hf_emu3_tokens(
            oracle,
            generation_prompt(text, rows, cols, vocab, encode),
            generation_prompt(negative, rows, cols, vocab, encode),
            rows,
            cols,
            scale,
        )
        body = torch.tensor(ref[: rows * (cols + 1)]).reshape(rows, cols + 1)  # each row: codes, end-of-line
        expected = model.model.vocabulary_mapping.convert_bpe2img(body).numpy()
        grid = np.asarray(line["grid"])
        assert grid.shape == (rows, cols) and np.array_equal(grid, expected), text
        assert len(set(grid.ravel().tolist())) > 1
