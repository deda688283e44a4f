"""`action: dry_run`: what a recipe would train and whether it fits, without building the model.

Prints parameter counts (total and per component, trainable vs frozen under `freeze:`) and the
per-rank memory estimate for the recipe's layout (weights, grads, optimizer states with or
without distributed-optimizer sharding, activations with or without recompute, in the recipe's
precision). Everything comes from the analytical model in mmtrain/planning/cost_model.py and the
family's shape description (`FamilySpec.model_shapes`), so a 2B recipe dry-runs in well under a
second on a CPU box.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from mmdata.units import plural
from mmtrain.config.schema import RECOMPUTE_MODES, Recipe
from mmtrain.planning.blend_report import blend_lines
from mmtrain.models.shapes import ModelShapes, ParamCounts, param_counts
from mmtrain.planning.calibration import Calibration
from mmtrain.planning.cost_model import (
    GB,
    Hardware,
    Layout,
    MemoryEstimate,
    StepTime,
    estimate_memory,
    estimate_stage_memory,
    estimate_step_time,
    fmt_count,
    fmt_gb,
)
from mmtrain.spec import FamilySpec


@dataclass
class DryRunReport:
    params: ParamCounts
    memory: MemoryEstimate  # the busiest rank
    memory_no_distopt: MemoryEstimate  # same layout without optimizer sharding, for comparison
    memory_by_recompute: dict[str, MemoryEstimate]  # same layout under each recompute mode
    step: StepTime
    stage_memory: list[MemoryEstimate]  # every pipeline stage (one entry without pipelining)
    layout: Layout
    device_memory_gb: float
    text: str

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.device_memory_gb * GB


def build_report(recipe: Recipe, spec: FamilySpec) -> DryRunReport:
    shapes = spec.model_shapes(recipe.model)
    layout = Layout.from_recipe(recipe)
    at = recipe.auto_tune
    frac = at.media_token_fraction
    params = param_counts(shapes, recipe.freeze)
    stages = estimate_stage_memory(shapes, recipe.freeze, layout, frac)
    mem = max(stages, key=lambda m: m.total)
    mem_plain = estimate_memory(shapes, recipe.freeze, layout.with_(distributed_optimizer=False), frac)
    by_rc = {rc: estimate_memory(shapes, recipe.freeze, layout.with_(recompute=rc), frac) for rc in RECOMPUTE_MODES}
    step = estimate_step_time(shapes, recipe.freeze, layout, Hardware.from_auto_tune(at), frac)
    report = DryRunReport(params, mem, mem_plain, by_rc, step, stages, layout, at.device_memory_gb, "")
    report.text = format_report(recipe, report, shapes)
    if mixture := blend_lines(recipe):
        report.text += "\n\n" + "\n".join(mixture)
    if at.calibration:
        cal = Calibration.load(at.calibration)
        report.text += (
            f"\ncalibrated for {cal.host or 'this machine'} ({at.calibration}, fitted on "
            f"{plural(cal.trials, 'trial')}): memory {fmt_gb(cal.memory_bytes(mem.total))} per rank, "
            f"step time {cal.step_s(step.total_s):.3g} s"
        )
    return report


def format_report(recipe: Recipe, r: DryRunReport, shapes: ModelShapes) -> str:
    L, p = r.layout, r.params
    tied_head = shapes.decoder.tied
    lines = [f"dry run: {recipe.family} recipe, stage {recipe.stage or '-'}, run_dir {recipe.run_dir}", ""]
    lines.append(f"{'parameters':<16}{'total':>14}{'trainable':>14}{'frozen':>14}")
    for name, n in p.parts.items():
        if n:
            t = p.trainable[name]
            lines.append(f"{name:<16}{fmt_count(n):>14}{fmt_count(t):>14}{fmt_count(n - t):>14}")
    lines.append(
        f"{'total':<16}{fmt_count(p.total):>14}{fmt_count(p.total_trainable):>14}"
        f"{fmt_count(p.total - p.total_trainable):>14}"
    )
    enc = shapes.encoder
    if enc is not None and enc.frozen_params and p.trainable.get(shapes.encoder_part):
        lines.append(
            f"  ({shapes.encoder_part}'s {fmt_count(enc.frozen_params)} frozen: "
            f"{enc.frozen_what or 'kept but never trained'})"
        )
    lines.append(
        f"  ({p.total:,} parameters; decoder embedding {fmt_count(p.decoder_embedding)}, "
        f"decoder layers {fmt_count(p.decoder_layers)})"
    )
    if p.vocab_padding:
        lines.append(
            f"  ({p.unpadded_total:,} parameters with the true vocabulary, as in the HF checkpoint; "
            f"the {fmt_count(p.vocab_padding)} more are megatron's vocabulary padding)"
        )
    if tied_head:
        lines.append(
            f"  (tied output layer; checkpoints that store it as its own tensor hold "
            f"{fmt_count(p.total + p.decoder_embedding)} numbers)"
        )
    lines.append("")
    world = L.world
    lines.append(
        f"layout: world {world} = tp {L.tp} x pp {L.pp}{f' (x vpp {L.vpp})' if L.vpp > 1 else ''} x cp {L.cp} "
        f"x dp {L.dp}; micro-batch "
        f"{L.micro_batch_size}, global batch {L.global_batch_size} ({L.grad_accum} accumulation steps), "
        f"seq {L.seq_length}" + (f" ({L.tokens_per_rank} tokens per rank)" if L.cp > 1 else "")
    )
    lines.append(
        f"        precision {L.precision}, recompute {L.recompute}, sequence parallel "
        f"{'on' if L.sequence_parallel else 'off'}, distributed optimizer "
        f"{'on' if L.distributed_optimizer else 'off'}, LM loss {L.lm_loss}"
        + (f", cp_comm_type {recipe.parallel.cp_comm_type}" if L.cp > 1 else "")
    )
    if L.vision_tp is not None:
        lines.append(
            f"        vision tower: its own layout, tp {L.vision_tp}; a micro-batch's tiles split over "
            f"{plural(L.encoder_shares, 'rank')}, outputs all-gathered (parallel.vision.tp)"
        )
    lines.append("")
    m = r.memory
    sharded_over = " (sharded / dp x cp)" if L.cp > 1 else " (sharded / dp)"
    lines.append(
        f"memory per rank (estimate; busiest pipeline stage = {m.stage}, {fmt_count(m.params_on_rank)} params on it)"
    )
    rows = [
        ("weights", m.weights),
        ("gradients", m.grads),
        (
            "optimizer states" + (sharded_over if L.distributed_optimizer and L.dp * L.cp > 1 else ""),
            m.optimizer,
        ),
        (f"activations (recompute {L.recompute})", m.activations),
        ("encoder activations", m.encoder_activations),
        (f"logits + loss ({'full logits' if L.lm_loss == 'plain' else 'chunked'})", m.logits),
    ]
    if m.grad_average_buffer > 0:  # after the backward, in the activations' place (the larger counts)
        rows.append(("vision grads' TP average buffer (fp32)", m.grad_average_buffer))
    for name, b in rows:
        lines.append(f"  {name:<38}{fmt_gb(b):>12}")
    lines.append(
        f"  {'total':<38}{fmt_gb(m.total):>12}   ({'fits' if r.fits else 'does NOT fit'} in {r.device_memory_gb:g} GiB)"
    )
    if L.distributed_optimizer and L.dp * L.cp > 1:
        lines.append(f"  without the distributed optimizer: {fmt_gb(r.memory_no_distopt.total)}")
    lines.append(
        "  total by recompute mode: "
        + ", ".join(
            f"{rc} {fmt_gb(m.total)} (activations {fmt_gb(m.activations)})" for rc, m in r.memory_by_recompute.items()
        )
    )
    s = r.step
    tokens = L.global_batch_size * L.seq_length
    mfu = s.mfu(world, recipe.auto_tune.device_tflops)
    lines.append("")
    lines.append(
        f"modelled step time on {recipe.auto_tune.device_tflops:g}-TFLOP/s devices: {s.total_s:.2f} s "
        f"(compute {s.compute_s:.2f}, pipeline bubble {s.bubble_s:.2f}, TP comm {s.tp_comm_s:.2f}, "
        f"CP comm {s.cp_comm_s:.2f}, DP comm {s.dp_comm_s:.2f}, vision comm {s.encoder_comm_s:.2f}) -> "
        f"{tokens / s.total_s / world:,.0f} "
        f"tokens/s/device, MFU {mfu:.0%}"
    )
    if L.pp > 1:
        lines += [""] + pipeline_lines(r, shapes)
    lines.append(
        "Estimates from an analytical model (mmtrain/planning/cost_model.py), not measurements; "
        "the model was not built."
    )
    return "\n".join(lines)


def pipeline_lines(r: DryRunReport, shapes: ModelShapes) -> list[str]:
    """Per pipeline stage: its decoder layers (per virtual stage too), what else it holds, its
    memory and modelled time per step; the bubble of the schedule."""
    L, s = r.layout, r.step
    split = L.estimated_split(shapes.decoder.layers)
    how = (
        "parallel.pp_layers"
        if L.pp_layers
        else "even split"
        if not split.explicit
        else "pp does not divide the layers, which megatron refuses: set parallel.pp_layers"
    )
    schedule = f"interleaved 1F1B, {L.vpp} virtual stages per rank" if L.vpp > 1 else "1F1B"
    lines = [f"pipeline stages ({schedule}; decoder layers {split.describe()}, {how})"]
    first = shapes.upstream_parts  # the encoder and connectors feeding the decoder (first chunk)
    slowest = max(range(L.pp), key=lambda i: s.stage_s[i])
    for m in r.stage_memory:
        holds = (first + ["embedding"] if m.stage == 0 else []) + (["LM head + loss"] if m.stage == L.pp - 1 else [])
        chunks = f" ({' + '.join(map(str, split.counts[m.stage]))})" if L.vpp > 1 else ""
        lines.append(
            f"  stage {m.stage}: {m.decoder_layers} decoder layers{chunks}"
            f"{' + ' + ', '.join(holds) if holds else ''}: {fmt_gb(m.total)}, {s.stage_s[m.stage]:.2f} s/step"
            + (" (the slowest: it paces the pipeline)" if m.stage == slowest else "")
        )
    lines.append(
        f"  bubble (pp-1)/(vpp*m) = {L.pp - 1}/({L.vpp}*{L.grad_accum}) of the slowest stage's compute: "
        f"{s.bubble_s:.2f} s"
    )
    return lines


def run_dry_run(recipe: Recipe, spec: FamilySpec, out: TextIO | None = None) -> DryRunReport:
    """Print the report for `recipe`."""
    report = build_report(recipe, spec)
    print(report.text, file=out or sys.stdout)
    return report
