"""The LLaVA-OV HF export used the way transformers' users use it (issue 45): `AutoProcessor`, the
processor's chat template on typed message parts, `processor(images=..., text=...)` and
`generate`, against `mmtrain generate llava-ov` on the same checkpoint and image.

The checkpoint is made as a training run leaves it: its `hf_assets/` holds the run's tokenizer as
`save_pretrained` writes it, with the tokenizer's own (Qwen2, string-content) `chat_template.jinja`.
"""

from __future__ import annotations

import json

import pytest
import torch

torch.set_num_threads(1)

from tests.llava_tiny import export_processor, has_torchvision, images  # noqa: E402

QUESTION = "What is shown in this picture?"
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def _cli(*argv: str) -> int:
    from mmtrain.cli import main

    return main(list(argv))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, llava_hf):
    """(megatron checkpoint, its HF export, the HF source model, the tokenizer)."""
    src, model, tok = llava_hf
    root = tmp_path_factory.mktemp("llava_export")
    ckpt, out = root / "ckpt", root / "export"
    assert _cli("convert", "hf-to-mcore", "--model", "llava-ov", "--src", str(src), "--dst", str(ckpt)) == 0
    tok.save_pretrained(ckpt / "hf_assets")  # what training's keep_tokenizer writes there
    assert (ckpt / "hf_assets" / "chat_template.jinja").is_file()
    assert _cli("convert", "mcore-to-hf", "--model", "llava-ov", "--src", str(ckpt), "--dst", str(out)) == 0
    return ckpt, out, model, tok


def test_exported_template_takes_typed_parts_and_strings(exported):
    """The run's recorded template fails on list content; the export's renders image / video parts
    as LLaVA-OneVision's processor template does (media placeholders, then the text) and strings
    as the tokenizer's own template did."""
    from transformers import AutoTokenizer

    from mmtrain.llava_ov.conversion import renders_media_parts

    ckpt, out, _, tok = exported
    recorded = (ckpt / "hf_assets" / "chat_template.jinja").read_text()
    assert not renders_media_parts(tok, recorded)  # the case of issue 45: str + list in Jinja
    exported_tok = AutoTokenizer.from_pretrained(out)
    template = (out / "chat_template.jinja").read_text()
    assert renders_media_parts(exported_tok, template)

    def render(content, t):
        return exported_tok.apply_chat_template(
            [{"role": "user", "content": content}], chat_template=t, tokenize=False, add_generation_prompt=True
        )

    typed = render([{"type": "image"}, {"type": "text", "text": QUESTION}], template)
    assert typed == f"{SYSTEM}<|im_start|>user\n<image>\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert render(f"<image>\n{QUESTION}", template) == typed == render(f"<image>\n{QUESTION}", recorded)
    assert render([{"type": "video"}, {"type": "text", "text": "Hi"}], template).endswith(
        "<|im_start|>user\n<video>\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_auto_processor_loads_the_export_or_names_torchvision(exported):
    """transformers' own AutoProcessor: where torchvision is installed it loads the export with its
    video processor; where not (this project's CPU venv: docs/conversion.md) it fails naming
    torchvision, the one thing the export's processor needs beyond the venv."""
    from transformers import AutoProcessor, LlavaOnevisionProcessor

    _, out, _, _ = exported
    if has_torchvision():
        proc = AutoProcessor.from_pretrained(out)
        assert isinstance(proc, LlavaOnevisionProcessor) and proc.video_processor is not None
        assert proc.chat_template == (out / "chat_template.jinja").read_text()
        return
    with pytest.raises(Exception) as err:
        AutoProcessor.from_pretrained(out)
    assert "torchvision" in str(err.value).lower()


def test_processor_and_generate_match_mmtrain_generate(exported, tmp_path):
    """apply_chat_template (typed parts) + processor(images, text) + transformers' generate on the
    export give the tokens `mmtrain generate llava-ov` gives on the megatron checkpoint."""
    from transformers import LlavaOnevisionForConditionalGeneration

    ckpt, out, _, tok = exported
    processor = export_processor(out)
    image = images()[0]
    image.save(tmp_path / "img.png")
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True,
    )
    inputs = processor(images=[image], text=[text], return_tensors="pt")
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        ref = hf.generate(
            **inputs, max_new_tokens=10, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )[0, inputs["input_ids"].shape[1] :].tolist()
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"prompt": QUESTION, "image": "img.png"}) + "\n")
    answers = tmp_path / "answers.jsonl"
    assert (
        _cli(
            "generate",
            "llava-ov",
            "--checkpoint",
            str(ckpt),
            "--prompts",
            str(questions),
            "--output",
            str(answers),
            "--greedy",
            "--max-new-tokens",
            "10",
            "--no-progress",
        )
        == 0
    )
    ours = json.loads(answers.read_text().splitlines()[0])["tokens"]
    assert ours == ref and len(set(ref)) > 2
