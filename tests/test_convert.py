"""`mmtrain convert`: HF <-> megatron for LLaVA-OV, Qwen2 alone, SigLIP alone (tiny random
configs): bit-identical round trips, logits parity after conversion, bad input named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)

from tests.fixtures_convert import assemble_stage1, convert_cli, save_siglip_tower, tp2_worker_checks  # noqa: E402
from tests.llava_tiny import hf_image_inputs, hf_llava, images, text_config, vision_config  # noqa: E402


def test_checkpoint_layout(converted):
    from mmtrain.runtime.checkpoint.layout import find_latest_iteration
    from mmtrain.runtime.checkpoint.weights import load_model_config_dict

    assert (converted / "latest").read_text().strip() == "0"
    assert find_latest_iteration(converted) == 0
    assert (converted / "iter_0000000" / "model").is_dir()
    cfg = load_model_config_dict(converted)
    assert cfg["llm"]["num_layers"] == 2 and cfg["vision"]["image_size"] == 30


def test_round_trip_is_bit_identical_and_loads_in_transformers(hf_dir, converted, tmp_path):
    from transformers import LlavaOnevisionForConditionalGeneration

    src, model = hf_dir
    out = tmp_path / "hf_out"
    assert convert_cli("mcore-to-hf", "--model", "llava-ov", "--src", str(converted), "--dst", str(out)) == 0
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert (out / "tokenizer_config.json").is_file()  # assets carried along
    reloaded = LlavaOnevisionForConditionalGeneration.from_pretrained(out)
    s1, s2 = model.state_dict(), reloaded.state_dict()
    assert set(s1) == set(s2)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_load_llava_ov_matches_hf_logits(hf_dir, converted):
    from mmtrain.llava_ov.load import load_llava_ov

    _, model = hf_dir
    ours = load_llava_ov(converted)
    assert not ours.training
    rows, pv, sizes = hf_image_inputs(images())
    for i in range(2):
        ids = rows[i][None]
        with torch.no_grad():
            ref = model(input_ids=ids, pixel_values=pv[i : i + 1], image_sizes=sizes[i : i + 1]).logits
        out = ours(input_ids=ids, pixel_values=pv[i : i + 1], image_sizes=sizes[i : i + 1])
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-4


def test_sharded_export_writes_an_index(converted, tmp_path):
    from mmtrain.llava_ov.conversion import mcore_to_hf
    from mmtrain.models.hf_io import SafetensorsReader

    out = mcore_to_hf(converted, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single = tmp_path / "single"
    mcore_to_hf(converted, single)
    r1, r2 = SafetensorsReader(out), SafetensorsReader(single)
    assert r1.keys() == r2.keys() and all(torch.equal(r1.get(k), r2.get(k)) for k in r1.keys())


# ----------------------------------------------------------------------------- Qwen2 / SigLIP alone


@pytest.mark.unit
@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("qwen2", False), ("llama", False)])
def test_decoder_alone_parity_and_round_trip(arch, tie):
    """Qwen2ForCausalLM (qkv bias) and LlamaForCausalLM (none) through the shared decoder adapters."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from mmtrain.models.language_model import build_language_model
    from mmtrain.models.lm_config import padded_vocab_size
    from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config
    from mmtrain.models.model_io import iter_canonical, load_canonical
    from mmtrain.models.state_dict_adapter import (
        LlamaStateDictAdapter,
        Qwen2StateDictAdapter,
        llama_config_from_hf,
        llm_config_from_hf,
    )
    from mmtrain.runtime.distributed import ensure_model_parallel

    config_cls, model_cls, adapter_cls, to_llm = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, Qwen2StateDictAdapter, llm_config_from_hf),
        "llama": (LlamaConfig, LlamaForCausalLM, LlamaStateDictAdapter, llama_config_from_hf),
    }[arch]
    ensure_model_parallel(1, 1)
    torch.manual_seed(2)
    tc = text_config(tie_word_embeddings=tie, vocab_size=997, model_type=arch)  # not a multiple of 8: padded
    hf = model_cls(config_cls(**tc)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    llm = to_llm(hf.config.to_dict())
    assert llm.qkv_bias == (arch == "qwen2")
    sd = hf.state_dict()
    if tie:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    adapter = adapter_cls(llm)
    adapter.check_hf_keys(set(sd))
    gpt = build_language_model(
        llm,
        language_transformer_config(llm, "float32", ParallelOptions()),
        vocab_size=padded_vocab_size(llm.vocab_size, 8),
    ).eval()
    load_canonical(gpt, lambda n: adapter.mcore_tensor(n, sd.__getitem__))
    ids = torch.randint(0, 997, (2, 19), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(19).expand(2, -1)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = gpt(input_ids=ids, position_ids=pos, attention_mask=None)[..., :997]
    assert (out - ref).abs().max().item() <= 1e-4
    back = dict(adapter.iter_hf(dict(iter_canonical(gpt, true_vocab=997)).__getitem__))
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.unit
def test_siglip_alone_parity_drop_last_layer_and_round_trip():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from mmtrain.llava_ov.state_dict_adapter import SiglipStateDictAdapter, vision_config_from_hf
    from mmtrain.llava_ov.vision import SiglipVisionModel as McoreSiglip, vision_transformer_config
    from mmtrain.models.megatron_config import ParallelOptions, base_config_kwargs
    from mmtrain.models.model_io import iter_canonical, load_canonical
    from mmtrain.runtime.distributed import ensure_model_parallel

    ensure_model_parallel(1, 1)
    torch.manual_seed(3)
    hf = SiglipVisionModel(
        SiglipVisionConfig(
            **{k: v for k, v in vision_config(num_hidden_layers=3, vision_use_head=True).items() if k != "model_type"}
        )
    ).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sd = hf.state_dict()
    px = torch.randn(2, 3, 30, 30)
    with torch.no_grad():
        ref = hf(pixel_values=px, output_hidden_states=True)
    base = base_config_kwargs("float32", ParallelOptions(), sequence_parallel=False)
    # full tower: last_hidden_state (post-layernorm) parity, bit-identical round trip (head ignored)
    vcfg = vision_config_from_hf(hf.config.to_dict())
    adapter = SiglipStateDictAdapter(vcfg)
    sdn = {adapter.normalize_hf_key(k): v for k, v in sd.items()}
    adapter.check_hf_keys(set(sdn))
    tower = McoreSiglip(vcfg, vision_transformer_config(vcfg, base)).eval()
    load_canonical(tower, lambda n: adapter.mcore_tensor(n, sdn.__getitem__))
    with torch.no_grad():
        out = tower(px, apply_post_layernorm=True)
    assert (out - ref.last_hidden_state).abs().max().item() <= 1e-4
    back = dict(adapter.iter_hf(dict(iter_canonical(tower)).__getitem__))
    assert all(torch.equal(back[k], sdn[k]) for k in back)
    assert set(sdn) - set(back) == {k for k in sdn if k.startswith("vision_model.head.")}
    # LLaVA-OV style: last layer dropped, features = HF hidden_states[-2] (pre post-layernorm)
    v2 = vision_config_from_hf(hf.config.to_dict(), num_layers=2)
    ad2 = SiglipStateDictAdapter(v2, source_layers=3)
    ad2.check_hf_keys(set(sdn))
    tower2 = McoreSiglip(v2, vision_transformer_config(v2, base)).eval()
    load_canonical(tower2, lambda n: ad2.mcore_tensor(n, sdn.__getitem__))
    with torch.no_grad():
        out2 = tower2(px)
    assert (out2 - ref.hidden_states[2]).abs().max().item() <= 1e-4


def test_stage1_assembly_from_separate_llm_and_vision(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mmtrain.llava_ov.conversion import build_stage, saved_model_config
    from mmtrain.runtime.checkpoint.weights import load_model_weights
    from mmtrain.runtime.distributed import ensure_model_parallel

    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    torch.manual_seed(4)
    Qwen2ForCausalLM(Qwen2Config(**text_config())).save_pretrained(tmp_path / "llm")
    build_tiny_qwen2_tokenizer(tmp_path / "llm")  # the media ids are read from the LLM's tokenizer
    save_siglip_tower(tmp_path / "vis")
    assert assemble_stage1(tmp_path) == 0
    cfg = saved_model_config(tmp_path / "ck")
    assert cfg.vision.num_layers == 2 and cfg.llm.num_layers == 2
    ensure_model_parallel(1, 1)
    model = build_stage(cfg)
    load_model_weights([model], tmp_path / "ck")
    llm = load_file(tmp_path / "llm" / "model.safetensors")
    assert torch.equal(
        model.language_model.decoder.layers[1].mlp.linear_fc2.weight, llm["model.layers.1.mlp.down_proj.weight"]
    )
    vsd = load_file(tmp_path / "vis" / "model.safetensors")
    key = [k for k in vsd if k.endswith("encoder.layers.1.mlp.fc1.weight")][0]
    assert torch.equal(model.vision_model.decoder.layers[1].mlp.linear_fc1.weight, vsd[key])
    for fresh in (model.vision_projection.encoder.linear_fc1.weight, model.image_newline):  # initialised
        assert torch.isfinite(fresh).all() and fresh.std() > 0


# ----------------------------------------------------------------------------- bad input


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    sd = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    sd, cfg = edit(sd, cfg)
    save_file(sd, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.unit
def test_bad_inputs_name_the_tensor_or_key(hf_dir, tmp_path):
    from mmtrain.llava_ov.conversion import hf_to_mcore
    from mmtrain.models.state_dict_adapter import ConversionError

    src, _ = hf_dir
    k_missing = "language_model.model.layers.1.self_attn.k_proj.weight"

    def drop(sd, cfg):
        sd.pop(k_missing)
        return sd, cfg

    with pytest.raises(ConversionError, match=k_missing.replace(".", r"\.")):
        hf_to_mcore(_broken_copy(src, tmp_path / "a", drop), tmp_path / "o1")

    def reshape(sd, cfg):
        sd["multi_modal_projector.linear_2.weight"] = sd["multi_modal_projector.linear_2.weight"][:, :10].contiguous()
        return sd, cfg

    with pytest.raises(ConversionError, match=r"vision_projection\.encoder\.linear_fc2\.weight"):
        hf_to_mcore(_broken_copy(src, tmp_path / "b", reshape), tmp_path / "o2")

    def qkv(sd, cfg):
        k = "language_model.model.layers.0.self_attn.k_proj.weight"
        sd[k] = torch.cat([sd[k], sd[k]])
        return sd, cfg

    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.k_proj\.weight"):
        hf_to_mcore(_broken_copy(src, tmp_path / "c", qkv), tmp_path / "o3")

    def arch(sd, cfg):
        cfg["model_type"] = "llava_next"
        cfg["architectures"] = ["LlavaNextForConditionalGeneration"]
        return sd, cfg

    with pytest.raises(ConversionError, match="model_type"):
        hf_to_mcore(_broken_copy(src, tmp_path / "d", arch), tmp_path / "o4")

    def extra(sd, cfg):
        sd["language_model.model.layers.2.mlp.up_proj.weight"] = torch.zeros(2)
        return sd, cfg

    with pytest.raises(ConversionError, match=r"layers\.2\.mlp\.up_proj"):
        hf_to_mcore(_broken_copy(src, tmp_path / "e", extra), tmp_path / "o5")
    assert not (tmp_path / "o1").exists()


@pytest.mark.unit
def test_cli_usage_errors_exit_2(tmp_path, capsys):
    """The registry's families are the --model choices; a half-given assembly and a missing source
    are one line, exit 2, before anything is written."""
    assert convert_cli("hf-to-mcore", "--model", "llava-ov", "--llm", str(tmp_path), "--dst", str(tmp_path / "o")) == 2
    assert "give either --src HF_DIR, or all of --llm DIR --vision DIR" in capsys.readouterr().err
    assert (
        convert_cli(
            "hf-to-mcore", "--model", "llava-ov", "--src", str(tmp_path / "missing"), "--dst", str(tmp_path / "o")
        )
        == 2
    )
    assert capsys.readouterr().err.strip().endswith(f"--src {tmp_path / 'missing'} does not exist")
    assert (
        convert_cli("mcore-to-hf", "--model", "llava-ov", "--src", str(tmp_path / "none"), "--dst", str(tmp_path / "o"))
        == 2
    )
    assert capsys.readouterr().err.strip().endswith(f"--src {tmp_path / 'none'} does not exist")
    assert (
        convert_cli(
            "mcore-to-hf",
            "--model",
            "llava-ov",
            "--src",
            str(tmp_path),
            "--dst",
            str(tmp_path / "o"),
            "--vq",
            str(tmp_path),
        )
        == 2
    )  # an export source of another family
    assert "mcore-to-hf --model llava-ov takes no --vq" in capsys.readouterr().err
    for bad in (
        ["mcore-to-hf", "--model", "llava-ov", "--dst", str(tmp_path / "o")],  # --src is required
        ["hf-to-mcore", "--model", "chameleon", "--src", str(tmp_path), "--dst", str(tmp_path / "o")],
    ):
        with pytest.raises(SystemExit) as exit_:
            convert_cli(*bad)
        assert exit_.value.code == 2
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- TP=2 (2 processes)


def test_tp2_logits_and_loss_match_hf_and_reshard(hf_dir, converted, tmp_path):
    from mmtrain.llava_ov.load import load_llava_ov

    src, model = hf_dir
    res = tp2_worker_checks("llava_tp_worker.py", src, converted, tmp_path)
    assert res["local_qkv_rows"] == (4 + 2 * 2) * 16 // 2  # half the (heads + 2 groups) * head_dim rows
    # the TP=2 checkpoint loads back at TP=1 and still matches HF
    ours = load_llava_ov(tmp_path / "tp2")
    rows, pv, sizes = hf_image_inputs(images())
    ids = rows[1][None]
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=pv[1:2], image_sizes=sizes[1:2]).logits
    assert (ours(input_ids=ids, pixel_values=pv[1:2], image_sizes=sizes[1:2]) - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_cli_converts_at_tp2_pp2(hf_dir, tmp_path):
    """`--tp 2` and `--pp 2` spawn one process per rank; the result loads at TP=1/PP=1."""
    from mmtrain.llava_ov.load import load_llava_ov

    src, model = hf_dir
    rows, pv, sizes = hf_image_inputs(images())
    ids = rows[0][None]
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=pv[:1], image_sizes=sizes[:1]).logits
    for tp, pp in ((2, 1), (1, 2)):
        dst = tmp_path / f"tp{tp}pp{pp}"
        assert (
            convert_cli(
                "hf-to-mcore",
                "--model",
                "llava-ov",
                "--src",
                str(src),
                "--dst",
                str(dst),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
            )
            == 0
        )
        ours = load_llava_ov(dst)
        assert (ours(input_ids=ids, pixel_values=pv[:1], image_sizes=sizes[:1]) - ref).abs().max().item() <= 1e-4


@pytest.mark.unit
def test_hf_dir_as_initial_checkpoint_checks_the_recipe(hf_dir):
    """`checkpoint.load: HF_DIR`: weights converted on the fly, a mismatching recipe is named."""
    from dataclasses import replace

    from mmtrain.llava_ov.conversion import build_stage, llava_source
    from mmtrain.llava_ov.load import load_hf_into_model
    from mmtrain.models.state_dict_adapter import ConversionError
    from mmtrain.runtime.distributed import ensure_model_parallel

    src, model = hf_dir
    ensure_model_parallel(1, 1)
    cfg, _ = llava_source(src)
    ours = build_stage(cfg)
    load_hf_into_model([ours], src, cfg)
    assert torch.equal(ours.image_newline, model.model.image_newline)
    bad = replace(cfg, llm=replace(cfg.llm, num_layers=3))
    with pytest.raises(ConversionError, match=r"model\.llm"):
        load_hf_into_model([ours], src, bad)


def test_weights_io_latest_fallback_and_config_mismatch(converted, tmp_path):
    import shutil
    from dataclasses import replace

    from mmtrain.config import RecipeError
    from mmtrain.config.typed import from_plain
    from mmtrain.llava_ov.config import ARCHITECTURE_KEYS, LlavaOVModelConfig
    from mmtrain.llava_ov.conversion import saved_model_config
    from mmtrain.runtime.checkpoint.layout import find_latest_iteration
    from mmtrain.runtime.checkpoint.weights import CheckpointMismatchError, check_architecture

    copy = tmp_path / "ck"
    shutil.copytree(converted, copy)
    (copy / "latest").unlink()
    shutil.copytree(copy / "iter_0000000", copy / "iter_0000007")
    assert find_latest_iteration(copy) == 7
    assert find_latest_iteration(tmp_path / "nothing_here") is None
    cfg = saved_model_config(copy)
    check_architecture(copy, replace(cfg, params_dtype="bfloat16", max_tiles=4), ARCHITECTURE_KEYS)  # not architecture
    with pytest.raises(CheckpointMismatchError, match=r"model\.vision\.num_layers"):
        check_architecture(copy, replace(cfg, vision=replace(cfg.vision, num_layers=3)), ARCHITECTURE_KEYS)
    with pytest.raises(RecipeError, match="llm.bogus"):
        from_plain(LlavaOVModelConfig, {"llm": {"bogus": 1}}, "model_config.yaml")


# ----------------------------------------------------------------------------- dtype through the round trip


@pytest.fixture(scope="module")
def hf_dir_bf16(tmp_path_factory):
    """The `hf_dir` model stored in bf16, as the published LLaVA checkpoints are."""
    d = tmp_path_factory.mktemp("hf_bf16")
    model = hf_llava(seed=1).to(torch.bfloat16)
    model.save_pretrained(d)
    return d, model


@pytest.fixture(scope="module")
def converted_bf16(hf_dir_bf16, tmp_path_factory):
    dst = tmp_path_factory.mktemp("ckpt_bf16")
    assert convert_cli("hf-to-mcore", "--model", "llava-ov", "--src", str(hf_dir_bf16[0]), "--dst", str(dst)) == 0
    return dst


@pytest.mark.parametrize("source,dtype", [("", torch.float32), ("_bf16", torch.bfloat16)], ids=["fp32", "bf16"])
def test_round_trip_keeps_the_source_dtype(request, source, dtype, tmp_path):
    """hf-to-mcore stores (and records) the source's dtype, mcore-to-hf writes it back, bit for
    bit, with config.json saying it; a bf16 export is half the size of an fp32 one."""
    from mmtrain.llava_ov.conversion import saved_model_config
    from mmtrain.runtime.hf_conversion import stored_dtype

    src, _ = request.getfixturevalue("hf_dir" + source)
    ckpt = request.getfixturevalue("converted" + source)
    name = str(dtype).removeprefix("torch.")
    assert saved_model_config(ckpt).params_dtype == name == stored_dtype(ckpt)
    out = tmp_path / "out"
    assert convert_cli("mcore-to-hf", "--model", "llava-ov", "--src", str(ckpt), "--dst", str(out)) == 0
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b) and all(b[k].dtype == a[k].dtype == dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text())["dtype"] == name
    size = (out / "model.safetensors").stat().st_size
    assert abs(size - (src / "model.safetensors").stat().st_size) < 0.02 * size
    if dtype == torch.bfloat16:
        fp32_size = (request.getfixturevalue("hf_dir")[0] / "model.safetensors").stat().st_size
        assert size < 0.55 * fp32_size


def test_dtype_flag_chooses_another_dtype_both_ways(hf_dir_bf16, converted_bf16, tmp_path):
    from transformers import LlavaOnevisionForConditionalGeneration

    from mmtrain.llava_ov.conversion import saved_model_config
    from mmtrain.runtime.hf_conversion import stored_dtype

    src, _ = hf_dir_bf16
    out = tmp_path / "fp32"
    assert (
        convert_cli(
            "mcore-to-hf", "--model", "llava-ov", "--src", str(converted_bf16), "--dst", str(out), "--dtype", "float32"
        )
        == 0
    )
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(b[k].dtype == torch.float32 and torch.equal(a[k].float(), b[k]) for k in a)  # bf16 -> fp32 is exact
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert LlavaOnevisionForConditionalGeneration.from_pretrained(out).dtype == torch.float32

    ckpt = tmp_path / "ck32"
    assert (
        convert_cli("hf-to-mcore", "--model", "llava-ov", "--src", str(src), "--dst", str(ckpt), "--dtype", "float32")
        == 0
    )
    assert saved_model_config(ckpt).params_dtype == "float32" == stored_dtype(ckpt)
    with pytest.raises(SystemExit):
        convert_cli(
            "mcore-to-hf", "--model", "llava-ov", "--src", str(ckpt), "--dst", str(tmp_path / "x"), "--dtype", "int8"
        )


def test_export_of_a_bf16_training_checkpoint_is_bf16(hf_dir_bf16, converted_bf16, tmp_path):
    """A bf16 training saves bf16 weights with the recipe's model config (params_dtype float32 by
    default, parallel.precision=bf16): the export follows the stored weights, not that key."""
    from dataclasses import replace

    from mmtrain.llava_ov.config import LlavaOVModelConfig
    from mmtrain.llava_ov.conversion import build_stage
    from mmtrain.runtime.checkpoint.weights import save_model_weights
    from mmtrain.runtime.hf_conversion import load_unsharded

    cfg, model = load_unsharded(converted_bf16, LlavaOVModelConfig, build_stage, params_dtype="bfloat16")
    run = tmp_path / "checkpoints"
    save_model_weights([model], run, iteration=5, model_config=replace(cfg, params_dtype="float32"))
    out = tmp_path / "hf"
    assert convert_cli("mcore-to-hf", "--model", "llava-ov", "--src", str(run), "--dst", str(out)) == 0
    a, b = load_file(hf_dir_bf16[0] / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
