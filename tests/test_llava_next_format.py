"""LLaVA-NeXT-format checkpoints (`LlavaQwenForCausalLM`, as Aquila-VL-2B and its stage
checkpoints are published) in and out of `mmtrain convert`, with transformers' LLaVA-OneVision
as the oracle. The tiny checkpoints are written here in the layout of the public LLaVA-NeXT code
(llava_qwen.py / llava_arch.py / siglip_encoder.py / multimodal_projector/builder.py): a flat
Qwen2 config with mm_* keys, `model.*` LLM tensors, `model.vision_tower.vision_tower.vision_model.*`
without the tower's last layer, `model.mm_projector.{0,2}`, `model.image_newline`, and a
tokenizer without `<image>`/`<video>`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)

from tests.fixtures_convert import assemble_stage1, save_siglip_tower  # noqa: E402
from tests.fixtures_training import train  # noqa: E402
from tests.llava_tiny import hf_image_inputs, hf_llava, images, text_config, vision_config  # noqa: E402

# `unit` test by test: the stage-1 training run is slow (a training subprocess)


def _cli(*argv: str) -> int:
    from mmtrain.cli import main

    return main(["convert", *argv])


def _to_hf(src: Path, dst: Path, layout: str) -> int:
    """`mmtrain convert mcore-to-hf --model llava-ov` into `layout` ("transformers" or "llava-next")."""
    return _cli("mcore-to-hf", "--model", "llava-ov", "--src", str(src), "--dst", str(dst), "--format", layout)


# ----------------------------------------------------------------------------- writing the layouts


def _tokenizer(dst: Path) -> int:
    """A Qwen2-style tokenizer without media tokens in `dst`; returns its length."""
    from transformers import AutoTokenizer

    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    build_tiny_qwen2_tokenizer(dst, media_tokens=False)
    tok = AutoTokenizer.from_pretrained(str(dst))
    assert "<image>" not in tok.get_vocab()
    return len(tok)


def _llava_next_names(sd: dict[str, torch.Tensor], tie: bool) -> dict[str, torch.Tensor]:
    """transformers' LlavaOnevisionForConditionalGeneration state dict -> LLaVA-NeXT names (the
    inverse of transformers' convert_llava_onevision_weights_to_hf.py key mapping)."""
    rename = [
        ("model.language_model.", "model."),
        ("model.vision_tower.", "model.vision_tower.vision_tower.vision_model."),
        ("model.multi_modal_projector.linear_1.", "model.mm_projector.0."),
        ("model.multi_modal_projector.linear_2.", "model.mm_projector.2."),
    ]
    out = {}
    for key, t in sd.items():
        for old, new in rename:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        if not (tie and key == "lm_head.weight"):
            out[key] = t.contiguous()
    return out


