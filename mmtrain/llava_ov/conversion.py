"""HF <-> megatron checkpoint conversion for LLaVA-OV (library behind `mmtrain convert`): the
LLaVA-OV sources (a whole checkpoint in the transformers or the LLaVA-NeXT format, told apart by
its config.json; a Qwen2 LLM + SigLIP for stage 1) and the HF config on export (either format),
run by the shared machinery in mmtrain/runtime/hf_conversion.py (any TP/PP, streaming).

Media token ids come from the source's tokenizer; one without `<image>`/`<video>` gets them
added (media_tokens.py), and the resolved tokenizer is kept with the converted weights.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
from transformers import (
    AutoTokenizer,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
)

from mmdata.energon_loaders.llava_ov.chat_template import add_media_tokens, token_id
from mmtrain.llava_ov.config import LlavaOVModelConfig
from mmtrain.llava_ov.llava_next import (
    LLAVA_NEXT,
    TRANSFORMERS,
    LlavaNextStateDictAdapter,
    apply_tokenizer_settings,
    detect_format,
    llava_next_config,
    llava_next_hf_config,
)
from mmtrain.llava_ov.media_tokens import (
    MediaTokens,
    check_config_media_ids,
    grow_rows,
    resolve_media_tokens,
    vocab_rows_for,
)
from mmtrain.llava_ov.model import LlavaOVModel
from mmtrain.llava_ov.state_dict_adapter import (
    LlavaOVStateDictAdapter,
    SiglipStateDictAdapter,
    hf_config_from_llava,
    llava_config_from_hf,
    vision_config_from_hf,
)
from mmtrain.models.hf_io import SafetensorsReader, read_config
from mmtrain.models.megatron_config import ParallelOptions
from mmtrain.models.state_dict_adapter import ConversionError, Qwen2StateDictAdapter, llm_config_from_hf
from mmtrain.runtime import hf_conversion

log = logging.getLogger(__name__)

#: SigLIP's normalisation (the released LLaVA-OneVision processors')
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
#: the chat template of an export without a recorded one: the Qwen2 ChatML our loader trains on
#: (mmdata/energon_loaders/llava_ov/chat_template.py: default system prompt, `<image>`/`<video>`
#: placeholders, one per media item, before the turn's text), for typed or plain-string content
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% "
    "endif %}"
)

#: what transformers' AutoProcessor needs beyond the project's CPU venv: its LlavaOnevisionVideoProcessor
#: imports torchvision, which must be the build of the installed torch (PyPI's Linux wheels are CUDA
#: builds that do not import beside a CPU torch: "operator torchvision::nms does not exist")
TORCHVISION_HINT = (
    "the torchvision paired with the installed torch, from the index torch came from: for the "
    "Makefile's CPU torch 2.13.0, pip install torchvision==0.28.0 --index-url "
    "https://download.pytorch.org/whl/cpu; docs/conversion.md"
)

PROCESSOR_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def processor_chat_template(d: Path) -> Optional[str]:
    """The processor's chat template saved in `d`, if any."""
    jinja, js = d / PROCESSOR_TEMPLATE_FILES[0], d / PROCESSOR_TEMPLATE_FILES[1]
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if js.is_file():
        return json.loads(js.read_text(encoding="utf-8")).get("chat_template")
    return None


# ----------------------------------------------------------------------------- building


def build_stage(cfg: LlavaOVModelConfig, options: Optional[ParallelOptions] = None):
    """The LlavaOVModel of this rank's pipeline stage."""
    return hf_conversion.build_pipeline_stage(LlavaOVModel, cfg, options)


def saved_model_config(ckpt_dir: str | os.PathLike, iteration: Optional[int] = None) -> LlavaOVModelConfig:
    """The model config stored next to a checkpoint's weights, validated like a recipe section."""
    return hf_conversion.saved_model_config(ckpt_dir, LlavaOVModelConfig, iteration)


def tied_source(cfg: LlavaOVModelConfig) -> Optional[str]:
    return "language_model.embedding.word_embeddings.weight" if cfg.llm.tie_word_embeddings else None


# ----------------------------------------------------------------------------- HF sources


def llava_source(hf_dir: str | os.PathLike) -> tuple[LlavaOVModelConfig, Callable[[str], torch.Tensor]]:
    """A whole LLaVA-OV HF dir, either format -> (config, canonical-megatron-tensor getter),
    keys validated."""
    hf = read_config(hf_dir)
    if detect_format(hf, f"{hf_dir}/config.json") == LLAVA_NEXT:
        return llava_next_source(hf_dir, hf)
    cfg = llava_config_from_hf(hf)
    check_config_media_ids(hf_dir, cfg.image_token_id, cfg.video_token_id)
    adapter = LlavaOVStateDictAdapter(cfg)
    reader = SafetensorsReader(hf_dir, adapter.normalize_hf_key)
    adapter.check_hf_keys(reader.keys())
    return cfg, lambda name: adapter.mcore_tensor(name, reader.get)


