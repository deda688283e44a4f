"""`mmtrain generate` and the shared generation engine on tiny random models (no downloads).

Oracles: transformers' `generate` on the same weights - Emu3 with `guidance_scale`, a negative
prompt and the prefix-constrained image decoding of transformers' Emu3 docs (the reference's),
greedy; LLaVA-OV greedy from `LlavaOnevisionProcessor` inputs - and transformers' VQ decode and
image post-processing for the pixels. Plus the engine's own contracts: guidance scale 1 / 0,
the image structure under random weights and many seeds, batched = one by one, the direct
decode step = megatron's modules, top-k / top-p = transformers' warpers, user errors.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from tests.emu3_tiny import hf_emu3_generate  # noqa: E402
from tests.llava_tiny import hf_greedy_answer, hf_llava_processor, images  # noqa: E402


def _cli(*argv: str) -> int:
    from mmtrain.cli import main

    return main(["generate", *argv])


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def emu3_gen(emu3_hf):
    from mmtrain.emu3.generation import Emu3ImageGenerator
    from mmtrain.generation.checkpoint import Placement, resolve_checkpoint

    ref = resolve_checkpoint(emu3_hf[0], "emu3")
    return Emu3ImageGenerator(ref, Placement.resolve("cpu"), tokenizer_dir=ref.assets, vq_dir=ref.path)


@pytest.fixture(scope="module")
def llava_chat(llava_hf):
    from mmtrain.generation.checkpoint import Placement, resolve_checkpoint
    from mmtrain.llava_ov.generation import LlavaOVChat

    ref = resolve_checkpoint(llava_hf[0], "llava-ov")
    return LlavaOVChat(ref, Placement.resolve("cpu"), tokenizer_dir=ref.assets)


# ----------------------------------------------------------------------------- emu3 parity


@pytest.mark.unit
def test_emu3_cfg_greedy_matches_transformers_and_its_vq_decode(emu3_hf, emu3_gen):
    """Two prompts (different lengths, different sizes) batched with their negative prompts:
    the tokens of transformers' guidance_scale generate, and its decoded pixels."""
    from transformers import Emu3ImageProcessor

    from mmtrain.emu3.generation import ImagePrompt
    from mmtrain.generation.sampling import SamplingParams

    hf_dir, model = emu3_hf
    prompts = [
        ImagePrompt("a red bus parked next to a tall building", 32, 40, negative="lowres, bad anatomy", seed=1),
        ImagePrompt("a cat", 24, 32, negative="blurry", cfg_scale=2.5, seed=2),
    ]
    ours = emu3_gen.generate(prompts, SamplingParams(), batch_size=2)
    processor = Emu3ImageProcessor.from_pretrained(hf_dir)
    for p, got in zip(prompts, ours):
        req = emu3_gen.request(p)
        rows, cols = p.height // 8, p.width // 8
        ref = hf_emu3_generate(model, req.prompt, req.negative_prompt, rows, cols, p.cfg_scale)
        assert got.tokens == ref.tolist()
        assert got.grid.shape == (rows, cols) and len(set(got.grid.ravel().tolist())) > 1
        with torch.no_grad():
            pixels = model.model.decode_image_tokens(image_tokens=ref[None], height=rows, width=cols)
        hf_image = processor.postprocess(list(pixels.float()), return_tensors="PIL.Image.Image")["pixel_values"][0]
        assert got.image.size == (p.width, p.height)
        assert np.array_equal(np.asarray(got.image), np.asarray(hf_image))


@pytest.mark.unit
def test_emu3_prompt_is_transformers_processor_prompt(emu3_hf, emu3_gen):
    from transformers import AutoTokenizer, Emu3ImageProcessor, Emu3Processor

    from mmtrain.emu3.generation import ImagePrompt

    hf_dir, _ = emu3_hf
    proc = Emu3Processor(
        Emu3ImageProcessor.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(hf_dir), chat_template=None
    )
    ref = proc(text=["a red bus"], return_for_image_generation=True, image_area=64 * 48, return_tensors="np")
    h, w = (int(x) for x in ref["image_sizes"][0])
    ours = emu3_gen.request(ImagePrompt("a red bus", h * 8, w * 8)).prompt
    assert ours.tolist() == ref["input_ids"][0].tolist()


# ----------------------------------------------------------------------------- guidance and structure