def write_llava_next(dst: Path, model, tok_dir: Path, *, extra_vision_layer: bool = False, edit=None) -> Path:
    """The weights of a transformers `model` as a LLaVA-NeXT checkpoint dir (tower: a local
    SigLIP folder, one layer more than stored, as LLaVA-NeXT deletes the last at load time)."""
    import shutil

    dst.mkdir(parents=True)
    tc = model.config.text_config
    tie = bool(model.config.tie_word_embeddings)
    sd = _llava_next_names(model.state_dict(), tie)
    tower = dst / "siglip-tiny"
    tower.mkdir()
    layers = model.config.vision_config.num_hidden_layers
    (tower / "config.json").write_text(json.dumps(vision_config(num_hidden_layers=layers + 1)))
    if extra_vision_layer:  # a tower saved whole: its last layer is stored too
        g = torch.Generator().manual_seed(7)
        p = "model.vision_tower.vision_tower.vision_model.encoder.layers."
        for k in [k for k in sd if k.startswith(f"{p}0.")]:
            sd[k.replace(f"{p}0.", f"{p}{layers}.")] = torch.randn(sd[k].shape, generator=g)
    cfg = text_config(tie_word_embeddings=tie, vocab_size=tc.vocab_size) | dict(
        architectures=["LlavaQwenForCausalLM"],
        model_type="llava_qwen",
        mm_vision_tower=str(tower),
        mm_hidden_size=model.config.vision_config.hidden_size,
        mm_projector_type="mlp2x_gelu",
        mm_vision_select_layer=-2,
        mm_vision_select_feature="patch",
        mm_patch_merge_type="spatial_unpad",
        image_aspect_ratio="anyres_max_9",
        image_grid_pinpoints=model.config.image_grid_pinpoints,
        mm_newline_position="one_token",
        mm_spatial_pool_mode="bilinear",
        mm_tunable_parts="mm_vision_tower,mm_mlp_adapter,mm_language_model",
        mm_use_im_start_end=False,
        mm_use_im_patch_token=False,
        use_mm_proj=True,
        tokenizer_model_max_length=32768,
        tokenizer_padding_side="right",
        torch_dtype="float32",
    )
    if edit:
        sd, cfg = edit(sd, cfg)
    save_file(sd, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tok_dir.iterdir():
        shutil.copy2(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def fmt(tmp_path_factory):
    """The same tiny weights in both formats; media ids = the tokenizer's next two ids, inside the
    embedding rows (1000 > tokenizer length, as Qwen's 151936 > 151646)."""
    root = tmp_path_factory.mktemp("fmt")
    n = _tokenizer(root / "tok")
    assert n + 2 <= 990  # the random text ids of hf_image_inputs stay below the media ids... and 1000
    model = hf_llava(seed=3, image_token=n, video_token=n + 1)
    model.save_pretrained(root / "hf")
    nxt = write_llava_next(root / "next", model, root / "tok")
    return dict(root=root, n=n, model=model, hf=root / "hf", next=nxt, tok=root / "tok")


@pytest.fixture(scope="module")
def converted_next(fmt):
    dst = fmt["root"] / "ck_next"
    assert _cli("hf-to-mcore", "--model", "llava-ov", "--src", str(fmt["next"]), "--dst", str(dst)) == 0
    return dst


def _logits(model, fmt, i: int = 0) -> torch.Tensor:
    rows, pv, sizes = hf_image_inputs(images(), image_token=fmt["n"])
    out = model(input_ids=rows[i][None], pixel_values=pv[i : i + 1], image_sizes=sizes[i : i + 1])
    return getattr(out, "logits", out)


# ----------------------------------------------------------------------------- tests


@pytest.mark.unit
def test_format_detection(fmt, tmp_path):
    from mmtrain.llava_ov.llava_next import detect_format
    from mmtrain.models.state_dict_adapter import ConversionError

    read = lambda d: json.loads((d / "config.json").read_text())  # noqa: E731
    assert detect_format(read(fmt["hf"])) == "transformers"
    assert detect_format(read(fmt["next"])) == "llava-next"
    assert detect_format({"model_type": "llava", "mm_vision_tower": "x"}) == "llava-next"  # lmms-lab's model_type
    with pytest.raises(ConversionError, match=r"model_type='qwen2'.*LlavaQwenForCausalLM"):
        detect_format({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})


def test_both_formats_import_to_identical_logits_ids_from_the_tokenizer(fmt, converted_next, tmp_path):
    from transformers import AutoTokenizer

    from mmtrain.llava_ov.load import load_llava_ov
    from mmtrain.llava_ov.conversion import saved_model_config

    ck_hf = tmp_path / "ck_hf"
    assert _cli("hf-to-mcore", "--model", "llava-ov", "--src", str(fmt["hf"]), "--dst", str(ck_hf)) == 0
    cfg = saved_model_config(converted_next)
    assert (cfg.image_token_id, cfg.video_token_id) == (fmt["n"], fmt["n"] + 1)  # added to the tokenizer
    assert cfg == saved_model_config(ck_hf)
    tok = AutoTokenizer.from_pretrained(str(converted_next / "hf_assets"))  # the resolved tokenizer is kept
    assert tok.convert_tokens_to_ids(["<image>", "<video>"]) == [fmt["n"], fmt["n"] + 1]
    assert (tok.model_max_length, tok.padding_side) == (32768, "right")  # its config's tokenizer_* keys
    a, b = load_llava_ov(converted_next), load_llava_ov(ck_hf)
    for i in range(2):
        assert torch.equal(_logits(a, fmt, i), _logits(b, fmt, i))


def test_llava_next_to_transformers_matches_our_model_and_round_trips(fmt, converted_next, tmp_path):
    """LLaVA-NeXT -> mcore -> transformers: HF's logits equal ours on the LLaVA-NeXT weights;
    -> LLaVA-NeXT again: bit-identical tensors; the transformers dir exports to the same tensors."""
    from transformers import AutoTokenizer, LlavaOnevisionForConditionalGeneration

    from mmtrain.llava_ov.load import load_llava_ov

    out = tmp_path / "as_hf"
    assert _to_hf(converted_next, out, "transformers") == 0
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(out).eval()
    assert hf.config.image_token_id == fmt["n"]
    assert AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids("<image>") == fmt["n"]
    ours = load_llava_ov(fmt["next"])  # the LLaVA-NeXT dir itself, converted on the fly
    with torch.no_grad():
        for i in range(2):
            assert (_logits(hf, fmt, i) - _logits(ours, fmt, i)).abs().max().item() <= 1e-4

    back = tmp_path / "as_next"
    assert _to_hf(converted_next, back, "llava-next") == 0
    src, got = load_file(fmt["next"] / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(src) == set(got) and all(torch.equal(src[k], got[k]) for k in src)
    cfg_src, cfg_back = (json.loads((d / "config.json").read_text()) for d in (fmt["next"], back))
    assert {k: cfg_back[k] for k in cfg_src} == cfg_src  # every source key kept (vision_config added)
    assert cfg_back["vision_config"]["num_hidden_layers"] == 3  # the whole tower; 2 layers stored

    ck_hf = tmp_path / "ck_hf"
    assert _cli("hf-to-mcore", "--model", "llava-ov", "--src", str(fmt["hf"]), "--dst", str(ck_hf)) == 0
    cross = tmp_path / "hf_as_next"
    assert _to_hf(ck_hf, cross, "llava-next") == 0
    got = load_file(cross / "model.safetensors")
    assert set(src) == set(got) and all(torch.equal(src[k], got[k]) for k in src)


@pytest.mark.unit
def test_stored_last_vision_layer_is_not_imported_and_named(fmt, tmp_path, caplog):
    from mmtrain.llava_ov.conversion import llava_source

    whole = write_llava_next(tmp_path / "whole", fmt["model"], fmt["tok"], extra_vision_layer=True)
    with caplog.at_level(logging.INFO):
        cfg, get = llava_source(whole)
    assert cfg.vision.num_layers == 2
    assert "model.vision_tower.vision_tower.vision_model.encoder.layers.2." in caplog.text
    _, ref = llava_source(fmt["next"])
    name = "vision_model.decoder.layers.1.mlp.linear_fc1.weight"
    assert torch.equal(get(name), ref(name))


@pytest.mark.unit
def test_pinpoints_string_form_and_tokenizer_row_growth(fmt, tmp_path, caplog):
    """`(1x1),...,(6x6)` is LLaVA-NeXT's pinpoint shorthand; embedding rows that cannot hold the
    added media ids grow, the new rows the mean of the old ones, and it is logged."""
    from mmtrain.llava_ov.conversion import llava_source

    n = fmt["n"]

    def shrink(sd, cfg):
        sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:n].contiguous()
        return sd, cfg | {"vocab_size": n, "image_grid_pinpoints": "(1x1),...,(6x6)"}

    d = write_llava_next(tmp_path / "small", fmt["model"], fmt["tok"], edit=shrink)
    with caplog.at_level(logging.INFO):
        cfg, get = llava_source(d)
        emb = get("language_model.embedding.word_embeddings.weight")
    ref_cfg, _ = llava_source(fmt["next"])
    assert (cfg.grid_max, cfg.max_tiles, cfg.image_token_id, cfg.video_token_id) == (
        ref_cfg.grid_max,
        ref_cfg.max_tiles,
        n,
        n + 1,
    )
    assert cfg.llm.vocab_size == n + 2
    assert emb.shape[0] == n + 2 and torch.equal(emb[n], emb[:n].mean(0)) and torch.equal(emb[n + 1], emb[n])
    assert "<image> / <video>" in caplog.text and "2 new row(s)" in caplog.text

    # a config whose vocab_size counts the tokenizer, not the (padded) table: the table's rows count
    def small_config(sd, cfg):
        return sd, cfg | {"vocab_size": n, "image_grid_pinpoints": str(cfg["image_grid_pinpoints"])}

    cfg, _ = llava_source(write_llava_next(tmp_path / "padded", fmt["model"], fmt["tok"], edit=small_config))
    assert (cfg.llm.vocab_size, cfg.grid_max) == (1000, ref_cfg.grid_max)


@pytest.mark.unit
def test_refusals_name_the_tensor_or_key(fmt, tmp_path, capsys, caplog):
    from mmtrain.llava_ov.conversion import llava_source
    from mmtrain.models.state_dict_adapter import ConversionError

    def case(name, edit):
        return write_llava_next(tmp_path / name, fmt["model"], fmt["tok"], edit=edit)

    def extra(sd, cfg):  # e.g. an mlp3x projector's third linear: the model has no place for it
        sd["model.mm_projector.4.weight"] = torch.zeros(2, 2)
        return sd, cfg

    with pytest.raises(ConversionError, match=r"model\.mm_projector\.4\.weight"):
        llava_source(case("extra", extra))

    def missing(sd, cfg):
        sd.pop("model.image_newline")
        return sd, cfg

    with pytest.raises(ConversionError, match=r"missing.*model\.image_newline"):
        llava_source(case("missing", missing))
    for key, value in (
        ("mm_projector_type", "linear"),
        ("image_aspect_ratio", "pad"),
        ("mm_vision_select_layer", -1),
        ("mm_patch_merge_type", "flat"),
        ("architectures", ["LlavaLlamaForCausalLM"]),
    ):
        d = case(f"cfg_{key}", lambda sd, cfg, key=key, value=value: (sd, cfg | {key: value}))
        with pytest.raises(ConversionError, match=key):
            llava_source(d)
    grid = case("video_grid", lambda sd, cfg: (sd, cfg | {"mm_newline_position": "grid"}))
    with caplog.at_level(logging.WARNING):
        llava_source(grid)  # a video-only setting: imported, and said
    assert "mm_newline_position='grid'" in caplog.text
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "extra" / f).unlink(missing_ok=True)
    # through the CLI: one line, exit 2, nothing written
    assert (
        _cli("hf-to-mcore", "--model", "llava-ov", "--src", str(tmp_path / "extra"), "--dst", str(tmp_path / "o")) == 2
    )
    err = capsys.readouterr().err.strip()  # (megatron's import warnings may come first when run alone)
    assert "Traceback" not in err and "no tokenizer" in err.splitlines()[-1] and "<image>" in err.splitlines()[-1]
    assert not (tmp_path / "o").exists()
    assert (
        _cli(
            "mcore-to-hf",
            "--model",
            "emu3",
            "--src",
            str(tmp_path),
            "--dst",
            str(tmp_path / "o"),
            "--format",
            "llava-next",
        )
        == 2
    )
    assert "writes no --format llava-next" in capsys.readouterr().err


@pytest.mark.unit
def test_recipe_checkpoint_load_of_a_llava_next_dir(fmt):
    """`checkpoint.load: LLAVA_NEXT_DIR` fills the model; a recipe whose ids differ is named."""
    from dataclasses import replace

    from mmtrain.llava_ov.conversion import build_stage, llava_source
    from mmtrain.llava_ov.load import load_hf_into_model
    from mmtrain.models.state_dict_adapter import ConversionError
    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1)
    cfg, _ = llava_source(fmt["next"])
    ours = build_stage(cfg)
    load_hf_into_model([ours], fmt["next"], cfg)
    assert torch.equal(ours.image_newline, fmt["model"].model.image_newline)
    with pytest.raises(ConversionError, match=rf"image_token_id is 5 in the recipe, {fmt['n']} in the HF"):
        load_hf_into_model([ours], fmt["next"], replace(cfg, image_token_id=5))