def _growing(get: Callable[[str], Optional[torch.Tensor]], vocab_rows: int) -> Callable[[str], Optional[torch.Tensor]]:
    """`get` whose embedding / output tensors grow to `vocab_rows` (media tokens added)."""

    def grown(name: str) -> Optional[torch.Tensor]:
        t = get(name)
        if t is not None and name.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
            t = grow_rows(t, vocab_rows, name)
        return t

    return grown


def llava_next_source(hf_dir: str | os.PathLike, hf: Optional[dict] = None):
    """A LLaVA-NeXT-format dir (`LlavaQwenForCausalLM`) -> (config, getter); the media ids come
    from its tokenizer (added when missing, the vocabulary rows grown to hold them)."""
    hf = hf if hf is not None else read_config(hf_dir)
    tokens = resolve_media_tokens(hf_dir)
    reader = SafetensorsReader(hf_dir)
    # the embedding's own rows (a config's vocab_size may count the tokenizer, not the padded table)
    embed = "model.embed_tokens.weight"
    embed_rows = reader.shape(embed)[0] if embed in reader.keys() else int(hf["vocab_size"])
    rows = vocab_rows_for(tokens, embed_rows)
    cfg, stored = llava_next_config(
        hf, Path(hf_dir), reader.keys(), tokens.image_token_id, tokens.video_token_id, rows, f"{hf_dir}/config.json"
    )
    adapter = LlavaNextStateDictAdapter(cfg, stored)
    adapter.check_hf_keys(reader.keys())
    return cfg, _growing(lambda name: adapter.mcore_tensor(name, reader.get), rows)


def source_tokens(hf_dir: str | os.PathLike) -> Optional[MediaTokens]:
    """The resolved tokenizer to keep with a conversion: a LLaVA-NeXT source's (its media ids come
    from it; its config's tokenizer_* settings applied), or a transformers source's when media
    tokens had to be added to it (else its own files are kept as they are)."""
    hf = read_config(hf_dir)
    if detect_format(hf) == LLAVA_NEXT:
        tokens = resolve_media_tokens(hf_dir)
        apply_tokenizer_settings(tokens.tokenizer, hf, f"{hf_dir}/config.json")
        return tokens
    cfg = llava_config_from_hf(hf)
    tokens = check_config_media_ids(hf_dir, cfg.image_token_id, cfg.video_token_id)
    return tokens if tokens is not None and tokens.added else None


def stage1_source(
    llm_dir: str | os.PathLike,
    vision_dir: str | os.PathLike,
    base: Optional[LlavaOVModelConfig] = None,
    drop_last_vision_layers: int = 1,
):
    """Qwen2 LLM + SigLIP -> (config, getter); projector and image_newline keep their fresh init
    (getter returns None for them)."""
    text = read_config(llm_dir)
    archs = text.get("architectures") or []
    if text.get("model_type") != "qwen2" or (archs and "Qwen2ForCausalLM" not in archs):
        raise ConversionError(
            f"{llm_dir}/config.json: model_type={text.get('model_type')!r} architectures={archs}: expected a "
            f"Qwen2ForCausalLM"
        )
    vis = read_config(vision_dir)
    if vis.get("model_type") == "siglip":
        vis = vis["vision_config"] | {"model_type": "siglip_vision_model"}
    src_layers = int(vis["num_hidden_layers"])
    keep = src_layers - drop_last_vision_layers
    base = base or LlavaOVModelConfig()
    llm_cfg = llm_config_from_hf(text, "config")
    tokens = resolve_media_tokens(llm_dir)  # the media ids: the LLM tokenizer's (added when missing)
    llm_cfg = replace(llm_cfg, vocab_size=vocab_rows_for(tokens, llm_cfg.vocab_size))
    base = replace(base, image_token_id=tokens.image_token_id, video_token_id=tokens.video_token_id)
    cfg = replace(base, llm=llm_cfg, vision=vision_config_from_hf(vis, keep, "config"))
    llm_reader = SafetensorsReader(llm_dir)
    llm_ad = Qwen2StateDictAdapter(cfg.llm, "language_model.")
    llm_ad.check_hf_keys(llm_reader.keys())
    vis_ad = SiglipStateDictAdapter(cfg.vision, "vision_model.", source_layers=src_layers)
    vis_reader = SafetensorsReader(vision_dir, vis_ad.normalize_hf_key)
    vis_ad.check_hf_keys(vis_reader.keys())

    def get(name: str):
        if name.startswith("language_model."):
            return llm_ad.mcore_tensor(name, llm_reader.get)
        if name.startswith("vision_model."):
            return vis_ad.mcore_tensor(name, vis_reader.get)
        return None  # projector / image_newline: freshly initialised

    return cfg, _growing(get, cfg.llm.vocab_size)