@pytest.mark.unit
def test_guidance_scale_one_is_plain_and_zero_is_the_negative_prompt_alone(emu3_gen):
    from dataclasses import replace

    from mmtrain.emu3.generation import ImagePrompt
    from mmtrain.generation.sampling import SamplingParams, guided_logprobs

    c, u = torch.randn(3, 50).log_softmax(-1), torch.randn(3, 50).log_softmax(-1)
    assert torch.allclose(guided_logprobs(c, u, 1.0), c) and torch.equal(guided_logprobs(c, u, 0.0), u)
    assert torch.allclose(guided_logprobs(c, u, torch.tensor([3.0, 3.0, 3.0])), u + 3 * (c - u))

    sampling = SamplingParams(temperature=1.0, top_k=100)
    base = ImagePrompt("a red bus parked next to a tall building", 32, 32, negative="lowres, blurry", seed=7)
    plain = emu3_gen.generate([replace(base, negative="", cfg_scale=1.0)], sampling)[0].tokens
    scale1 = emu3_gen.generate([replace(base, cfg_scale=1.0)], sampling)[0].tokens
    assert scale1 == plain  # scale 1 runs no unconditional row at all
    scale0 = emu3_gen.generate([replace(base, cfg_scale=0.0)], sampling)[0].tokens
    negative_alone = emu3_gen.generate([replace(base, text="lowres, blurry", negative="", cfg_scale=1.0)], sampling)[0]
    assert scale0 == negative_alone.tokens
    guided = emu3_gen.generate([replace(base, cfg_scale=3.0)], sampling)[0].tokens
    assert guided != plain and guided != scale0


@pytest.mark.unit
def test_guided_rows_share_one_forward_per_step_and_progress_counts_tokens(emu3_gen, monkeypatch):
    """Two guided prompts of different sizes and one unguided: one prefill, then per step ONE
    decoder call holding every active request's conditional row and its unconditional row
    (transformers runs a second forward for the unconditional pass); finished requests' rows
    leave the batch; progress reaches the number of generated tokens."""
    from mmtrain.emu3.generation import ImagePrompt
    from mmtrain.generation.decoder import CachedDecoder
    from mmtrain.generation.sampling import SamplingParams

    calls: list[tuple[str, int]] = []
    prefill, step = CachedDecoder.prefill, CachedDecoder.step
    monkeypatch.setattr(
        CachedDecoder,
        "prefill",
        lambda self, prompts, n: calls.append(("prefill", len(prompts))) or prefill(self, prompts, n),
    )
    monkeypatch.setattr(
        CachedDecoder, "step", lambda self, tokens: calls.append(("step", len(tokens))) or step(self, tokens)
    )
    ticks: list[tuple[int, int]] = []
    prompts = [
        ImagePrompt("a red bus", 8, 16, negative="bad", seed=1),
        ImagePrompt("a cat", 16, 16, seed=2),
        ImagePrompt("a dog", 8, 8, cfg_scale=1.0, seed=3),
    ]
    out = emu3_gen.generate(
        prompts, SamplingParams(temperature=1.0), batch_size=3, progress=lambda done, total: ticks.append((done, total))
    )
    lengths = [len(o.tokens) for o in out]
    assert lengths == [(1 + 2) * 1 + 3, (2 + 1) * 2 + 3, (1 + 1) * 1 + 3]  # (cols + 1) * rows + 3
    assert calls[0] == ("prefill", 5) and [c[0] for c in calls[1:]] == ["step"] * (max(lengths) - 1)
    # rows per step: 3 conditional + 2 unconditional while all run, fewer as requests finish
    expected = [
        sum((2 if p.cfg_scale != 1.0 else 1) for p, n in zip(prompts, lengths) if n > t) for t in range(1, max(lengths))
    ]
    assert [c[1] for c in calls[1:]] == expected
    assert ticks[-1] == (sum(lengths), sum(lengths)) and [d for d, _ in ticks] == sorted(d for d, _ in ticks)