def test_stage1_assembly_takes_the_media_ids_from_the_llm_tokenizer(fmt, tmp_path, caplog):
    """A Qwen2 LLM-only checkpoint whose tokenizer lacks the media tokens: they are added, the
    vocabulary grows to hold them (mean rows), and the resolved tokenizer is kept."""
    import shutil

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from mmtrain.llava_ov.conversion import saved_model_config

    n = fmt["n"]
    torch.manual_seed(5)
    Qwen2ForCausalLM(Qwen2Config(**text_config(vocab_size=n))).save_pretrained(tmp_path / "llm")  # rows = tokenizer
    for f in fmt["tok"].iterdir():
        shutil.copy2(f, tmp_path / "llm" / f.name)
    save_siglip_tower(tmp_path / "vis")
    with caplog.at_level(logging.INFO):
        assert assemble_stage1(tmp_path) == 0
    cfg = saved_model_config(tmp_path / "ck")
    assert (cfg.image_token_id, cfg.video_token_id, cfg.llm.vocab_size) == (n, n + 1, n + 2)
    assert "2 new row(s)" in caplog.text
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ck" / "hf_assets"))
    assert tok.convert_tokens_to_ids(["<image>", "<video>"]) == [n, n + 1]


@pytest.mark.slow
def test_stage1_trains_from_an_llm_whose_tokenizer_lacks_media_tokens(tmp_path, shards_dir):
    """Stage 1 as a user starts it: a Qwen2-style LLM-only checkpoint and its tokenizer without
    `<image>`/`<video>` + a SigLIP tower -> assembled (rows grown, logged) -> the tiny recipe with
    null media ids trains; the ids are resolved from the tokenizer (and written to config.yaml)."""
    import yaml
    from transformers import Qwen2Config, Qwen2ForCausalLM

    n = _tokenizer(tmp_path / "tok")
    torch.manual_seed(6)
    Qwen2ForCausalLM(Qwen2Config(**text_config(vocab_size=n))).save_pretrained(tmp_path / "llm")
    for f in (tmp_path / "tok").iterdir():
        (tmp_path / "llm" / f.name).write_bytes(f.read_bytes())
    save_siglip_tower(tmp_path / "vis")
    assert assemble_stage1(tmp_path) == 0
    run = tmp_path / "run"
    media_ids = ("model.image_token_id=null", "model.video_token_id=null")
    checkpoint = (f"checkpoint.load={tmp_path / 'ck'}", "checkpoint.interval=0")
    proc = train(
        run, shards_dir, tmp_path / "tok", "train.iters=2", *checkpoint, f"model.llm.vocab_size={n + 2}", *media_ids
    )
    assert f"model.image_token_id={n}, model.video_token_id={n + 1}: from the tokenizer" in proc.stderr + proc.stdout
    model = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert (model["image_token_id"], model["video_token_id"]) == (n, n + 1)
    from transformers import AutoTokenizer

    kept = AutoTokenizer.from_pretrained(str(run / "checkpoints" / "hf_assets"))  # exported by mcore-to-hf
    assert kept.convert_tokens_to_ids(["<image>", "<video>"]) == [n, n + 1]


