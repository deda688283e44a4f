"""The "llava-ov" FamilySpec: what the shared runtime needs to train, plan, convert and load
LLaVA-OneVision. Imported by the registry (so by the CLI): model, loader and conversion code is
reached inside the functions below, never at import time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmdata.energon_loaders.llava_ov.batch import LlavaOVBatch
from mmtrain.config.schema import Recipe
from mmtrain.llava_ov.config import ARCHITECTURE_KEYS, LlavaOVDataConfig, LlavaOVModelConfig, check_recipe
from mmtrain.models.shapes import Connector, DecoderShape, EncoderShape, ModelShapes
from mmtrain.llava_ov import generate_cli
from mmtrain.spec import FamilySpec, GenerationSpec, HFConversion

#: trainable parts -> the LlavaOVModel attributes they own (image_newline trains with the LLM)
PARTS = {
    "vision_tower": ("vision_model",),
    "projector": ("vision_projection",),
    "llm": ("language_model", "image_newline"),
}


def build_model(model_config: LlavaOVModelConfig, *, pre_process: bool = True, post_process: bool = True,
                options: Any = None, vp_stage: int | None = None):
    from mmtrain.llava_ov.model import LlavaOVModel

    return LlavaOVModel(model_config, pre_process=pre_process, post_process=post_process,
                        options=options, vp_stage=vp_stage)


def forward_step(data_iterator: Any, model: Any) -> Any:
    from mmtrain.llava_ov.forward_step import forward_step as step

    return step(data_iterator, model)


def build_loader(recipe: Recipe, *, dp_rank: int = 0, dp_size: int = 1):
    """The energon loader with the model's own vision geometry."""
    from mmdata.energon_loaders.llava_ov.loader import build_llava_ov_loader

    m: LlavaOVModelConfig = recipe.model
    d: LlavaOVDataConfig = recipe.data
    loader = build_llava_ov_loader(
        d.paths, recipe.tokenizer.path, seq_length=recipe.train.seq_length,
        micro_batch_size=recipe.train.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
        num_workers=d.num_workers, seed=recipe.seed, max_tiles=m.max_tiles, packing=d.packing,
        packing_plan=d.packing_plan, packing_buffer_size=d.packing_buffer_size, shuffle_buffer_size=d.shuffle_buffer_size,
        image_size=m.vision.image_size, patch_size=m.vision.patch_size, grid_max=m.grid_max,
        max_video_frames=d.video_frames,
    )
    check_media_token_ids(m, loader.task_encoder.chat.image_token_id, loader.task_encoder.chat.video_token_id,
                          recipe.tokenizer.path)
    return loader


def media_token_problems(m: LlavaOVModelConfig, image_id: int | None, video_id: int | None,
                         tokenizer_path: str) -> list[str]:
    """The model finds media positions by token id: a tokenizer whose `<image>`/`<video>` ids
    differ from the ids a recipe pins would silently misplace image features."""
    return [
        f"model.{key}: {want}, but the tokenizer at {tokenizer_path} maps {tok} to {got} (set model.{key}={got} "
        "or leave it null to take the tokenizer's, or use the tokenizer the model was made with)"
        for key, want, tok, got in (
            ("image_token_id", m.image_token_id, "<image>", image_id),
            ("video_token_id", m.video_token_id, "<video>", video_id),
        )
        if want is not None and want != got
    ]


def check_media_token_ids(m: LlavaOVModelConfig, image_id: int, video_id: int, tokenizer_path: str) -> None:
    """Refuse (ValueError) what `media_token_problems` finds; the loader's last line of defence."""
    wrong = media_token_problems(m, image_id, video_id, tokenizer_path)
    if m.image_token_id is None or m.video_token_id is None:
        wrong.append("model.image_token_id / video_token_id are unresolved (the run's preflight reads them from "
                     f"the tokenizer at {tokenizer_path})")
    if wrong:
        raise ValueError("media token ids disagree: " + "; ".join(wrong))


