"""The Emu3 task encoder: understanding in transformers' Emu3 chat format with loss on the
answers, generation (caption -> image) with loss on the visual and structure tokens, the task
mix and the CFG caption dropout (`p_uncond`: rate, seeded, reproducible), packing, exact resume
and task-forcing blends, over token shards of the demo's kind of data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmdata.energon_loaders.batch import IGNORE_INDEX
from mmdata.energon_loaders.emu3 import serialize as es
from mmdata.energon_loaders.emu3.loader import build_emu3_loader
from mmdata.energon_loaders.emu3.tasks import GENERATION, UNDERSTANDING, Emu3Tasks, generation_caption, pick_task
from tests.emu3_tiny import HF_EMU3_CHAT_TEMPLATE

SEQ = 512


@pytest.fixture(scope="module")
def tok(emu3_tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(emu3_tok_dir)


def _grid(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, (h, w)).astype(np.uint16)


def _hf_processor(tok):
    from transformers import Emu3ImageProcessor, Emu3Processor

    return Emu3Processor(image_processor=Emu3ImageProcessor(), tokenizer=tok, chat_template=HF_EMU3_CHAT_TEMPLATE)


def _hf_messages(turns: list[tuple[str, str, int]]) -> list[dict]:
    """(role, text, images) -> transformers chat messages (images first, as the template renders)."""
    return [
        {"role": role, "content": [{"type": "image"}] * n + [{"type": "text", "text": text}]} for role, text, n in turns
    ]


@pytest.mark.unit
def test_understanding_is_the_hf_chat_template_with_eos_and_loss_on_answers(tok):
    tasks = Emu3Tasks(tok)
    conv = [
        {"from": "human", "value": "<image>\nWhat is shown?"},
        {"from": "gpt", "value": "A cat."},
        {"from": "human", "value": "And the colour?"},
        {"from": "gpt", "value": "Grey."},
    ]
    grids = [_grid(3, 4, 0)]
    proc = _hf_processor(tok)
    hf_full = proc.apply_chat_template(
        _hf_messages(
            [
                ("system", "You are a helpful assistant.", 0),
                ("user", "What is shown?", 1),
                ("assistant", "A cat.", 0),
                ("user", "And the colour?", 0),
                ("assistant", "Grey.", 0),
            ]
        )
    )
    hf_prompt = proc.apply_chat_template(
        _hf_messages([("system", "You are a helpful assistant.", 0), ("user", "What is shown?", 1)]),
        add_generation_prompt=True,
    )
    text, loss = tasks.render(conv)
    assert text.replace(tok.eos_token, "") == hf_full
    assert text[: loss[0][0]] == hf_prompt  # the first answer's prompt is the template's generation prompt

    seq = tasks.understanding(conv, grids)
    vocab, encode = es.Emu3Vocab.from_tokenizer(tok), es.hf_text_encoder(tok)
    no_eos = seq.input_ids[seq.input_ids != vocab.eos]
    # the ids are HF's processor ids + Emu3's image substitution (es.serialize, parity-tested)
    assert no_eos.tolist() == es.serialize(hf_full, grids, vocab, encode).tolist()
    targets = seq.labels[seq.labels != IGNORE_INDEX]
    assert tok.decode(targets) == f" A cat.{tok.eos_token} Grey.{tok.eos_token}"
    block = es.image_ids(grids[0], vocab, encode)
    assert seq.media_spans == [("image", int(np.flatnonzero(seq.input_ids == vocab.boi)[0]), len(block))]
    assert (seq.labels[seq.media_spans[0][1] :][: seq.media_spans[0][2]] == IGNORE_INDEX).all()


@pytest.mark.unit
def test_generation_prompt_is_hf_processors_and_loss_is_on_what_the_model_generates(tok):
    tasks = Emu3Tasks(tok)
    grid = _grid(4, 5, 1)
    seq = tasks.generation("a grey cat on a red sofa", grid)
    vocab = tasks.vocab
    # transformers' text-to-image prompt: [bos] caption [boi] "H*W" [img] (ratio/area picked to give 4x5 codes)
    hf = _hf_processor(tok)(
        text="a grey cat on a red sofa", return_for_image_generation=True, ratio="5:4", image_area=4 * 5 * 64
    )
    prompt = list(hf["input_ids"][0])
    assert list(hf["image_sizes"][0]) == [4, 5]
    assert seq.input_ids[: len(prompt)].tolist() == prompt
    # the rest is what the model generates under Emu3's prefix constraints: rows, eof, eoi, eos
    rest = seq.input_ids[len(prompt) :]
    assert rest.tolist() == [
        *np.c_[vocab.visual[grid.astype(np.int64)], np.full(4, vocab.eol)].ravel(),
        vocab.eof,
        vocab.eoi,
        vocab.eos,
    ]
    assert (seq.labels[: len(prompt)] == IGNORE_INDEX).all() and seq.labels[len(prompt) :].tolist() == rest.tolist()
    uncond = tasks.generation("", grid)
    assert uncond.input_ids[:2].tolist() == [vocab.bos, vocab.boi]
    assert uncond.input_ids[-len(rest) :].tolist() == rest.tolist()


@pytest.mark.unit
def test_task_choice():
    caption = [{"from": "human", "value": "<image>\nDescribe it."}, {"from": "gpt", "value": " A dog. "}]
    assert generation_caption(caption, 1) == "A dog."
    assert generation_caption(caption, 2) is None and generation_caption(caption * 2, 1) is None
    assert generation_caption([{"from": "system", "value": "Be brief."}, *caption], 1) == "A dog."
    u = np.random.default_rng(0).random(20000)
    share = np.mean([pick_task(x, {UNDERSTANDING: 3.0, GENERATION: 1.0}, True) == GENERATION for x in u])
    assert abs(share - 0.25) < 0.015
    assert pick_task(0.0, {UNDERSTANDING: 3.0, GENERATION: 1.0}, False) == UNDERSTANDING
    assert pick_task(0.5, {GENERATION: 1.0}, False) is None


def _loader(data, tok_dir, seed=5, **kw):
    args = dict(
        seq_length=SEQ,
        micro_batch_size=4,
        num_workers=0,
        seed=seed,
        packing=False,
        encoder=dict(tasks={GENERATION: 1.0}, p_uncond=0.3),
    )
    args.update(kw)
    return build_emu3_loader(data, tok_dir, **args)


def _uncond_flags(batches, vocab) -> list[tuple[str, bool]]:
    """(sample id, caption dropped) of every generation sample: [bos] followed directly by [boi]."""
    out = []
    for b in batches:
        for r, (ids, tasks) in enumerate(zip(b.sample_ids, b.tasks)):
            assert tasks == [GENERATION] * len(ids)
            out.append((ids[0], int(b.input_ids[r, 1]) == vocab.boi))
    return out


def test_p_uncond_rate_and_reproducibility(demo_token_dir, emu3_tok_dir, tok):
    vocab = es.Emu3Vocab.from_tokenizer(tok)
    loader = _loader(demo_token_dir, emu3_tok_dir)
    flags = _uncond_flags([b for _, b in zip(range(100), loader)], vocab)
    rate = np.mean([f for _, f in flags])
    assert abs(rate - 0.3) < 4 * (0.3 * 0.7 / len(flags)) ** 0.5, (rate, len(flags))
    # records that cannot be text-to-image samples are skipped and counted (understanding weight 0)
    assert loader.stats.skipped["not_a_generation_sample"] > 0
    again = _uncond_flags([b for _, b in zip(range(100), _loader(demo_token_dir, emu3_tok_dir))], vocab)
    assert again == flags  # same seed: the same samples, the same captions dropped
    other = _uncond_flags([b for _, b in zip(range(100), _loader(demo_token_dir, emu3_tok_dir, seed=6))], vocab)
    assert other != flags


def _digest(batch) -> dict:
    return {
        "ids": batch.sample_ids,
        "tasks": batch.tasks,
        "sum": int(batch.input_ids.sum()),
        "labels": int((batch.labels != IGNORE_INDEX).sum()),
        "cu": batch.cu_seqlens.tolist(),
    }


def test_mixed_packed_batches_exact_resume_and_task_blend(demo_token_dir, emu3_tok_dir, tmp_path):
    kw = dict(
        packing=True,
        packing_buffer_size=16,
        micro_batch_size=2,
        num_workers=1,
        checkpoint_every_min_n_samples=2,
        encoder=dict(tasks={UNDERSTANDING: 1.0, GENERATION: 1.0}, p_uncond=0.5),
    )
    loader = _loader(demo_token_dir, emu3_tok_dir, **kw)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.save_state_json()
    expected = [_digest(next(it)) for _ in range(3)]
    for b in first:
        cu = b.cu_seqlens.tolist()
        assert cu[-1] == b.input_ids.numel() and len(cu) - 1 >= sum(len(r) for r in b.sample_ids)
        lab, ids = b.labels.flatten(), b.input_ids.flatten()
        keep = (lab != IGNORE_INDEX).nonzero().flatten()
        assert torch.equal(lab[keep], ids[keep + 1]) and b.num_loss_tokens == len(keep)
    tasks_seen = {t for b in first for row in b.tasks for t in row}
    assert tasks_seen == {UNDERSTANDING, GENERATION}
    del it, loader
    resumed = _loader(demo_token_dir, emu3_tok_dir, **kw)
    resumed.restore_state_json(state)
    assert [_digest(b) for _, b in zip(range(3), resumed)] == expected

    # a metadataset entry's `task` subflavor forces the task of its samples
    blend = tmp_path / "blend.yaml"
    entries = [
        {
            "weight": 1.0,
            "path": str(demo_token_dir.resolve()),
            "dataset_config": "mmdata.yaml",
            "subflavors": {"task": task},
        }
        for task in (UNDERSTANDING, GENERATION)
    ]
    blend.write_text(
        json.dumps(
            {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {"train": {"blend": entries}}}
        )
    )
    loader = _loader(blend, emu3_tok_dir, encoder=dict(tasks={UNDERSTANDING: 1.0}))
    tasks = [t for _, b in zip(range(40), loader) for row in b.tasks for t in row]
    share = tasks.count(GENERATION) / len(tasks)
    assert 0.2 < share < 0.6, share  # ~half the draws, minus the generation entry's skipped records
    assert loader.stats.counters["task/generation"] == tasks.count(GENERATION)