@pytest.mark.unit
def test_transformers_dir_ids_checked_against_its_own_tokenizer(fmt, tmp_path, capsys, caplog):
    """A transformers-format dir pins `image_token_index`/`video_token_index` in its config: they
    must be the ids its own tokenizer gives (media tokens added as the loader adds them); a
    mismatch is one line naming both; a dir without a loadable tokenizer is imported and said."""
    import shutil

    from mmtrain.llava_ov.conversion import llava_source, source_tokens

    n = fmt["n"]
    good = tmp_path / "good"
    shutil.copytree(fmt["hf"], good)
    for f in fmt["tok"].iterdir():
        shutil.copy2(f, good / f.name)
    assert llava_source(good)[0].image_token_id == n
    assert source_tokens(good).added == ["<image>", "<video>"]  # kept with the conversion, ids n / n+1

    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"image_token_index": 5}))
    assert _cli("hf-to-mcore", "--model", "llava-ov", "--src", str(bad), "--dst", str(tmp_path / "o")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"image_token_index=5 but its tokenizer maps <image> to {n}" in last and "video_token_index" not in last
    assert not (tmp_path / "o").exists()

    stub = tmp_path / "stub"  # weights + a tokenizer_config.json that loads no tokenizer
    shutil.copytree(fmt["hf"], stub)
    (stub / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    with caplog.at_level(logging.WARNING):
        assert llava_source(stub)[0].image_token_id == n
    assert "cannot load its tokenizer" in caplog.text and f"({n} / {n + 1}) are not checked" in caplog.text


def test_recipe_ids_and_rows_checked_against_the_tokenizer(fmt, converted_next, tmp_path):
    """Before a run starts: a pinned media id the tokenizer does not give, or an HF
    `checkpoint.load` whose ids differ from the tokenizer's, is named with both values; rows too
    few for the tokenizer's media ids are refused with the fix for where the run starts (the rows
    the checkpoint holds, or the conversion command that adds them)."""
    import shutil

    from transformers import AutoTokenizer

    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from mmtrain.config import load_recipe
    from mmtrain.llava_ov.tokenizer_check import check_tokenizer

    n, recipes = fmt["n"], Path(__file__).resolve().parents[1] / "recipes"

    def problems(*overrides: str) -> list[str]:
        recipe = load_recipe(
            recipes / "llava-ov-tiny.yaml",
            overrides=[
                f"tokenizer.path={fmt['tok']}",
                "model.image_token_id=null",
                "model.video_token_id=null",
                *overrides,
            ],
            family="llava-ov",
        )
        return check_tokenizer(recipe, AutoTokenizer.from_pretrained(recipe.tokenizer.path))

    assert problems() == []  # null ids: the tokenizer's (media tokens added), inside the rows
    (pinned,) = problems(f"model.video_token_id={n + 1}", "model.image_token_id=5")
    assert pinned.startswith("model.image_token_id: 5, but the tokenizer at") and f"maps <image> to {n}" in pinned

    def too_small(*overrides: str) -> str:
        (msg,) = problems(f"model.llm.vocab_size={n}", *overrides)
        assert msg.startswith(f"model.llm.vocab_size: {n} rows cannot hold") and f"needs {n + 2} rows" in msg
        return msg

    assert f"set model.llm.vocab_size={n + 2} for a fresh model" in too_small()
    assert "mmtrain convert hf-to-mcore --model llava-ov --llm LLM_DIR --vision SIGLIP_DIR" in too_small()
    # a LLaVA-NeXT dir loads with its 1000 rows (media rows added on the fly when needed)
    assert "holds 1000 rows (media rows included): set model.llm.vocab_size=1000" in too_small(
        f"checkpoint.load={fmt['next']}"
    )
    assert "holds 1000 rows" in too_small(f"checkpoint.load={converted_next}")  # its saved model config's

    with_media = build_tiny_qwen2_tokenizer(tmp_path / "tok", vocab_size=512)  # <image>/<video> below n / n+1
    ids = AutoTokenizer.from_pretrained(str(with_media)).convert_tokens_to_ids(["<image>", "<video>"])
    (other,) = problems(f"checkpoint.load={fmt['hf']}", f"tokenizer.path={with_media}")
    assert other.startswith(f"checkpoint.load: {fmt['hf']} has <image>/<video> at ids {n}/{n + 1}, the tokenizer")
    assert f"at {ids[0]}/{ids[1]}" in other
    bad = tmp_path / "bad"  # a transformers dir whose config and tokenizer disagree: refused before any rank starts
    shutil.copytree(fmt["hf"], bad)
    for f in fmt["tok"].iterdir():
        shutil.copy2(f, bad / f.name)
    (bad / "config.json").write_text(
        json.dumps(json.loads((bad / "config.json").read_text()) | {"image_token_index": 5})
    )
    (refused,) = problems(f"checkpoint.load={bad}")
    assert (
        refused.startswith("checkpoint.load: ")
        and f"image_token_index=5 but its tokenizer maps <image> to {n}" in refused
    )


def test_bf16_llava_next_checkpoint_keeps_bf16_in_both_export_formats(fmt, tmp_path):
    """The published LLaVA-NeXT checkpoints are bf16: LLaVA-NeXT -> mcore -> LLaVA-NeXT is
    bit-identical in bf16 (half the fp32 size, config says bfloat16), and the transformers export
    is bf16 too."""
    from transformers import LlavaOnevisionForConditionalGeneration

    def to_bf16(sd, cfg):
        return {k: v.to(torch.bfloat16) for k, v in sd.items()}, cfg | {"torch_dtype": "bfloat16"}

    src = write_llava_next(tmp_path / "next_bf16", fmt["model"], fmt["tok"], edit=to_bf16)
    ckpt = tmp_path / "ck"
    assert _cli("hf-to-mcore", "--model", "llava-ov", "--src", str(src), "--dst", str(ckpt)) == 0
    back = tmp_path / "back"
    assert _to_hf(ckpt, back, "llava-next") == 0
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(a) == set(b) and all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((back / "config.json").read_text())["torch_dtype"] == "bfloat16"
    fp32_size = (fmt["next"] / "model.safetensors").stat().st_size
    assert (back / "model.safetensors").stat().st_size < 0.55 * fp32_size

    out = tmp_path / "as_hf"
    assert _to_hf(ckpt, out, "transformers") == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(out)
    ref = fmt["model"].state_dict()
    got = hf.state_dict()
    assert hf.dtype == torch.bfloat16 and set(got) == set(ref)
    assert all(torch.equal(got[k], ref[k].to(torch.bfloat16)) for k in ref)