def check_tokenizer(recipe: Recipe, tokenizer: Any) -> list[str]:
    """Before training (FamilySpec.check_tokenizer): the tokenizer's `<image>`/`<video>` ids, added
    as the loader adds them when the tokenizer lacks them, fill the recipe's null ids (logged) and
    must equal pinned ones, and an HF `checkpoint.load`'s ids (it is validated here, before any
    rank starts); the LLM's vocabulary rows must hold them."""
    import logging

    from mmdata.energon_loaders.llava_ov.chat_template import token_id
    from mmdata.energon_loaders.tiny_tokenizer import IMAGE_TOKEN, VIDEO_TOKEN
    from mmtrain.models.state_dict_adapter import ConversionError

    m: LlavaOVModelConfig = recipe.model
    added = prepare_tokenizer(tokenizer)
    image_id, video_id = token_id(tokenizer, IMAGE_TOKEN), token_id(tokenizer, VIDEO_TOKEN)
    problems = media_token_problems(m, image_id, video_id, recipe.tokenizer.path)
    if problems:
        return problems
    log = logging.getLogger(__name__)
    if added:
        log.info("tokenizer at %s has no %s: added as special token(s) (as the loader does)", recipe.tokenizer.path,
                 " / ".join(added))
    if m.image_token_id is None or m.video_token_id is None:
        log.info("model.image_token_id=%d, model.video_token_id=%d: from the tokenizer at %s", image_id, video_id,
                 recipe.tokenizer.path)
    m.image_token_id, m.video_token_id = image_id, video_id
    load = recipe.checkpoint.load
    try:
        hf_start = _hf_start(load)
    except ConversionError as err:
        return [f"checkpoint.load: {err}"]
    if hf_start is not None and (hf_start.image_token_id, hf_start.video_token_id) != (image_id, video_id):
        return [f"checkpoint.load: {load} has <image>/<video> at ids {hf_start.image_token_id}/{hf_start.video_token_id}, "
                f"the tokenizer at {recipe.tokenizer.path} at {image_id}/{video_id} (train with the checkpoint's own "
                f"tokenizer: tokenizer.path={load})"]
    if max(image_id, video_id) >= m.llm.vocab_size:
        have = hf_start.llm.vocab_size if hf_start is not None else _saved_rows(load)
        return [vocab_too_small(m.llm.vocab_size, max(image_id, video_id) + 1, len(tokenizer), recipe, have)]
    return []


def vocab_too_small(rows: int, need_ids: int, tokenizer_len: int, recipe: Recipe, have: int | None) -> str:
    """The refusal of a run whose tokenizer ids exceed the embedding rows, with what fixes it for
    where the run starts from (`have`: the rows `checkpoint.load` gives, when known). Rows are not
    grown at training start from a megatron checkpoint: the weights would silently differ from the
    checkpoint the recipe names; conversion (and an HF `checkpoint.load`, converted on the fly)
    grows them, logged and reproducible, and the recipe states the size it trains."""
    need = max(need_ids, tokenizer_len)
    load = recipe.checkpoint.load
    head = (f"model.llm.vocab_size: {rows} rows cannot hold the tokenizer's <image>/<video> ids (the tokenizer at "
            f"{recipe.tokenizer.path}, {tokenizer_len} tokens, needs {need} rows): ")
    stage1 = ("`mmtrain convert hf-to-mcore --model llava-ov --llm LLM_DIR --vision SIGLIP_DIR --dst CKPT_DIR` (adds the "
              f"rows, mean-initialised), then train with checkpoint.load=CKPT_DIR model.llm.vocab_size={need}")
    if load is None:
        return head + f"set model.llm.vocab_size={need} for a fresh model, or start from a Qwen2 LLM + SigLIP with {stage1}"
    if have is not None and have >= need:
        return head + f"checkpoint.load {load} holds {have} rows (media rows included): set model.llm.vocab_size={have}"
    own = load if (Path(load) / "config.json").is_file() else Path(load) / "hf_assets"
    return head + (f"checkpoint.load {load} was made for another tokenizer: train with its own (tokenizer.path={own}), "
                   f"or for a stage-1 start from an LLM whose tokenizer lacks the media tokens use {stage1}")


def _hf_start(load: str | None) -> LlavaOVModelConfig | None:
    """The model config of an HF `checkpoint.load` as it will be loaded (media rows added for a
    LLaVA-NeXT checkpoint; its tensors and config keys validated): refused here, before any rank
    starts. None for no or a megatron starting point (preflight checks those)."""
    from mmtrain.runtime.checkpoint.layout import resolve_checkpoint

    try:
        kind, point = resolve_checkpoint(load) if load else (None, None)
    except FileNotFoundError:
        return None  # reported by preflight's starting-point check
    if kind != "hf":
        return None
    from mmtrain.llava_ov.conversion import llava_source

    return llava_source(point)[0]


def _saved_rows(load: str | None) -> int | None:
    """The embedding rows of a megatron `checkpoint.load`, from its saved model config."""
    from mmtrain.runtime.checkpoint.layout import iteration_of, resolve_checkpoint
    from mmtrain.runtime.checkpoint.weights import load_model_config_dict

    try:
        _, point = resolve_checkpoint(load)
        return int(load_model_config_dict(point.parent, iteration_of(point))["llm"]["vocab_size"])
    except (FileNotFoundError, OSError, KeyError, TypeError, ValueError):
        return None