@pytest.mark.unit
def test_structure_holds_for_random_weights_and_many_seeds(emu3_gen):
    """Hot sampling over the whole vocabulary, 24 seeds, widths down to 1: always a decodable grid."""
    from mmtrain.emu3.generation import ImagePrompt, grid_from_tokens
    from mmtrain.generation.sampling import SamplingParams

    vocab = emu3_gen.vocab
    sizes = [(8, 8), (8, 16), (16, 8), (24, 16), (8, 24), (16, 16)]
    prompts = [
        ImagePrompt(
            f"picture {i}",
            *sizes[i % len(sizes)],
            negative="bad" if i % 2 else "",
            cfg_scale=(1.0, 3.0, 0.0, 7.5)[i % 4],
            seed=100 + i,
        )
        for i in range(24)
    ]
    out = emu3_gen.generate(prompts, SamplingParams(temperature=3.0), batch_size=12)
    visual = set(vocab.visual.tolist())
    for p, img in zip(prompts, out):
        rows, cols = p.height // 8, p.width // 8
        assert len(img.tokens) == (cols + 1) * rows + 3
        assert img.tokens[-3:] == [vocab.eof, vocab.eoi, vocab.eos]
        body = np.asarray(img.tokens[: (cols + 1) * rows]).reshape(rows, cols + 1)
        assert (body[:, -1] == vocab.eol).all() and set(body[:, :-1].ravel().tolist()) <= visual
        assert np.array_equal(grid_from_tokens(img.tokens, rows, cols, vocab), img.grid)
        assert img.image.size == (p.width, p.height)
    assert len({tuple(i.tokens) for i in out}) == len(out)  # seeds differ
    with pytest.raises(ValueError):
        grid_from_tokens(out[0].tokens[:-1], 1, 1, vocab)


@pytest.mark.unit
def test_emu3_batched_equals_one_by_one_and_seeds_are_deterministic(emu3_gen):
    """Different prompt lengths and image sizes (so requests finish at different steps and their
    rows leave the batch), sampled: each request's tokens depend on its own seed only."""
    from mmtrain.emu3.generation import ImagePrompt
    from mmtrain.generation.sampling import SamplingParams

    sampling = SamplingParams(temperature=1.0, top_k=64, top_p=0.9)
    prompts = [
        ImagePrompt("a", 16, 16, negative="bad, lowres, ugly", seed=3),
        ImagePrompt("a long caption of a red bus parked next to a building on a sunny day", 32, 24, seed=4),
        ImagePrompt("a cat on a table", 24, 32, negative="", cfg_scale=1.0, seed=5),
    ]
    batched = emu3_gen.generate(prompts, sampling, batch_size=3)
    for p, b in zip(prompts, batched):
        assert emu3_gen.generate([p], sampling)[0].tokens == b.tokens
    again = emu3_gen.generate(prompts[:1], sampling)
    assert again[0].tokens == batched[0].tokens


# ----------------------------------------------------------------------------- llava-ov


@pytest.mark.unit
def test_llava_greedy_matches_transformers(llava_hf, llava_chat):
    """The checkpoint's chat template + anyres layout give the HF processor's ids; batched greedy
    answers (with an image, and text only) are transformers' `generate` tokens."""
    from mmtrain.generation.sampling import SamplingParams

    _, model, tok = llava_hf
    processor = hf_llava_processor(tok)
    questions = [("What is shown in this picture?", images()[0]), ("Say hi.", None), ("Describe it.", images()[1])]
    prompts = [llava_chat.prompt(q, im) for q, im in questions]
    ours = llava_chat.generate(prompts, SamplingParams(), max_new_tokens=12, batch_size=3)
    for (q, im), p, got in zip(questions, prompts, ours):
        text = tok.apply_chat_template(
            [{"role": "user", "content": ("<image>\n" if im else "") + q}], tokenize=False, add_generation_prompt=True
        )
        inputs = processor(images=[im], text=[text], return_tensors="pt") if im else tok([text], return_tensors="pt")
        assert p.input_ids.tolist() == inputs["input_ids"][0].tolist()
        assert got.tokens == hf_greedy_answer(model, inputs, tok, max_new_tokens=12)
    assert len(set(ours[0].tokens)) > 3


@pytest.mark.unit
def test_llava_processor_template_and_stop_tokens(llava_chat):
    """A llava-hf processor template (list content) renders the image part in its own place;
    generation stops at the tokenizer's end-of-turn token, which is not part of the answer."""
    from mmtrain.generation.engine import GenerationResult

    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    own = llava_chat.template
    try:
        llava_chat.template = template
        assert llava_chat.render("Hi?", True) == "<|im_start|>user\n<image>\nHi?<|im_end|>\n<|im_start|>assistant\n"
    finally:
        llava_chat.template = own
    assert llava_chat.render("Hi?", False, system="Be brief.").startswith("<|im_start|>system\nBe brief.<|im_end|>")
    eos = llava_chat.tokenizer.eos_token_id
    assert eos in llava_chat.stop_token_ids
    hi = llava_chat.tokenizer.encode("hi", add_special_tokens=False)
    assert llava_chat.answer(GenerationResult(hi + [eos], "stop_token")) == "hi"


