"""The "emu3" FamilySpec: what the shared runtime needs to train, plan, convert and load Emu3.
Imported by the registry (so by the CLI): model, loader and conversion code is reached inside
the functions below, never at import time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmdata.energon_loaders.emu3.batch import Emu3Batch
from mmtrain.config.schema import Recipe
from mmtrain.emu3.config import ARCHITECTURE_KEYS, Emu3DataConfig, Emu3ModelConfig, check_recipe
from mmtrain.models.shapes import DecoderShape, ModelShapes
from mmtrain.emu3 import generate_cli
from mmtrain.spec import FamilySpec, GenerationSpec, HFConversion

#: one trainable part: the decoder (embedding, layers, final norm, output layer)
PARTS = {"llm": ("language_model",)}


def build_model(model_config: Emu3ModelConfig, *, pre_process: bool = True, post_process: bool = True,
                options: Any = None, vp_stage: int | None = None):
    from mmtrain.emu3.model import Emu3Model

    return Emu3Model(model_config, pre_process=pre_process, post_process=post_process, options=options,
                     vp_stage=vp_stage)


def forward_step(data_iterator: Any, model: Any) -> Any:
    from mmtrain.runtime.loss import packed_forward_step

    return packed_forward_step(data_iterator, model)


def build_loader(recipe: Recipe, *, dp_rank: int = 0, dp_size: int = 1):
    """The energon loader over token shards with the recipe's task mix."""
    from mmdata.energon_loaders.emu3.loader import build_emu3_loader

    d: Emu3DataConfig = recipe.data
    loader = build_emu3_loader(
        d.paths, recipe.tokenizer.path, seq_length=recipe.train.seq_length,
        micro_batch_size=recipe.train.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
        num_workers=d.num_workers, seed=recipe.seed, packing=d.packing, packing_plan=d.packing_plan,
        packing_buffer_size=d.packing_buffer_size, shuffle_buffer_size=d.shuffle_buffer_size,
        encoder=dict(tasks=dict(d.tasks), p_uncond=d.p_uncond, uncond_prompt=d.uncond_prompt,
                     system_prompt=d.system_prompt),
    )
    check_tokenizer_fits(recipe.model, len(loader.task_encoder.tasks.tokenizer), recipe.tokenizer.path)
    return loader


def check_tokenizer_fits(m: Emu3ModelConfig, tokenizer_size: int, tokenizer_path: str) -> None:
    """Every id the tokenizer can produce (text, specials, visual tokens) needs a row of the
    model's vocabulary: refuse a tokenizer larger than `model.llm.vocab_size` before training."""
    if tokenizer_size > m.llm.vocab_size:
        raise ValueError(f"the tokenizer at {tokenizer_path} has {tokenizer_size} tokens but model.llm.vocab_size is "
                         f"{m.llm.vocab_size}; use the model's own tokenizer (or a larger vocab_size)")


def model_shapes(m: Emu3ModelConfig) -> ModelShapes:
    """One Llama-style decoder; images are tokens, so there is no encoder or connector."""
    return ModelShapes(decoder=DecoderShape.from_llm(m.llm, m.make_vocab_size_divisible_by), decoder_part="llm")


def _to_mcore(src: str, dst: str, *, tp: int, pp: int, dtype: str = "auto") -> Emu3ModelConfig:
    from mmtrain.emu3.conversion import hf_to_mcore

    return hf_to_mcore(src, dst, tp=tp, pp=pp, dtype=dtype)


def _to_hf(src: str, dst: str, *, max_shard_bytes: int, vq: str | None = None, tokenizer: str | None = None,
           dtype: str = "auto") -> Path:
    from mmtrain.emu3.conversion import mcore_to_hf

    return mcore_to_hf(src, dst, max_shard_bytes, vq=vq, tokenizer=tokenizer, dtype=dtype)


def _load_into_model(model_chunks: list, hf_dir: str, model_config: Emu3ModelConfig) -> None:
    from mmtrain.emu3.load import load_hf_into_model

    load_hf_into_model(model_chunks, hf_dir, model_config)


EMU3 = FamilySpec(
    name="emu3",
    help="an Emu3 model (Llama-style decoder over text and VQ image tokens)",
    model_config_cls=Emu3ModelConfig,
    data_config_cls=Emu3DataConfig,
    parts=PARTS,
    check_recipe=check_recipe,
    architecture_keys=ARCHITECTURE_KEYS,
    build_model=build_model,
    batch_type=Emu3Batch,
    build_loader=build_loader,
    forward_step=forward_step,
    model_shapes=model_shapes,
    sample_type=("mmdata.energon_loaders.vq_token_sample.VQTokenSample",
                 "Emu3 VQ token shards (mmdata tokenize-images)"),
    hf=HFConversion(
        to_mcore=_to_mcore,
        to_hf=_to_hf,
        load_into_model=_load_into_model,
        export_from={
            "vq": "the VQ model (an Emu3VQVAE dir or an HF Emu3 dir) when the checkpoint keeps none",
            "tokenizer": "the Emu3 tokenizer dir (vocabulary map, tokenizer files) when the checkpoint keeps none",
        },
    ),
    generation=GenerationSpec(
        help="text-to-image with batched classifier-free guidance, decoded to PNG by the VQ model",
        usage=generate_cli.USAGE,
        add_arguments=generate_cli.add_arguments,
        prepare=generate_cli.prepare,
        sampling_defaults=generate_cli.SAMPLING_DEFAULTS,
        hf_model_types=("emu3",),
    ),
)
