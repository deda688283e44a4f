"""The tiny Emu3-layout tokenizer and Emu3's token serialisation: ids equal transformers'
Emu3Processor output after Emu3's own image-token substitution, and the HF model computes the
same logits from our ids as from its processor inputs."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from mmdata.energon_loaders.emu3 import serialize as es
from tests.emu3_tiny import TEST_IMAGE_AREA, encode_image, tiny_hf_emu3


@pytest.fixture(scope="module")
def tok(emu3_tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(emu3_tok_dir)


def test_tiny_emu3_tokenizer_has_emu3_layout_and_roles(tmp_path, tok, emu3_tok_dir):
    from transformers import Emu3ImageProcessor, Emu3Processor

    from mmdata.cli import main

    ids = tok.convert_tokens_to_ids
    first = ids(es.ENDOFTEXT)
    # the real vocabulary's order after the BPE merges (151643 + offset in Emu3's)
    expected = (
        [es.ENDOFTEXT, "<|im_start|>", "<|im_end|>", es.IMAGE_PLACEHOLDER]
        + [f"<|extra_{i}|>" for i in range(1, 205)]
        + [es.IMG, es.BOI, es.EOI]
        + [es.visual_token(i) for i in range(512)]
    )
    assert [ids(t) for t in expected] == list(range(first, first + len(expected))) and len(tok) == first + len(expected)
    assert first == max(i for t, i in tok.get_vocab().items() if t not in set(expected)) + 1  # specials after BPE
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (es.BOS, es.EOS, es.ENDOFTEXT)
    vocab = es.Emu3Vocab.from_tokenizer(tok)
    assert (vocab.bos, vocab.eos, vocab.eol, vocab.eof) == (first + 206, first + 207, first + 203, first + 204)
    assert vocab.codebook_size == 512 and list(vocab.visual[:2]) == [first + 211, first + 212]
    proc = Emu3Processor(image_processor=Emu3ImageProcessor(), tokenizer=tok)  # reads the named tokens
    assert (proc.image_token_id, proc.image_start_token, proc.fake_token_around_image) == (
        vocab.placeholder,
        es.BOI,
        es.IMG,
    )
    assert tok.convert_ids_to_tokens(tok.encode("64*64", add_special_tokens=False)) == ["6", "4", "*", "6", "4"]
    # deterministic, and the CLI writes the same files
    assert main(["tiny-tokenizer", "--family", "emu3", "--output", str(tmp_path / "cli")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (emu3_tok_dir / name).read_bytes()
    assert main(["tiny-tokenizer", "--output", str(tmp_path / "q"), "--codebook-size", "8"]) == 2


def test_serialize_matches_hf_processor_and_model(tok, tiny_vq_dir):
    import torch
    from transformers import Emu3ImageProcessor, Emu3Processor

    from mmdata.vision_tokens.vq import VisionTokenizer

    rng = np.random.default_rng(3)
    proc = Emu3Processor(
        image_processor=Emu3ImageProcessor.from_pretrained(
            tiny_vq_dir, min_pixels=TEST_IMAGE_AREA, max_pixels=TEST_IMAGE_AREA
        ),
        tokenizer=tok,
    )
    model = tiny_hf_emu3(tok, tiny_vq_dir)
    ours = VisionTokenizer(tiny_vq_dir, TEST_IMAGE_AREA)
    vocab, encode = es.Emu3Vocab.from_tokenizer(tok), es.hf_text_encoder(tok)
    img = lambda w, h, mode="RGB": Image.open(io.BytesIO(encode_image(rng, w, h, mode)))  # noqa: E731
    cases = [
        ("You are a helpful assistant. USER: <image>What is shown here? ASSISTANT:", [img(101, 61)]),
        ("USER: Compare <image> and <image>, please. ASSISTANT: The first one.", [img(50, 90, "RGBA"), img(50, 90)]),
        ("<image>", [img(37, 203, "L")]),
        ("A caption with digits 12*34 and no image.", []),
    ]
    for text, images in cases:
        grids = [ours.encode([ours.preprocess(im)])[0] for im in images]
        got = es.serialize(text, grids, vocab, encode)
        inputs = proc(images=images or None, text=text, return_tensors="pt")
        ref = inputs["input_ids"][0].clone()
        if images:  # Emu3Model's substitution of the <image> placeholders by BPE visual ids + eol
            with torch.no_grad():
                bpe = model.model.get_image_tokens(inputs["pixel_values"], inputs["image_sizes"])
            mask = ref == model.model.vocabulary_mapping.image_token_id
            assert int(mask.sum()) == len(bpe)
            ref[mask] = bpe.to(ref.dtype)
        assert got.tolist() == ref.tolist(), text
        assert got[0] == vocab.bos and (got == vocab.eoi).sum() == len(images)
        if images:  # the model's own forward on its inputs equals a forward on our ids
            with torch.no_grad():
                hf = model(**inputs).logits
                mine = model(input_ids=torch.from_numpy(got)[None]).logits
            torch.testing.assert_close(mine, hf, rtol=0, atol=1e-6)


def test_serialize_layout_and_errors(tok):
    vocab, encode = es.Emu3Vocab.from_tokenizer(tok), es.hf_text_encoder(tok)
    grid = np.arange(6, dtype=np.uint16).reshape(2, 3)
    ids = es.image_ids(grid, vocab, encode)
    size = encode("2*3")
    body = ids[2 + len(size) : -2]
    assert ids[0] == vocab.boi and list(ids[1 : 1 + len(size)]) == list(size) and ids[1 + len(size)] == vocab.img
    assert body.reshape(2, 4)[:, 3].tolist() == [vocab.eol, vocab.eol]
    assert body.reshape(2, 4)[:, :3].tolist() == vocab.visual[grid.astype(np.int64)].tolist()
    assert ids[-2:].tolist() == [vocab.eof, vocab.eoi]
    with pytest.raises(ValueError, match="placeholders"):
        es.serialize("<image><image>", [grid], vocab, encode)
    with pytest.raises(ValueError, match="outside"):
        es.image_ids(np.full((1, 1), 512, dtype=np.uint16), vocab, encode)

    class NotEmu3:
        bos_token = "<s>"

        def get_vocab(self):
            return {"<s>": 0, "a": 1}

    with pytest.raises(ValueError, match="not an Emu3 tokenizer"):
        es.Emu3Vocab.from_tokenizer(NotEmu3())
    assert json.loads(json.dumps(vocab.codebook_size)) == 512


def test_vq_reads_whole_emu3_checkpoint_and_refuses_pickles(tmp_path, tok, tiny_vq_dir):
    """--vision-tokenizer may be a whole transformers Emu3 checkpoint: its VQ tensors give the same
    model (same fingerprint, same codes) as the VQ-only dir; pickled weights are refused."""
    import shutil

    import torch

    from mmdata.vision_tokens.vq import VisionTokenizer, VQError, read_vq_checkpoint

    full = tmp_path / "emu3"
    tiny_hf_emu3(tok, tiny_vq_dir).save_pretrained(full)
    shutil.copy(tiny_vq_dir / "preprocessor_config.json", full)
    ckpt = read_vq_checkpoint(full)
    assert ckpt.layout == "emu3" and ckpt.fingerprint() == read_vq_checkpoint(tiny_vq_dir).fingerprint()
    img = Image.open(io.BytesIO(encode_image(np.random.default_rng(0), 77, 50)))
    a, b = VisionTokenizer(full, TEST_IMAGE_AREA), VisionTokenizer(tiny_vq_dir, TEST_IMAGE_AREA)
    assert np.array_equal(a.encode([a.preprocess(img)])[0], b.encode([b.preprocess(img)])[0])
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(tiny_vq_dir / name, pickled)
    torch.save({}, pickled / "pytorch_model.bin")
    with pytest.raises(VQError, match="pickled weights are not loaded"):
        read_vq_checkpoint(pickled)