def prepare_tokenizer(tokenizer: Any) -> list[str]:
    """What the loader does to the tokenizer (FamilySpec.prepare_tokenizer): `<image>`/`<video>`
    added when missing."""
    from mmdata.energon_loaders.llava_ov.chat_template import add_media_tokens

    return add_media_tokens(tokenizer)


def model_shapes(m: LlavaOVModelConfig) -> ModelShapes:
    """SigLIP encoder -> mlp2x_gelu projector (+ image_newline) -> Qwen2 decoder."""
    v, h = m.vision, m.llm.hidden_size
    projector_weights = v.hidden_size * h + h * h
    return ModelShapes(
        decoder=DecoderShape.from_llm(m.llm, m.make_vocab_size_divisible_by),
        decoder_part="llm",
        encoder=EncoderShape(v.num_layers, v.hidden_size, v.ffn_hidden_size, v.num_attention_heads,
                             v.image_size, v.patch_size, v.num_channels,
                             frozen_params=2 * v.hidden_size),  # ln_post: the features skip it (vision.py)
        encoder_part="vision_tower",
        connectors=(
            # its first linear reads the tower's output: input gradients only when the tower trains
            Connector("projector", projector_weights + (2 * h if m.projector.bias else 0), projector_weights,
                      input_matmul_params=v.hidden_size * h),
            Connector("llm", h),  # image_newline
        ),
    )


def encoder_inputs(batch: LlavaOVBatch) -> int:
    """Tiles/frames the vision tower encodes for a micro-batch (MFU), from a host field: no device read."""
    tiles = batch.tiles_per_media
    return int(tiles.sum()) if tiles is not None and tiles.numel() else 0


def _to_mcore(src: str, dst: str, *, tp: int, pp: int, dtype: str = "auto") -> LlavaOVModelConfig:
    from mmtrain.llava_ov.conversion import hf_to_mcore

    return hf_to_mcore(src, dst, tp=tp, pp=pp, dtype=dtype)


def _to_hf(src: str, dst: str, *, max_shard_bytes: int, format: str = "transformers", dtype: str = "auto") -> Path:
    from mmtrain.llava_ov.conversion import mcore_to_hf

    return mcore_to_hf(src, dst, max_shard_bytes, format=format, dtype=dtype)


def _assemble(dirs: dict[str, str], dst: str, *, tp: int, pp: int, dtype: str = "auto") -> LlavaOVModelConfig:
    from mmtrain.llava_ov.conversion import assemble_stage1

    return assemble_stage1(dirs["llm"], dirs["vision"], dst, tp=tp, pp=pp, dtype=dtype)


def _load_into_model(model_chunks: list, hf_dir: str, model_config: LlavaOVModelConfig) -> None:
    from mmtrain.llava_ov.load import load_hf_into_model

    load_hf_into_model(model_chunks, hf_dir, model_config)


LLAVA_OV = FamilySpec(
    name="llava-ov",
    help="a LLaVA-OneVision model (SigLIP + projector + Qwen2)",
    model_config_cls=LlavaOVModelConfig,
    data_config_cls=LlavaOVDataConfig,
    parts=PARTS,
    check_recipe=check_recipe,
    architecture_keys=ARCHITECTURE_KEYS,
    build_model=build_model,
    batch_type=LlavaOVBatch,
    build_loader=build_loader,
    forward_step=forward_step,
    model_shapes=model_shapes,
    encoder_inputs=encoder_inputs,
    sample_type=("mmdata.energon_loaders.sample.ConversationSample", "LLaVA image/text shards (mmdata preprocess)"),
    check_tokenizer=check_tokenizer,
    prepare_tokenizer=prepare_tokenizer,
    hf=HFConversion(
        to_mcore=_to_mcore,
        to_hf=_to_hf,
        load_into_model=_load_into_model,
        assemble_from={"llm": "Qwen2/2.5 HF dir with its tokenizer (the <image>/<video> ids come from it, "
                              "added when missing)",
                       "vision": "SigLIP HF dir (its last layer is dropped)"},
        assemble=_assemble,
        export_formats=("transformers", "llava-next"),
    ),
    generation=GenerationSpec(
        help="answers about an image (the checkpoint's own chat template and image layout)",
        usage=generate_cli.USAGE,
        add_arguments=generate_cli.add_arguments,
        prepare=generate_cli.prepare,
        sampling_defaults=generate_cli.SAMPLING_DEFAULTS,
        hf_model_types=("llava_onevision",),
    ),
)
