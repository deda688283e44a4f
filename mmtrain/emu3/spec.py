"""The "emu3" FamilySpec: what the shared runtime needs to train, plan, convert and load Emu3.
Imported by the registry (so by the CLI): model, loader, conversion and generation code is
named by `Ref("module:function")`, imported on first use."""

from __future__ import annotations

from mmtrain.emu3 import generate_cli
from mmtrain.emu3.config import ARCHITECTURE_KEYS, Emu3DataConfig, Emu3ModelConfig, check_recipe
from mmtrain.models.shapes import DecoderShape, ModelShapes
from mmtrain.spec import FamilySpec, GenerationSpec, HFConversion, Ref

#: one trainable part: the decoder (embedding, layers, final norm, output layer)
PARTS = {"llm": ("language_model",)}

#: (model config, *, pre_process, post_process, options, vp_stage) -> one PP stage (or model chunk)
build_model = Ref("mmtrain.emu3.model:Emu3Model")


def model_shapes(m: Emu3ModelConfig) -> ModelShapes:
    """One Llama-style decoder; images are tokens, so there is no encoder or connector."""
    return ModelShapes(decoder=DecoderShape.from_llm(m.llm, m.make_vocab_size_divisible_by), decoder_part="llm")


EMU3 = FamilySpec(
    name="emu3",
    help="an Emu3 model (Llama-style decoder over text and VQ image tokens)",
    model_config_cls=Emu3ModelConfig,
    data_config_cls=Emu3DataConfig,
    parts=PARTS,
    check_recipe=check_recipe,
    check_tokenizer=Ref("mmtrain.emu3.tokenizer_check:check_tokenizer"),
    architecture_keys=ARCHITECTURE_KEYS,
    build_model=build_model,
    batch_type=Ref("mmdata.energon_loaders.emu3.batch:Emu3Batch"),
    build_loader=Ref("mmtrain.emu3.loader:build_loader"),
    forward_step=Ref("mmtrain.runtime.loss:packed_forward_step"),
    model_shapes=model_shapes,
    sample_type=(
        "mmdata.energon_loaders.emu3.vq_token_sample.VQTokenSample",
        "Emu3 VQ token shards (mmdata tokenize-images)",
    ),
    hf=HFConversion(
        to_mcore=Ref("mmtrain.emu3.conversion:hf_to_mcore"),
        to_hf=Ref("mmtrain.emu3.conversion:mcore_to_hf"),
        load_into_model=Ref("mmtrain.emu3.load:load_hf_into_model"),
        export_from={
            "vq": "the VQ model (an Emu3VQVAE dir or an HF Emu3 dir) when the checkpoint keeps none",
            "tokenizer": "the Emu3 tokenizer dir (vocabulary map, tokenizer files) when the checkpoint keeps none",
        },
    ),
    generation=GenerationSpec.from_cli(
        generate_cli,
        help="text-to-image with batched classifier-free guidance, decoded to PNG by the VQ model",
        prepare=Ref("mmtrain.emu3.generate_job:prepare"),
        hf_model_types=("emu3",),
    ),
)
