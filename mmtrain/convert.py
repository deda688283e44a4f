"""HF <-> megatron checkpoint conversion.

  mmtrain convert hf-to-mcore --model llava-ov --src HF_DIR --dst CKPT_DIR [--tp N --pp N]
  mmtrain convert hf-to-mcore --model llava-ov --llm QWEN2_DIR --vision SIGLIP_DIR --dst CKPT_DIR
        (stage-1 weights: SigLIP's last layer dropped, projector and image_newline fresh)
  mmtrain convert mcore-to-hf --model llava-ov --src CKPT_DIR --dst HF_DIR
"""

from __future__ import annotations

import argparse
import logging

MODELS = ("llava-ov",)


def add_arguments(parser: argparse.ArgumentParser, name: str = "convert") -> None:
    parser.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    parser.add_argument("--model", required=True, choices=MODELS)
    parser.add_argument("--src", help="HF dir (hf-to-mcore) or megatron checkpoint dir (mcore-to-hf)")
    parser.add_argument("--dst", required=True)
    parser.add_argument("--llm", help="Qwen2/2.5 HF dir (stage-1 assembly, with --vision)")
    parser.add_argument("--vision", help="SigLIP HF dir (stage-1 assembly, with --llm)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel layout to convert in (checkpoint is reshardable)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel layout to convert in")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="mcore-to-hf: max safetensors shard size")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from mmtrain.llava_ov import conversion

    if args.direction == "hf-to-mcore":
        if args.llm or args.vision:
            if not (args.llm and args.vision) or args.src:
                raise SystemExit("hf-to-mcore: give either --src, or both --llm and --vision")
            cfg = conversion.assemble_stage1(args.llm, args.vision, args.dst, tp=args.tp, pp=args.pp)
        else:
            if not args.src:
                raise SystemExit("hf-to-mcore: --src HF_DIR is required (or --llm and --vision)")
            cfg = conversion.hf_to_mcore(args.src, args.dst, tp=args.tp, pp=args.pp)
        print(f"wrote megatron checkpoint {args.dst} (llm {cfg.llm.num_layers} layers, vision {cfg.vision.num_layers} layers)")
    else:
        if not args.src:
            raise SystemExit("mcore-to-hf: --src CKPT_DIR is required")
        out = conversion.mcore_to_hf(args.src, args.dst, int(args.max_shard_gb * 1024**3))
        print(f"wrote HF checkpoint {out}")
    return 0
