"""The "llava-ov" FamilySpec: what the shared runtime needs to train, plan, convert and load
LLaVA-OneVision. Imported by the registry (so by the CLI): model, loader, conversion and
generation code is named by `Ref("module:function")`, imported on first use."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmdata.energon_loaders.llava_ov.chat_template import add_media_tokens
from mmtrain.config.schema import Recipe
from mmtrain.llava_ov import generate_cli
from mmtrain.llava_ov.config import ARCHITECTURE_KEYS, LlavaOVDataConfig, LlavaOVModelConfig, check_recipe
from mmtrain.models.shapes import Connector, DecoderShape, EncoderShape, ModelShapes
from mmtrain.spec import FamilySpec, GenerationSpec, HFConversion, Ref

if TYPE_CHECKING:  # the batch module imports torch; the spec is imported at CLI start-up
    from mmdata.energon_loaders.llava_ov.batch import LlavaOVBatch

#: trainable parts -> the LlavaOVModel attributes they own (image_newline trains with the LLM)
PARTS = {
    "vision_tower": ("vision_model",),
    "projector": ("vision_projection",),
    "llm": ("language_model", "image_newline"),
}


#: (model config, *, pre_process, post_process, options, vp_stage) -> one PP stage (or model chunk)
build_model = Ref("mmtrain.llava_ov.model:LlavaOVModel")


def media_token_problems(
    m: LlavaOVModelConfig, image_id: int | None, video_id: int | None, tokenizer_path: str
) -> list[str]:
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
        wrong.append(
            "model.image_token_id / video_token_id are unresolved (the run's preflight reads them from "
            f"the tokenizer at {tokenizer_path})"
        )
    if wrong:
        raise ValueError("media token ids disagree: " + "; ".join(wrong))


def vocab_too_small(rows: int, need_ids: int, tokenizer_len: int, recipe: Recipe, have: int | None) -> str:
    """The refusal of a run whose tokenizer ids exceed the embedding rows, with what fixes it for
    where the run starts from (`have`: the rows `checkpoint.load` gives, when known). Rows are not
    grown at training start from a megatron checkpoint: the weights would silently differ from the
    checkpoint the recipe names; conversion (and an HF `checkpoint.load`, converted on the fly)
    grows them, logged and reproducible, and the recipe states the size it trains."""
    need = max(need_ids, tokenizer_len)
    load = recipe.checkpoint.load
    head = (
        f"model.llm.vocab_size: {rows} rows cannot hold the tokenizer's <image>/<video> ids (the tokenizer at "
        f"{recipe.tokenizer.path}, {tokenizer_len} tokens, needs {need} rows): "
    )
    stage1 = (
        "`mmtrain convert hf-to-mcore --model llava-ov --llm LLM_DIR --vision SIGLIP_DIR --dst CKPT_DIR` (adds the "
        f"rows, mean-initialised), then train with checkpoint.load=CKPT_DIR model.llm.vocab_size={need}"
    )
    if load is None:
        return (
            head
            + f"set model.llm.vocab_size={need} for a fresh model, or start from a Qwen2 LLM + SigLIP with {stage1}"
        )
    if have is not None and have >= need:
        return head + f"checkpoint.load {load} holds {have} rows (media rows included): set model.llm.vocab_size={have}"
    own = load if (Path(load) / "config.json").is_file() else Path(load) / "hf_assets"
    return head + (
        f"checkpoint.load {load} was made for another tokenizer: train with its own (tokenizer.path={own}), "
        f"or for a stage-1 start from an LLM whose tokenizer lacks the media tokens use {stage1}"
    )


def prepare_tokenizer(tokenizer: Any) -> list[str]:
    """What the loader does to the tokenizer (FamilySpec.prepare_tokenizer): `<image>`/`<video>`
    added when missing."""
    return add_media_tokens(tokenizer)


def model_shapes(m: LlavaOVModelConfig) -> ModelShapes:
    """SigLIP encoder -> mlp2x_gelu projector (+ image_newline) -> Qwen2 decoder."""
    v, h = m.vision, m.llm.hidden_size
    projector_weights = v.hidden_size * h + h * h
    return ModelShapes(
        decoder=DecoderShape.from_llm(m.llm, m.make_vocab_size_divisible_by),
        decoder_part="llm",
        encoder=EncoderShape(
            v.num_layers,
            v.hidden_size,
            v.ffn_hidden_size,
            v.num_attention_heads,
            v.image_size,
            v.patch_size,
            v.num_channels,
            frozen_params=2 * v.hidden_size,  # ln_post: the features skip it (vision.py)
            frozen_what="the unused post-layernorm (the features are the last kept layer's, "
            "un-normed); kept for HF round trips",
        ),
        encoder_part="vision_tower",
        connectors=(
            # its first linear reads the tower's output: input gradients only when the tower trains
            Connector(
                "projector",
                projector_weights + (2 * h if m.projector.bias else 0),
                projector_weights,
                input_matmul_params=v.hidden_size * h,
            ),
            Connector("llm", h),  # image_newline
        ),
    )


def encoder_inputs(batch: LlavaOVBatch) -> int:
    """Tiles/frames the vision tower encodes for a micro-batch (MFU), from a host field: no device read."""
    tiles = batch.tiles_per_media
    return int(tiles.sum()) if tiles is not None and tiles.numel() else 0


LLAVA_OV = FamilySpec(
    name="llava-ov",
    help="a LLaVA-OneVision model (SigLIP + projector + Qwen2)",
    model_config_cls=LlavaOVModelConfig,
    data_config_cls=LlavaOVDataConfig,
    parts=PARTS,
    check_recipe=check_recipe,
    architecture_keys=ARCHITECTURE_KEYS,
    build_model=build_model,
    batch_type=Ref("mmdata.energon_loaders.llava_ov.batch:LlavaOVBatch"),
    build_loader=Ref("mmtrain.llava_ov.loader:build_loader"),
    forward_step=Ref("mmtrain.llava_ov.forward_step:forward_step"),
    model_shapes=model_shapes,
    encoder_inputs=encoder_inputs,
    sample_type=("mmdata.energon_loaders.sample.ConversationSample", "LLaVA image/text shards (mmdata preprocess)"),
    check_tokenizer=Ref("mmtrain.llava_ov.tokenizer_check:check_tokenizer"),
    prepare_tokenizer=prepare_tokenizer,
    hf=HFConversion(
        to_mcore=Ref("mmtrain.llava_ov.conversion:hf_to_mcore"),
        to_hf=Ref("mmtrain.llava_ov.conversion:mcore_to_hf"),
        load_into_model=Ref("mmtrain.llava_ov.load:load_hf_into_model"),
        assemble_from={
            "llm": "Qwen2/2.5 HF dir with its tokenizer (the <image>/<video> ids come from it, added when missing)",
            "vision": "SigLIP HF dir (its last layer is dropped)",
        },
        assemble=Ref("mmtrain.llava_ov.conversion:assemble"),
        export_formats=("transformers", "llava-next"),
    ),
    generation=GenerationSpec.from_cli(
        generate_cli,
        help="answers about an image (the checkpoint's own chat template and image layout)",
        prepare=Ref("mmtrain.llava_ov.generate_job:prepare"),
        hf_model_types=("llava_onevision",),
    ),
)