# ----------------------------------------------------------------------------- hf -> mcore


def _whole_source(args: dict):
    cfg, get = llava_source(args["src"])
    return cfg, get, tied_source(cfg)


def _stage1_source(args: dict):
    cfg, get = stage1_source(args["llm"], args["vision"], args.get("base"))
    return cfg, get, tied_source(cfg)


def hf_to_mcore(
    src: str | os.PathLike, dst: str | os.PathLike, tp: int = 1, pp: int = 1, dtype: str = "auto"
) -> LlavaOVModelConfig:
    """`dtype`: the megatron weights' (auto: the source's, recorded as the saved params_dtype)."""
    cfg, _ = llava_source(src)  # validate before starting any rank
    # a whole LLaVA-OV checkpoint fills every weight: no random init
    cfg = hf_conversion.import_weights(
        cfg, _whole_source, {"src": str(src)}, build_stage, dst, tp, pp, dtype=dtype, dtype_from=src
    )
    assets = hf_conversion.record_source(dst, [src], read_config(src))
    _keep_tokenizer(source_tokens(src), assets)
    return cfg


def _keep_tokenizer(tokens: Optional[MediaTokens], assets: Path) -> None:
    """The resolved tokenizer (media tokens present) replaces the source's copied one."""
    if tokens is not None:
        tokens.tokenizer.save_pretrained(str(assets))


def assemble_stage1(
    llm: str | os.PathLike,
    vision: str | os.PathLike,
    dst: str | os.PathLike,
    tp: int = 1,
    pp: int = 1,
    base: Optional[LlavaOVModelConfig] = None,
    dtype: str = "auto",
) -> LlavaOVModelConfig:
    """`dtype`: the megatron weights' (auto: the LLM's, which holds most of them)."""
    cfg, _ = stage1_source(llm, vision, base)
    # the stage-1 getter returns None for the projector / image_newline: they keep their init
    args = {"llm": str(llm), "vision": str(vision), "base": base}
    cfg = hf_conversion.import_weights(
        cfg, _stage1_source, args, build_stage, dst, tp, pp, dtype=dtype, dtype_from=llm, fresh_init=True
    )
    assets = hf_conversion.record_source(dst, [vision, llm], None)
    _keep_tokenizer(resolve_media_tokens(llm), assets)
    return cfg


# ----------------------------------------------------------------------------- mcore -> hf


def assemble(
    dirs: dict[str, str], dst: str | os.PathLike, *, tp: int = 1, pp: int = 1, dtype: str = "auto"
) -> LlavaOVModelConfig:
    """`HFConversion.assemble`: `--llm DIR --vision DIR` given to `mmtrain convert` -> `assemble_stage1`."""
    return assemble_stage1(dirs["llm"], dirs["vision"], dst, tp=tp, pp=pp, dtype=dtype)


def mcore_to_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    max_shard_bytes: int = 2 * 1024**3,
    format: str = TRANSFORMERS,
    dtype: str = "auto",
) -> Path:
    """Single process: load at TP=1/PP=1 (dist-checkpoint reshards), stream out HF safetensors in
    `format` (transformers' LlavaOnevisionForConditionalGeneration, or LLaVA-NeXT's
    LlavaQwenForCausalLM). The recorded source config is the template when it has that format.
    `dtype`: the tensors' and config.json's (auto: the dtype the megatron weights are stored in)."""
    cfg, model, out_dtype = hf_conversion.load_for_export(src, LlavaOVModelConfig, build_stage, dtype)
    template = hf_conversion.source_config(src)
    if template is not None and detect_format(template) != format:
        template = None
    if format == LLAVA_NEXT:
        adapter, hf_cfg = LlavaNextStateDictAdapter(cfg), llava_next_hf_config(cfg, template)
    else:
        adapter, hf_cfg = LlavaOVStateDictAdapter(cfg), hf_config_from_llava(cfg, template)
    dtype_key = "torch_dtype" if format == LLAVA_NEXT else "dtype"
    dst, hf_cfg = hf_conversion.write_hf_dir(
        src, dst, model, adapter, cfg.llm.vocab_size, hf_cfg, out_dtype, max_shard_bytes, dtype_key=dtype_key
    )
    if format == TRANSFORMERS:
        write_processor(cfg, hf_cfg, dst)
    return dst


# ----------------------------------------------------------------------------- the HF processor


