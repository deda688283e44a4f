"""HF <-> megatron checkpoint conversion for every family with an HF counterpart
(`FamilySpec.hf`; the families are those in mmtrain/registry.py). See docs/conversion.md.

  mmtrain convert hf-to-mcore --model FAMILY --src HF_DIR --dst CKPT_DIR [--tp N --pp N]
  mmtrain convert mcore-to-hf --model FAMILY --src CKPT_DIR --dst HF_DIR [--max-shard-gib G]

A family may also assemble its first weights from separate HF checkpoints, e.g. llava-ov:
  mmtrain convert hf-to-mcore --model llava-ov --llm QWEN2_DIR --vision SIGLIP_DIR --dst CKPT_DIR
        (stage-1 weights: SigLIP's last layer dropped, projector and image_newline fresh)
and take the HF parts it does not train from elsewhere on export, e.g. emu3 (whose VQ model a
converted checkpoint keeps, but a checkpoint trained from scratch lacks):
  mmtrain convert mcore-to-hf --model emu3 --src CKPT_DIR --dst HF_DIR --vq VQ_DIR --tokenizer TOK_DIR
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

from mmtrain import registry
from mmtrain.runtime.logs import quiet_third_party

HF_TO_MCORE = """Convert an HF (transformers) checkpoint into a megatron distributed checkpoint that
`checkpoint.load` starts from, in any TP/PP layout (megatron checkpoints are reshardable).

  mmtrain convert hf-to-mcore --model FAMILY --src HF_DIR --dst CKPT_DIR [--tp N --pp N] [--overwrite]

A non-empty CKPT_DIR is refused unless --overwrite, which replaces it whole at the end.
The format of HF_DIR is read from its config.json (llava-ov: transformers' LLaVA-OneVision or the
LLaVA-NeXT code's LlavaQwenForCausalLM, e.g. Aquila-VL-2B and its stage checkpoints).
The megatron weights keep the source's dtype (bf16 stays bf16) unless --dtype says otherwise.
"""
MCORE_TO_HF = """Convert a megatron checkpoint (a run's `checkpoints/` folder, one `iter_*` folder, or the
output of hf-to-mcore) into an HF (transformers) checkpoint: config, safetensors shards and index.

  mmtrain convert mcore-to-hf --model FAMILY --src CKPT_DIR --dst HF_DIR [--max-shard-gib G] [--format F] [--overwrite]

A non-empty HF_DIR is refused unless --overwrite, which replaces it whole at the end (no stale
shard of an earlier export stays behind).
--format chooses the HF layout where a family has several (llava-ov: transformers, the default,
or llava-next, the original LLaVA-NeXT code's LlavaQwenForCausalLM). The export keeps the dtype
the megatron weights are stored in (config.json's dtype says it) unless --dtype says otherwise.
"""


OVERWRITE_HELP = (
    "replace a non-empty --dst (refused without it): the new checkpoint is written next to it and "
    "swapped in at the end, so a failure leaves the old one intact and no old file stays behind"
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = {
    "hf-to-mcore": "dtype the megatron weights are stored in (default auto: the source's, e.g. bfloat16 for "
    "the published checkpoints; recorded as the saved model config's params_dtype)",
    "mcore-to-hf": "dtype of the exported tensors and config.json (default auto: the dtype the megatron "
    "weights are stored in: a converted checkpoint's source dtype, a training's precision)",
}


def _formats() -> list[str]:
    """Every family's `export_formats`, in order, once."""
    return list(
        dict.fromkeys(f for n in registry.convertible_families() for f in registry.get_family(n).hf.export_formats)
    )


def add_arguments(
    parser: argparse.ArgumentParser, add_common: Callable[[argparse.ArgumentParser], None] = lambda p: None
) -> None:
    """One sub-command per direction, each with its own options and help."""
    raw = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    families = registry.convertible_families()

    to_mcore = sub.add_parser(
        "hf-to-mcore", help="HF checkpoint -> megatron checkpoint", description=HF_TO_MCORE, formatter_class=raw
    )
    to_mcore.add_argument("--model", required=True, choices=families, help="model family")
    to_mcore.add_argument("--src", metavar="HF_DIR", help="HF checkpoint dir (config.json + *.safetensors)")
    to_mcore.add_argument("--dst", required=True, metavar="CKPT_DIR", help="megatron checkpoint dir to write")
    for flag, help_text in registry.hf_flags("assemble_from").items():
        to_mcore.add_argument(
            f"--{flag}", metavar="DIR", help=f"instead of --src, assemble from separate checkpoints: {help_text}"
        )
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel layout to write (default 1)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel layout to write (default 1)")
    to_mcore.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP["hf-to-mcore"])
    to_mcore.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    to_mcore.set_defaults(run=run)
    add_common(to_mcore)

    to_hf = sub.add_parser(
        "mcore-to-hf", help="megatron checkpoint -> HF checkpoint", description=MCORE_TO_HF, formatter_class=raw
    )
    to_hf.add_argument("--model", required=True, choices=families, help="model family")
    to_hf.add_argument(
        "--src",
        required=True,
        metavar="CKPT_DIR",
        help="megatron checkpoint: a run's checkpoints/ dir, an iter_* dir, or hf-to-mcore's output",
    )
    to_hf.add_argument("--dst", required=True, metavar="HF_DIR", help="HF checkpoint dir to write")
    for flag, help_text in registry.hf_flags("export_from").items():
        to_hf.add_argument(f"--{flag}", metavar="DIR", help=help_text)
    if _formats():
        to_hf.add_argument(
            "--format",
            choices=_formats(),
            default=None,
            help="HF checkpoint format to write (default: the family's first; llava-ov: transformers)",
        )
    to_hf.add_argument(
        "--max-shard-gib", type=float, default=2.0, metavar="G", help="largest safetensors shard, in GiB (default 2)"
    )
    to_hf.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP["mcore-to-hf"])
    to_hf.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    to_hf.set_defaults(run=run)
    add_common(to_hf)


def run(args: argparse.Namespace) -> int:
    """Hide the third-party warnings training hides (optional Transformer Engine / Apex absent,
    megatron deprecations) before anything imports megatron, then convert (mmtrain/convert_run.py)."""
    verbose = getattr(args, "verbose", False) or os.environ.get("MMTRAIN_VERBOSE") == "1"
    # our INFO lines; third-party loggers (megatron's "Using Megatron-FSDP ...") at WARNING unless --verbose
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("mmtrain").setLevel(logging.INFO)
    if not verbose:
        quiet_third_party()  # first: the conversion imports megatron
    from mmtrain.convert_run import convert  # lazy: CLI dispatch (the conversion imports torch and megatron)

    return convert(args, quiet=not verbose)