@pytest.mark.unit
def test_direct_decode_step_equals_megatron_modules(emu3_gen, llava_chat):
    """The decode step on the layers' weights = megatron's modules (untied Emu3; tied Qwen2 with
    qkv bias), step by step, with rows of different lengths."""
    from mmtrain.generation.decoder import CachedDecoder

    for model in (emu3_gen.model, llava_chat.model):
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 500, (n,), generator=g) for n in (5, 9)]
        logits = []
        for direct in (False, True):
            dec = CachedDecoder(model.decoder, model.vocab_size, direct=direct)
            steps = [dec.prefill([dec.embed(p) for p in prompts], 8)]
            for t in range(6):
                steps.append(dec.step(torch.tensor([t + 7, 3 * t + 1])))
            logits.append(torch.stack(steps))
        assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=1e-5)


@pytest.mark.unit
def test_top_k_top_p_are_transformers_warpers_and_sampling_is_seeded():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from mmtrain.generation.sampling import SamplingParams, filter_top_k_top_p, sample_next

    scores = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    ref = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(40)(None, scores.clone()))
    assert torch.equal(filter_top_k_top_p(scores, 40, 0.8), ref)
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.8)
    draws = [sample_next(scores, params, [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert bool(torch.isfinite(ref.gather(1, draws[0][:, None])).all())  # only kept tokens are drawn
    assert torch.equal(sample_next(scores, SamplingParams(), []), scores.argmax(-1))
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


@pytest.mark.unit
def test_engine_names_no_family():
    """The shared engine, the generate command and the training entry are family-neutral:
    families plug in through the registry (FamilySpec.generation), help texts included."""
    mmtrain_dir = Path(__file__).resolve().parents[1] / "mmtrain"
    files = sorted((mmtrain_dir / "generation").glob("*.py"))
    files += [
        mmtrain_dir / "cli.py",
        mmtrain_dir / "actions.py",
        mmtrain_dir / "generate_cli.py",
        mmtrain_dir / "generate_command.py",
    ]
    files += [
        mmtrain_dir / "runtime" / f
        for f in ("launcher.py", "worker.py", "training.py", "torchrun.py", "run_dir.py", "logs.py")
    ]
    assert len(files) > 11
    for f in files:
        text = f.read_text().lower()
        assert "emu3" not in text and "llava" not in text, f


# ----------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def emu3_mcore(emu3_hf, tmp_path_factory):
    from tests.fixtures_convert import convert_cli as convert

    dst = tmp_path_factory.mktemp("gen_emu3_ckpt") / "ckpt"
    assert convert("hf-to-mcore", "--model", "emu3", "--src", str(emu3_hf[0]), "--dst", str(dst)) == 0
    return dst


def test_cli_emu3_batch_writes_pngs_and_grids(emu3_mcore, emu3_gen, tmp_path, capsys):
    """From the converted megatron checkpoint (its kept tokenizer and VQ): one PNG per prompt and
    the token grids, equal to the library's output for the same seeds."""
    from PIL import Image

    from mmtrain.emu3.generation import ImagePrompt
    from mmtrain.generation.sampling import SamplingParams

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "a red bus", "height": 16, "width": 24})
        + "\n\n"
        + json.dumps({"prompt": "a cat", "negative_prompt": "ugly", "seed": 11})
        + "\n"
    )
    out = tmp_path / "imgs"
    assert (
        _cli(
            "emu3",
            "--checkpoint",
            str(emu3_mcore),
            "--prompts",
            str(prompts),
            "--output",
            str(out),
            "--height",
            "24",
            "--width",
            "24",
            "--seed",
            "5",
            "--top-k",
            "50",
            "--no-progress",
        )
        == 0
    )
    assert "wrote 2 images" in capsys.readouterr().out
    lines = [json.loads(x) for x in (out / "images.jsonl").read_text().splitlines()]
    expected = emu3_gen.generate(
        [ImagePrompt("a red bus", 16, 24, seed=5), ImagePrompt("a cat", 24, 24, "ugly", seed=11)],
        SamplingParams(temperature=1.0, top_k=50),
    )
    for line, exp in zip(lines, expected):
        assert np.array_equal(np.asarray(line["grid"]), exp.grid)
        assert np.array_equal(np.asarray(Image.open(out / line["png"])), np.asarray(exp.image))
    assert [line["seed"] for line in lines] == [5, 11] and lines[0]["cfg_scale"] == 3.0


