"""The vision tower's layout at TP=2 on CPU (2 gloo processes), training throughput:

  (a) baseline: the inherited layout (`parallel.vision.tp: null`): the SigLIP-style tower
      TP-sharded like the language model, both ranks encoding every tile of the micro-batch, two
      all-reduces per tower layer forward and two backward;
  (b) ours: the tower's own layout (`parallel.vision.tp: 1`): a whole tower on each rank, each
      encoding half of the micro-batch's tiles, one all-gather of the tower outputs.

Both train the same LLaVA-OV model (same initial weights) on the same micro-batches in the same
two processes, step by step in alternating order (a shared machine's noise hits both alike), with
the trainer's machinery: megatron DDP, its schedule and `finalize_model_grads`, megatron's
optimizer. The losses and grad norms of the two layouts are checked to agree every step (the grad
norm clips each update, so a step's loss also checks the previous update). The model is sized so
the tower does a realistic share of the work: each micro-batch packs LLaVA-OV anyres images of
2..10 tiles (grid up to 3x3) and one 8-frame video; tower 4 layers x 256 wide, 8x8 patches per
tile; decoder 2 layers x 256.
Throughput: tokens per second of the decoder's packed stream, the median of the per-step rates
after the warm-up; also tokens per CPU-second of the two processes (on a machine shared with
other jobs, wall time mostly measures their load).

  python -m benchmarks.bench_vision_layout [--quick] [--steps 8] [--warmup 2] [--micro-batches 2]

`--quick` (a smoke run): a smaller tower, 2 steps of one micro-batch with 2 images and a 2-frame
video, 1 warm-up.

Ends with: BENCH vision_layout baseline=<inherited> ours=<separate> unit=tokens/s ratio=<ours/baseline>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"inherited": None, "separate": 1}  # name -> parallel.vision.tp
TP = 2


def model_config(quick: bool):
    from mmtrain.llava_ov.config import LlavaOVModelConfig, VisionConfig
    from benchmarks.tiny_models import small_llm

    vision = (
        VisionConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, image_size=56)
        if quick
        else VisionConfig(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4, image_size=112)
    )
    llm = small_llm(4096, max_position_embeddings=65536)
    return LlavaOVModelConfig(
        llm=llm,
        vision=vision,
        image_token_id=4000,
        video_token_id=4001,
        max_tiles=9,
        grid_max=3,
        make_vocab_size_divisible_by=64,
    )


def micro_batch(cfg, seed: int, images: int = 4, frames: int = 8):
    """One packed row: `images` samples with an anyres image each (2..10 tiles) and one with a
    video, random pixels and text; labels are the next tokens (none on media)."""
    import torch

    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmdata.energon_loaders.llava_ov import anyres
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch

    g = torch.Generator().manual_seed(seed)
    v = cfg.vision
    side = lambda: int(torch.randint(v.image_size // 2, 3 * v.image_size + 1, (1,), generator=g))  # noqa: E731
    sizes = [(side(), side()) for _ in range(images)]
    text = lambda: torch.randint(1, 3900, (int(torch.randint(32, 96, (1,), generator=g)),), generator=g)  # noqa: E731
    parts = []
    for h, w in sizes:
        n = anyres.num_image_tokens(
            h, w, image_size=v.image_size, patch_size=v.patch_size, max_tiles=cfg.max_tiles, grid_max=cfg.grid_max
        )
        parts += [text(), torch.full((n,), cfg.image_token_id), text()]
    parts += [
        text(),
        torch.full((anyres.num_video_tokens(frames, v.image_size, v.patch_size),), cfg.video_token_id),
        text(),
    ]
    ids = torch.cat(parts)[None]
    tiles = [1 + r * c for r, c in (anyres.anyres_grid_shape(h, w, v.image_size, cfg.grid_max) for h, w in sizes)]
    pixels = torch.randn(images, max(tiles), 3, v.image_size, v.image_size, generator=g)
    video = torch.randn(1, frames, 3, v.image_size, v.image_size, generator=g)
    batch = hf_inputs_to_batch(cfg, ids, pixels, torch.tensor(sizes), pixel_values_videos=video)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
    labels[(labels == cfg.image_token_id) | (labels == cfg.video_token_id)] = IGNORE_INDEX
    batch.labels = labels
    return batch


class Replica:
    """One layout's model on this rank, wrapped as the trainer wraps it."""

    def __init__(self, cfg, vision_tp, ctx) -> None:
        import torch
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.enums import ModelType
        from megatron.core.utils import get_model_config

        from mmtrain.config.schema import OptimizerConfig
        from mmtrain.llava_ov.spec import LLAVA_OV
        from mmtrain.models.megatron_config import ParallelOptions
        from mmtrain.runtime.optimizer import ModelParts, build_optimizer, ddp_config_kwargs

        torch.manual_seed(1234)  # the same initial weights for both layouts (CPU init: one master weight, sliced)
        module = LLAVA_OV.build_model(cfg, options=ParallelOptions(lm_loss="chunked", encoder_tp=vision_tp))
        module.model_type = ModelType.encoder_or_decoder
        config = get_model_config(module)
        config.calculate_per_token_loss = True
        self.ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_config_kwargs(ctx)), module)
        config.no_sync_func, config.finalize_model_grads_func = self.ddp.no_sync, finalize_model_grads
        self.optimizer = build_optimizer(
            [self.ddp], ModelParts([module], LLAVA_OV.parts), OptimizerConfig(lr=1e-4), ctx
        )

    def step(self, micro_batches) -> tuple[float, float]:
        """One optimizer step over the micro-batches: (loss over their label tokens, grad norm)."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from mmtrain.llava_ov.forward_step import forward_step
        from mmtrain.runtime.loss import lm_loss_sums

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.ddp],
            num_microbatches=len(micro_batches),
            seq_length=max(b.input_ids.numel() for b in micro_batches),
            micro_batch_size=1,
            forward_only=False,
        )
        _, grad_norm, _ = self.optimizer.step()
        sums = lm_loss_sums(reports, torch.device("cpu"))
        return float(sums[0] / sums[1]), float(grad_norm)


def run_rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from mmtrain.config.schema import ParallelConfig
    from mmtrain.runtime.distributed import destroy_distributed, init_distributed, single_node_env

    os.environ.update(single_node_env(rank, TP, port), MMTRAIN_CPU_THREADS=str(args.threads))
    from mmtrain.runtime.logs import quiet_third_party

    quiet_third_party()
    ctx = init_distributed(ParallelConfig(tp=TP, nproc_per_node=TP, distributed_optimizer=False), seed=1234)
    cfg = model_config(args.quick)
    replicas = {name: Replica(cfg, vtp, ctx) for name, vtp in LAYOUTS.items()}
    rows = []
    media = dict(images=2, frames=2) if args.quick else {}
    for step in range(args.steps):
        micro = [micro_batch(cfg, seed=step * 100 + i, **media) for i in range(args.micro_batches)]
        tokens = sum(int(b.input_ids.numel()) for b in micro)
        tiles = sum(int(b.tiles_per_media.sum()) for b in micro)
        order = list(LAYOUTS) if step % 2 == 0 else list(reversed(LAYOUTS))
        row = {"step": step + 1, "tokens": tokens, "tiles": tiles}
        for name in order:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            loss, grad_norm = replicas[name].step(micro)
            cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
            dist.all_reduce(cpu)  # the CPU seconds of both processes (robust to other jobs' load)
            row[name] = {"s": time.perf_counter() - start, "cpu_s": float(cpu), "loss": loss, "grad_norm": grad_norm}
        rows.append(row)
        if rank == 0:
            print(
                f"step {step + 1}/{args.steps}: " + ", ".join(f"{n} {row[n]['s']:.2f} s" for n in LAYOUTS),
                file=sys.stderr,
                flush=True,
            )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    destroy_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a small tower, 2 steps")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.micro_batches = 2, 1, 1
    if args.steps <= args.warmup:
        ap.error("--steps must be larger than --warmup")
    import torch.multiprocessing as mp

    from mmtrain.runtime.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.start_processes(run_rank, args=(free_port(), args, out), nprocs=TP, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    print(
        f"{'step':>4} {'tokens':>7} {'tiles':>5}  "
        + "  ".join(f"{n + ' s/step':>18} {'loss':>8} {'grad norm':>9}" for n in LAYOUTS)
    )
    for r in rows:
        print(
            f"{r['step']:>4} {r['tokens']:>7} {r['tiles']:>5}  "
            + "  ".join(f"{r[n]['s']:>18.3f} {r[n]['loss']:>8.4f} {r[n]['grad_norm']:>9.4f}" for n in LAYOUTS)
        )
    for r in rows:  # the same model, the same batches: the same numbers (each step follows a clipped update)
        for key in ("loss", "grad_norm"):
            a, b = (r[n][key] for n in LAYOUTS)
            if abs(a - b) > 1e-4 * abs(a):
                sys.exit(f"step {r['step']}: the layouts' {key} differ ({a} vs {b})")
    timed = rows[args.warmup :]
    rate = {n: statistics.median(r["tokens"] / r[n]["s"] for r in timed) for n in LAYOUTS}
    per_cpu = {n: sum(r["tokens"] for r in timed) / sum(r[n]["cpu_s"] for r in timed) for n in LAYOUTS}
    base, ours = rate["inherited"], rate["separate"]
    print(
        f"median tokens/s after {args.warmup} warm-up steps: inherited {base:,.0f}, separate {ours:,.0f} "
        f"({TP} processes, TP={TP}, {args.threads} thread(s) each)"
    )
    print(
        f"tokens per CPU-second (both processes' CPU time, less sensitive to other jobs): inherited "
        f"{per_cpu['inherited']:,.0f}, separate {per_cpu['separate']:,.0f} "
        f"(ratio {per_cpu['separate'] / per_cpu['inherited']:.3f})"
    )
    print(f"BENCH vision_layout baseline={base:.1f} ours={ours:.1f} unit=tokens/s ratio={ours / base:.3f}")


if __name__ == "__main__":
    main()
