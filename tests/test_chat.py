"""Chat template rendering, media expansion and the loss mask."""

from __future__ import annotations

import numpy as np
import pytest

from mmdata.energon_loaders.batch import IGNORE_INDEX
from mmdata.energon_loaders.llava_ov.chat_template import ChatTokenizer, ConversationError, apply_length_policy
from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def chat(hf_tok):
    return ChatTokenizer(hf_tok)


CONV = [
    {"from": "human", "value": "<image>\nWhat is in the picture? 图片里有什么？"},
    {"from": "gpt", "value": "A red bus next to a building."},
    {"from": "human", "value": "And the weather?"},
    {"from": "gpt", "value": "\n It is sunny, 晴天.\n"},
]


def test_tiny_tokenizer_is_deterministic_and_loads(tmp_path, hf_tok):
    a = build_tiny_qwen2_tokenizer(tmp_path / "a")
    b = build_tiny_qwen2_tokenizer(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "tokenizer_config.json").read_bytes() == (b / "tokenizer_config.json").read_bytes()
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"):
        assert len(hf_tok.encode(t, add_special_tokens=False)) == 1
    text = "Mixed text 混合文本 123 <image> ok"
    assert hf_tok.decode(hf_tok.encode(text, add_special_tokens=False)) == text
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"


def test_render_matches_hf_chat_template(chat, hf_tok):
    rendered = chat.render(CONV)
    assert rendered == hf_tok.apply_chat_template(chat.messages(CONV), tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    with_system = [{"from": "system", "value": "Be brief."}] + CONV
    assert chat.render(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_ids_equal_whole_conversation_tokenization(chat, hf_tok):
    out = chat.tokenize(CONV, [7])
    whole = hf_tok.encode(chat.render(CONV), add_special_tokens=False)
    image_id = chat.image_token_id
    collapsed = [t for i, t in enumerate(out.input_ids.tolist()) if t != image_id or out.input_ids[i - 1] != image_id]
    assert collapsed == whole
    assert int((out.input_ids == image_id).sum()) == 7
    assert out.media_spans == [("image", out.media_spans[0][1], 7)]


def test_loss_mask_is_exactly_the_assistant_spans(chat, hf_tok):
    out = chat.tokenize(CONV, [5])
    assert (out.labels[out.input_ids == chat.image_token_id] == IGNORE_INDEX).all()
    kept = out.labels != IGNORE_INDEX
    assert (out.labels[kept] == out.input_ids[kept]).all()
    # decode each contiguous loss run: assistant content + its closing <|im_end|>
    runs, cur = [], []
    for k, lab in zip(kept, out.labels):
        if k:
            cur.append(int(lab))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    decoded = [hf_tok.decode(r) for r in runs]
    assert decoded == [CONV[1]["value"] + "<|im_end|>", CONV[3]["value"] + "<|im_end|>"]
    # headers are not trained
    assistant_header = hf_tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    ids = out.input_ids.tolist()
    for i in range(len(ids) - len(assistant_header) + 1):
        if ids[i : i + len(assistant_header)] == assistant_header:
            assert (out.labels[i : i + len(assistant_header)] == IGNORE_INDEX).all()


def test_video_and_multi_image_expansion(chat):
    conv = [{"from": "human", "value": "<video>\n<image><image> compare"}, {"from": "gpt", "value": "ok"}]
    out = chat.tokenize(conv, [3, 4], [9])
    assert [(k, n) for k, _, n in out.media_spans] == [("video", 9), ("image", 3), ("image", 4)]
    assert int((out.input_ids == chat.video_token_id).sum()) == 9


@pytest.mark.parametrize(
    "conv,images,reason",
    [
        ([{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "x"}], [], "media_mismatch"),
        ([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}], [3], "media_mismatch"),
        ([{"from": "robot", "value": "hi"}], [], "bad_role"),
        ([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<image>"}], [3], "media_in_assistant"),
    ],
)
def test_bad_conversations_name_the_reason(chat, conv, images, reason):
    with pytest.raises(ConversationError) as info:
        chat.tokenize(conv, images)
    assert info.value.reason == reason


def test_length_policy_truncates_text_never_media(chat):
    conv = [{"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": "word " * 200}]
    full = chat.tokenize(conv, [50])
    assert apply_length_policy(full, len(full)).outcome == "fits"
    media_end = full.media_spans[0][1] + 50
    cut = apply_length_policy(full, media_end + 20)
    assert cut.outcome == "truncated" and len(cut.tokens) == media_end + 20
    assert np.array_equal(cut.tokens.input_ids, full.input_ids[: media_end + 20])
    assert apply_length_policy(full, media_end - 1).outcome == "too_long_media"
    assert apply_length_policy(full, media_end + 2).tokens is None  # only header text fits: no loss left