def test_cli_llava_answers_from_hf_and_megatron_checkpoints(llava_hf, llava_chat, tmp_path, capsys, monkeypatch):
    import warnings

    from mmtrain.generation.sampling import SamplingParams
    from mmtrain.runtime.logs import THIRD_PARTY_WARNINGS

    monkeypatch.setenv("TQDM_DISABLE", "1")  # (restored after the test, as the command sets it)

    image = tmp_path / "img.png"
    images()[0].save(image)
    assert (
        _cli(
            "llava-ov",
            "--checkpoint",
            str(llava_hf[0]),
            "--image",
            str(image),
            "--prompt",
            "What is this?",
            "--max-new-tokens",
            "8",
            "--no-progress",
        )
        == 0
    )
    printed = capsys.readouterr().out
    quieted = [
        f for f in warnings.filters if f[0] == "ignore" and f[3] is not None and f[3].pattern == THIRD_PARTY_WARNINGS
    ]
    assert quieted, "without --verbose, generate hides third-party warnings"
    from PIL import Image

    expected = llava_chat.generate(
        [llava_chat.prompt("What is this?", Image.open(image))], SamplingParams(), max_new_tokens=8
    )[0]
    assert printed == llava_chat.answer(expected) + "\n"
    # its megatron conversion (tokenizer kept in hf_assets/), --prompts: an image relative to the
    # file, a text-only line with its own seed; JSONL answers
    from tests.fixtures_convert import convert_cli as convert

    assert (
        convert("hf-to-mcore", "--model", "llava-ov", "--src", str(llava_hf[0]), "--dst", str(tmp_path / "ckpt")) == 0
    )
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"prompt": "What is this?", "image": "img.png"})
        + "\n"
        + json.dumps({"prompt": "Say hi.", "seed": 3})
        + "\n"
    )
    out = tmp_path / "answers.jsonl"
    assert (
        _cli(
            "llava-ov",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--prompts",
            str(questions),
            "--output",
            str(out),
            "--max-new-tokens",
            "8",
            "--no-progress",
        )
        == 0
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["answer"] == llava_chat.answer(expected) and lines[0]["image"] == "img.png"
    assert (
        lines[1]["seed"] == 3
        and lines[1]["tokens"]
        == llava_chat.generate([llava_chat.prompt("Say hi.")], SamplingParams(), max_new_tokens=8)[0].tokens
    )


def test_cli_errors_are_one_line_exit_2(emu3_hf, emu3_mcore, llava_hf, tmp_path, capsys):
    def err(*argv: str) -> str:
        assert _cli(*argv, "--no-progress") == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"mmtrain generate {argv[0]}: error: "), lines
        return lines[0]

    assert "family 'llava-ov' (use `mmtrain generate llava-ov`)" in err(
        "emu3", "--checkpoint", str(llava_hf[0]), "--prompt", "x"
    )
    assert "family 'emu3', not 'llava-ov'" in err("llava-ov", "--checkpoint", str(emu3_mcore), "--prompt", "x")
    no_vq = tmp_path / "no_vq"
    shutil.copytree(emu3_mcore, no_vq, ignore=shutil.ignore_patterns("vq"))
    assert "keeps no VQ model" in err("emu3", "--checkpoint", str(no_vq), "--prompt", "x")
    assert "--vq" in err("emu3", "--checkpoint", str(emu3_mcore), "--prompt", "x", "--vq", str(tmp_path))
    bare = tmp_path / "bare"
    shutil.copytree(emu3_mcore, bare, ignore=shutil.ignore_patterns("hf_assets"))
    assert "give --tokenizer DIR" in err("emu3", "--checkpoint", str(bare), "--prompt", "x", "--vq", str(emu3_hf[0]))
    assert (
        "multiples of the VQ's spatial factor 8; the nearest sizes that fit: --height 16 --width 512 or "
        "--height 24 --width 512"
    ) in err("emu3", "--checkpoint", str(emu3_hf[0]), "--prompt", "x", "--height", "20")
    too_big = err("emu3", "--checkpoint", str(emu3_hf[0]), "--prompt", "x", "--height", "4096", "--width", "2048")
    fit = re.search(
        r"needs \d+ positions, the model has (\d+); the largest size of this aspect ratio that fits: "
        r"--height (\d+) --width (\d+)$",
        too_big,
    )
    assert fit, too_big
    h, w = int(fit[2]), int(fit[3])
    assert h % 8 == 0 and w % 8 == 0 and abs(h / w - 2) < 0.2, too_big
    assert "no such directory" in err("emu3", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x")
    assert "top_p" in err("emu3", "--checkpoint", str(emu3_hf[0]), "--prompt", "x", "--top-p", "0")
    # --output that cannot be written: refused before the model loads, nothing written
    afile = tmp_path / "afile"
    afile.write_text("mine")
    emu3 = ("emu3", "--checkpoint", str(emu3_hf[0]))
    assert f"--output {tmp_path} is a directory" in err(*emu3, "--prompt", "x", "--output", str(tmp_path))
    assert "unknown extension '.txt'; e.g. .png" in err(*emu3, "--prompt", "x", "--output", str(tmp_path / "a.txt"))
    assert f"{afile} is a file, not a folder" in err(*emu3, "--prompt", "x", "--output", str(afile / "x.png"))
    one = tmp_path / "one.txt"
    one.write_text("a cat\n")
    assert f"--output {afile} is a file" in err(*emu3, "--prompts", str(one), "--output", str(afile))
    llava = ("llava-ov", "--checkpoint", str(llava_hf[0]))
    assert "--output goes with --prompts" in err(*llava, "--prompt", "x", "--output", str(tmp_path / "a.jsonl"))
    assert "is a directory" in err(*llava, "--prompts", str(one), "--output", str(tmp_path))
    assert afile.read_text() == "mine" and not (tmp_path / "a.txt").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "colour": 1}\n')
    assert "bad.jsonl:1: unknown keys ['colour']" in err("emu3", "--checkpoint", str(emu3_hf[0]), "--prompts", str(bad))