def image_processor(cfg: LlavaOVModelConfig, hf_cfg: dict):
    """transformers' LLaVA-OneVision image processor for this model: its tower's image size,
    the anyres grid pinpoints of its config, SigLIP's mean/std (the PIL implementation: it saves
    as `LlavaOnevisionImageProcessor`, which loads as the fast one where torchvision is)."""
    size = cfg.vision.image_size
    return LlavaOnevisionImageProcessorPil(
        image_mean=list(SIGLIP_MEAN),
        image_std=list(SIGLIP_STD),
        size={"height": size, "width": size},
        image_grid_pinpoints=[list(p) for p in hf_cfg["image_grid_pinpoints"]],
    )


def processor_settings(cfg: LlavaOVModelConfig, hf_cfg: dict) -> dict:
    """`LlavaOnevisionProcessor`'s own arguments: the base tile's features, how they are
    selected, the tiling cap (e.g. anyres_max_9), the media tokens."""
    return {
        "num_image_tokens": (cfg.vision.image_size // cfg.vision.patch_size) ** 2,
        "vision_feature_select_strategy": hf_cfg.get("vision_feature_select_strategy", "full"),
        "vision_aspect_ratio": hf_cfg.get("vision_aspect_ratio", f"anyres_max_{cfg.max_tiles}"),
        "image_token": "<image>",
        "video_token": "<video>",
    }


def _export_tokenizer(cfg: LlavaOVModelConfig, dst: Path):
    """The export's tokenizer (the recorded one, copied into `dst`) with `<image>`/`<video>` at
    the model's ids and a chat template; None (logged) when `dst` has no loadable tokenizer."""
    try:
        tok = AutoTokenizer.from_pretrained(str(dst))
    except (OSError, ValueError, TypeError) as exc:
        log.warning(
            "%s: no loadable tokenizer (%s): the processor files are written without one",
            dst,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return None
    add_media_tokens(tok)
    ids = (token_id(tok, "<image>"), token_id(tok, "<video>"))
    if ids != (cfg.image_token_id, cfg.video_token_id):
        raise ConversionError(
            f"{dst}: the tokenizer's <image>/<video> ids {ids} are not the model's "
            f"({cfg.image_token_id}, {cfg.video_token_id})"
        )
    return tok


def renders_media_parts(tok, template: str) -> bool:
    """Whether `template` takes a processor's message form (content a list of typed parts) and
    writes its image and video parts as `<image>` / `<video>`, as LLaVA-OneVision's does."""
    parts = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "?"}]
    try:
        text = tok.apply_chat_template(
            [{"role": "user", "content": parts}], chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a string-content template fails in Jinja (str + list)
        return False
    return "<image>" in text and "<video>" in text


def write_processor(cfg: LlavaOVModelConfig, hf_cfg: dict, dst: Path) -> None:
    """What `LlavaOnevisionProcessor.save_pretrained` writes, so `AutoProcessor.from_pretrained(dst)`
    works: preprocessor_config.json, processor_config.json, the tokenizer files with the media
    tokens, chat_template.jinja (the recorded template, else CHAT_TEMPLATE). Built from the real
    transformers objects; where torchvision is missing (no video processor can be built) the
    processor_config.json holds the processor's own arguments."""
    images = image_processor(cfg, hf_cfg)
    settings = processor_settings(cfg, hf_cfg)
    tok = _export_tokenizer(cfg, dst)
    template = processor_chat_template(dst)
    if template is None or (tok is not None and not renders_media_parts(tok, template)):
        if template is not None:  # e.g. a run's hf_assets/: its tokenizer's (Qwen2) template, string content only
            log.info(
                "chat_template.jinja: the recorded template takes string content only; the export's renders "
                'typed parts ({"type": "image"|"video"|"text"}) and strings'
            )
        template = CHAT_TEMPLATE
    if tok is not None:
        try:
            video = LlavaOnevisionVideoProcessor()
        except ImportError:  # torchvision absent: the part files are saved one by one below
            log.info(
                "torchvision is not installed: the export is complete, but transformers' AutoProcessor needs "
                "torchvision to load it (%s)",
                TORCHVISION_HINT,
            )
            video = None
        if video is not None:
            LlavaOnevisionProcessor(images, tok, video, chat_template=template, **settings).save_pretrained(str(dst))
            images.save_pretrained(str(dst))  # (transformers 5 nests it in processor_config.json only)
            return
        tok.save_pretrained(str(dst))
    images.save_pretrained(str(dst))
    (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
    (dst / "processor_config.json").write_text(
        json.dumps({"processor_class": LlavaOnevisionProcessor.__name__, **settings}, indent=2) + "\n"
    )