@pytest.mark.unit
def test_output_of_the_users_files_is_refused_unless_overwrite(emu3_hf, llava_hf, tmp_path, capsys):
    """issue 45: an existing --output file or a non-empty --output folder is refused (exit 2, one
    line, before the model loads, nothing written) unless --overwrite, which replaces it whole."""

    def err(*argv: str) -> str:
        assert _cli(*argv, "--no-progress") == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "000000.png").write_bytes(b"the user's picture")
    one = tmp_path / "one.txt"
    one.write_text("a cat\n")
    png, answers = tmp_path / "cat.png", tmp_path / "answers.jsonl"
    png.write_bytes(b"the user's cat")
    answers.write_text("the user's answers\n")
    emu3 = ("emu3", "--checkpoint", str(emu3_hf[0]), "--height", "16", "--width", "16", "--top-k", "8")
    assert (
        f"--output {mine} is not empty (1 entry, e.g. '000000.png'); choose an empty or new folder, or pass --overwrite"
    ) in err(*emu3, "--prompts", str(one), "--output", str(mine))
    assert f"--output {png} exists; choose a new file name, or pass --overwrite" in err(
        *emu3, "--prompt", "a cat", "--output", str(png)
    )
    assert f"--output {answers} exists" in err(
        "llava-ov", "--checkpoint", str(llava_hf[0]), "--prompts", str(one), "--output", str(answers)
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl", "cat.png", "mine", "one.txt"]
    assert (mine / "000000.png").read_bytes() == b"the user's picture" and png.read_bytes() == b"the user's cat"
    assert answers.read_text() == "the user's answers\n"
    # --overwrite: the file replaced, the folder replaced whole (no user file left next to new ones)
    assert _cli(*emu3, "--prompt", "a cat", "--output", str(png), "--overwrite", "--no-progress") == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert _cli(*emu3, "--prompts", str(one), "--output", str(mine), "--overwrite", "--no-progress") == 0
    assert sorted(p.name for p in mine.iterdir()) == ["000000.png", "images.jsonl"]
    assert (mine / "000000.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl", "cat.png", "mine", "one.txt"]


# ----------------------------------------------------------------------------- any TP/PP


@pytest.mark.slow  # converting to TP=2 x PP=2 starts 4 processes (~60 s on 2 cores)
def test_tp2_pp2_checkpoint_generates_the_tokens_of_its_tp1_conversion(emu3_hf, emu3_mcore, tmp_path):
    """A checkpoint written at TP=2 x PP=2 (4 ranks) loads resharded into the one generation
    process and gives the TP=1 conversion's tokens (guided, sampled) and image."""
    from mmtrain.emu3.generation import Emu3ImageGenerator, ImagePrompt
    from mmtrain.generation.checkpoint import Placement, resolve_checkpoint
    from mmtrain.generation.sampling import SamplingParams
    from tests.fixtures_convert import convert_cli as convert

    tp2 = tmp_path / "tp2pp2"
    assert (
        convert("hf-to-mcore", "--model", "emu3", "--src", str(emu3_hf[0]), "--dst", str(tp2), "--tp", "2", "--pp", "2")
        == 0
    )
    prompts = [ImagePrompt("a red bus", 24, 24, negative="lowres", seed=9), ImagePrompt("a cat", 16, 32, seed=10)]
    outs = []
    for ckpt in (emu3_mcore, tp2):
        ref = resolve_checkpoint(ckpt, "emu3")
        gen = Emu3ImageGenerator(ref, Placement.resolve("cpu"), tokenizer_dir=ref.assets, vq_dir=ref.assets / "vq")
        outs.append(gen.generate(prompts, SamplingParams(temperature=1.0, top_k=100)))
    for a, b in zip(*outs):
        assert a.tokens == b.tokens and np.array_equal(np.asarray(a.image), np.asarray(b.image))


@pytest.mark.unit
def test_grouped_decode_attention_is_sdpa():
    """The CUDA decode attention (grouped heads read in place) = SDPA with enable_gqa, masked."""
    import torch.nn.functional as F

    from mmtrain.generation.decoder import grouped_decode_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(3, 8, 1, 16, generator=g),
        torch.randn(3, 2, 11, 16, generator=g),
        torch.randn(3, 2, 11, 16, generator=g),
    )
    mask = torch.arange(11)[None] >= torch.tensor([0, 4, 7])[:, None]
    for m in (None, mask[:, None, None]):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True)
        assert torch.allclose(grouped_decode_attention(q, k, v, m, 0.3), ref, atol=1e-6)


def test_checkpoint_resolution(emu3_hf, emu3_mcore, tmp_path):
    """A training run dir resolves to its checkpoints/; HF dirs keep their own assets; a converted
    checkpoint its hf_assets/; a bare one none."""
    from mmtrain.generation.checkpoint import GenerationError, asset_dir, resolve_checkpoint

    run = tmp_path / "run"
    shutil.copytree(emu3_mcore, run / "checkpoints", ignore=shutil.ignore_patterns("hf_assets"))
    ref = resolve_checkpoint(run, "emu3")
    assert ref.path == run / "checkpoints" and not ref.is_hf and ref.assets is None
    with pytest.raises(GenerationError, match="give --tokenizer DIR"):
        asset_dir(ref, None, "tokenizer", "tokenizer")
    assert asset_dir(ref, str(emu3_hf[0]), "tokenizer", "tokenizer") == emu3_hf[0]
    assert resolve_checkpoint(emu3_mcore, "emu3").assets == emu3_mcore / "hf_assets"
    hf = resolve_checkpoint(emu3_hf[0], "emu3")
    assert hf.is_hf and hf.assets == emu3_hf[0]
    with pytest.raises(GenerationError, match="neither a megatron checkpoint"):
        resolve_checkpoint(tmp_path, "emu3")


@pytest.mark.unit
def test_largest_fitting_grid_keeps_the_aspect_ratio_and_fits():
    from mmtrain.emu3.generation import largest_fitting_grid

    def positions(r: int, c: int) -> int:  # Emu3's layout: a prompt, then rows of codes + end-of-line
        return 20 + r * (c + 1) + 3

    r, c = largest_fitting_grid(64, 32, positions, 1000)
    assert positions(r, c) <= 1000 < positions(r + 1, round(32 * (r + 1) / 64))
    assert abs(r / c - 2) < 0.1
    assert largest_fitting_grid(64, 32, positions, 10) is None
