"""Checks that span keys, run once on the typed recipe; each names the keys involved. The
family adds its own (`FamilySpec.check_recipe`), run after these."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from mmtrain.config.errors import RecipeErrors, suggest
from mmtrain.config.global_order_checks import global_order_checks
from mmtrain.config.schema import Recipe
from mmtrain.models.pipeline_split import PipelineSplitError, interleaved_schedule_problem, split_layers
from mmtrain.models.layout_rules import sequence_split_multiple, check_encoder_tp

if TYPE_CHECKING:
    from mmtrain.spec import FamilySpec


def cross_checks(r: Recipe, spec: FamilySpec, errors: RecipeErrors) -> None:
    _sizes(r, errors)
    _optimizer(r, errors)
    _layout(r, errors)
    _pipeline(r, spec, errors)
    _recompute(r, errors)
    _vision_layout(r, spec, errors)
    _auto_tune(r, errors)
    _parts(r, spec, errors)
    global_order_checks(r, errors)
    if r.action == "run":
        if not r.data.paths:
            errors.add(("data", "paths"), "must list at least one shard dir or metadataset YAML for action: run")
        if not r.tokenizer.path:
            errors.add(("tokenizer", "path"), "is required for action: run")
    spec.check_recipe(r, errors)


#: recipe keys (section, key) that must be > 0 and >= 0, in the order their errors are listed
POSITIVE = (
    ("train", "iters"),
    ("train", "seq_length"),
    ("train", "micro_batch_size"),
    ("train", "global_batch_size"),
    ("train", "eval_iters"),
    ("parallel", "tp"),
    ("parallel", "pp"),
    ("parallel", "cp"),
    ("parallel", "vpp"),
    ("parallel", "lm_loss_block_mb"),
    ("parallel", "nproc_per_node"),
    ("parallel", "nnodes"),
    ("logging", "interval"),
    ("parallel", "collective_timeout_mins"),
)
NON_NEGATIVE = (
    ("train", "eval_interval"),
    ("checkpoint", "interval"),
    ("checkpoint", "keep_last"),
    ("data", "num_workers"),
    ("data", "packing_buffer_size"),
    ("data", "shuffle_buffer_size"),
    ("train", "exit_interval"),
    ("train", "exit_duration_mins"),
)


def _value(r: Recipe, path: tuple[str, str]) -> Any:
    section, key = path
    return getattr(getattr(r, section), key)


def _sizes(r: Recipe, errors: RecipeErrors) -> None:
    t = r.train
    for path in POSITIVE:
        if (value := _value(r, path)) <= 0:
            errors.add(path, f"must be > 0, got {value}")
    for path in NON_NEGATIVE:
        if (value := _value(r, path)) < 0:
            errors.add(path, f"must be >= 0, got {value}")
    if r.data.packing_plan is not None and r.data.packing != "plan":
        errors.add(
            ("data", "packing_plan"),
            f"is only read with data.packing: plan (got packing: {r.data.packing}); "
            "set data.packing=plan or drop data.packing_plan",
            [("data", "packing")],
        )
    if r.data.plan_allow_estimated_lengths and r.data.packing != "plan" and r.data.sharding != "global":
        errors.add(
            ("data", "plan_allow_estimated_lengths"),
            f"is only read with data.packing: plan or data.sharding: global (got packing: {r.data.packing}, "
            f"sharding: {r.data.sharding}); set one of them or drop it",
            [("data", "packing")],
        )
    window = r.data.balance_window
    if window != "auto" and window < 1:
        errors.add(("data", "balance_window"), f"must be >= 1 steps or auto, got {window}")
    elif window not in ("auto", 1) and (not r.data.balance or r.data.packing == "plan"):
        errors.add(
            ("data", "balance_window"),
            f"is only used by online balancing (data.balance: true with "
            f"data.packing: true; got balance: {r.data.balance}, packing: {r.data.packing}); "
            "set data.balance=true or drop data.balance_window",
            [("data", "balance"), ("data", "packing")],
        )
    if t.eval_interval > 0 and not r.data.val_paths:
        errors.add(
            ("data", "val_paths"),
            f"must list at least one shard dir or metadataset YAML when "
            f"train.eval_interval={t.eval_interval} (> 0); set train.eval_interval=0 to skip evaluation",
            [("train", "eval_interval")],
        )


def _optimizer(r: Recipe, errors: RecipeErrors) -> None:
    o = r.optimizer
    for name in ("lr", "min_lr", "clip_grad", "weight_decay"):
        if getattr(o, name) < 0:
            errors.add(("optimizer", name), f"must be >= 0, got {getattr(o, name)}")
    if o.min_lr > o.lr:
        errors.add(("optimizer", "min_lr"), f"must be <= optimizer.lr ({o.lr}), got {o.min_lr}", [("optimizer", "lr")])
    if not 0.0 <= o.warmup_fraction <= 1.0:
        errors.add(("optimizer", "warmup_fraction"), f"must be in [0, 1], got {o.warmup_fraction}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            errors.add(("optimizer", name), f"must be in [0, 1), got {getattr(o, name)}")


def _layout(r: Recipe, errors: RecipeErrors) -> None:
    t, p = r.train, r.parallel
    if not 0 <= p.node_rank < max(p.nnodes, 1):
        errors.add(("parallel", "node_rank"), f"must be in [0, parallel.nnodes={p.nnodes}), got {p.node_rank}")
    if not 0 < p.master_port < 65536:
        errors.add(("parallel", "master_port"), f"must be a TCP port, got {p.master_port}")
    if min(p.tp, p.pp, p.cp, p.nproc_per_node, p.nnodes, t.micro_batch_size) <= 0:
        return
    _context_parallel(r, errors)
    world, mp = p.world_size, p.model_parallel
    layout = [("parallel", k) for k in ("tp", "pp", "cp", "nproc_per_node", "nnodes")]
    if world % mp:
        errors.add(
            ("parallel",),
            f"tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {mp} does not divide the world size "
            f"nproc_per_node*nnodes = {p.nproc_per_node}*{p.nnodes} = {world}",
            layout,
        )
        return
    dp = world // mp
    if t.global_batch_size % (t.micro_batch_size * dp):
        errors.add(
            ("train", "global_batch_size"),
            f"{t.global_batch_size} is not divisible by micro_batch_size*dp = "
            f"{t.micro_batch_size}*{dp} = {t.micro_batch_size * dp} "
            f"(dp = world {world} / (tp {p.tp} * pp {p.pp} * cp {p.cp}))",
            layout + [("train", "micro_batch_size")],
        )


def _pipeline(r: Recipe, spec: FamilySpec, errors: RecipeErrors) -> None:
    """The decoder's split over stages and virtual stages when `parallel.pp_layers` or `vpp` asks for
    one (models/pipeline_split.py; megatron itself refuses a plain pp that does not divide the
    layers), and the micro-batches per step megatron's interleaved schedule needs."""
    t, p = r.train, r.parallel
    if min(p.pp, p.vpp) <= 0 or (p.vpp == 1 and not p.pp_layers):
        return
    keys = [("parallel", "pp"), ("parallel", "vpp"), ("model",)]
    try:
        split_layers(spec.model_shapes(r.model).decoder.layers, p.pp, p.vpp, p.pp_layers)
    except PipelineSplitError as err:
        errors.add(("parallel", "pp_layers" if p.pp_layers else "vpp"), str(err), keys)
    if min(p.tp, p.cp, p.nproc_per_node, p.nnodes, t.micro_batch_size) <= 0 or p.world_size % p.model_parallel:
        return
    problem = interleaved_schedule_problem(t.global_batch_size // (t.micro_batch_size * p.dp), p.pp, p.vpp)
    if problem:
        errors.add(("train", "global_batch_size"), problem, [("parallel", "vpp"), ("train", "micro_batch_size")])


def _context_parallel(r: Recipe, errors: RecipeErrors) -> None:
    """megatron's sequence split: seq_length a multiple of 2*cp (x tp with sequence
    parallelism); a2a+p2p needs the hierarchical sizes, whose product is cp."""
    t, p = r.train, r.parallel
    need = sequence_split_multiple(p.cp, p.tp, p.sequence_parallel)
    if t.seq_length % need:
        how = f"2*cp*tp = 2*{p.cp}*{p.tp}" if need != 2 * p.cp else f"2*cp = 2*{p.cp}"
        errors.add(
            ("train", "seq_length"),
            f"{t.seq_length} is not a multiple of {how} = {need} (context parallelism splits every "
            "sequence into 2*cp chunks)",
            [("parallel", "cp")]
            + ([("parallel", "tp"), ("parallel", "sequence_parallel")] if p.sequence_parallel and p.tp > 1 else []),
        )
    sizes = p.hierarchical_cp_sizes
    if p.cp > 1 and p.cp_comm_type == "a2a+p2p":
        if len(sizes) < 2 or math.prod(sizes) != p.cp or min(sizes) < 1:
            errors.add(
                ("parallel", "hierarchical_cp_sizes"),
                f"must list the a2a and p2p group sizes whose product is parallel.cp={p.cp} for "
                f"cp_comm_type a2a+p2p, got {sizes}",
                [("parallel", "cp_comm_type")],
            )
    elif sizes:
        errors.add(
            ("parallel", "hierarchical_cp_sizes"),
            f"is only used with parallel.cp_comm_type=a2a+p2p (cp > 1), got {sizes}",
            [("parallel", "cp_comm_type")],
        )


def _recompute(r: Recipe, errors: RecipeErrors) -> None:
    p = r.parallel
    if p.recompute_num_layers < 0:
        errors.add(("parallel", "recompute_num_layers"), f"must be >= 0, got {p.recompute_num_layers}")
    elif p.recompute_num_layers and p.recompute != "full":
        errors.add(
            ("parallel", "recompute_num_layers"),
            f"a number of recomputed layers needs parallel.recompute=full, got {p.recompute!r}",
            [("parallel", "recompute")],
        )


def _vision_layout(r: Recipe, spec: FamilySpec, errors: RecipeErrors) -> None:
    """`parallel.vision.tp`: null, 1 or parallel.tp, for a family with a media encoder."""
    p, key = r.parallel, ("parallel", "vision", "tp")
    wanted = [("auto_tune", "vision_tp", v) for v in r.auto_tune.vision_tp if v is not None]
    if p.vision.tp is None and not wanted:
        return
    if spec.model_shapes(r.model).encoder is None:
        where = key if p.vision.tp is not None else ("auto_tune", "vision_tp")
        errors.add(where, f"family {spec.name} has no vision tower trained with the model; leave it null")
        return
    if p.vision.tp is not None:
        if p.vision.tp < 1:
            errors.add(key, f"must be >= 1 or null, got {p.vision.tp}")
        elif (problem := check_encoder_tp(p.vision.tp, p.tp)) is not None:
            errors.add(key, problem, [("parallel", "tp")])
    if any(v < 1 for *_, v in wanted):
        errors.add(("auto_tune", "vision_tp"), f"candidates must be >= 1 or null, got {r.auto_tune.vision_tp}")


def _auto_tune(r: Recipe, errors: RecipeErrors) -> None:
    a = r.auto_tune
    for name in ("device_memory_gb", "device_tflops", "tp_bandwidth_gbps", "dp_bandwidth_gbps", "top"):
        if getattr(a, name) <= 0:
            errors.add(("auto_tune", name), f"must be > 0, got {getattr(a, name)}")
    for name in ("memory_fraction", "matmul_efficiency"):
        if not 0 < getattr(a, name) <= 1:
            errors.add(("auto_tune", name), f"must be in (0, 1], got {getattr(a, name)}")
    if not 0 <= a.media_token_fraction <= 1:
        errors.add(("auto_tune", "media_token_fraction"), f"must be in [0, 1], got {a.media_token_fraction}")
    for name in ("tp", "pp", "vpp", "cp", "micro_batch_size"):
        if any(x <= 0 for x in getattr(a, name)):
            errors.add(("auto_tune", name), f"candidates must be > 0, got {getattr(a, name)}")
    if not 0 <= a.min_memory_fraction < a.memory_fraction:
        errors.add(
            ("auto_tune", "min_memory_fraction"),
            f"must be in [0, auto_tune.memory_fraction={a.memory_fraction}), got {a.min_memory_fraction}",
            [("auto_tune", "memory_fraction")],
        )
    for name in ("max_trials", "warmup_steps"):
        if getattr(a, name) < 0:
            errors.add(("auto_tune", name), f"must be >= 0, got {getattr(a, name)}")
    for name in ("max_minutes", "trial_timeout_s"):
        if getattr(a, name) <= 0:
            errors.add(("auto_tune", name), f"must be > 0, got {getattr(a, name)}")
    if a.trial_steps <= a.warmup_steps:
        errors.add(
            ("auto_tune", "trial_steps"),
            f"must be > auto_tune.warmup_steps={a.warmup_steps} (tokens/s "
            f"is measured after the warm-up), got {a.trial_steps}",
            [("auto_tune", "warmup_steps")],
        )
    if a.slow_margin < 0:
        errors.add(("auto_tune", "slow_margin"), f"must be >= 0, got {a.slow_margin}")


def _parts(r: Recipe, spec: FamilySpec, errors: RecipeErrors) -> None:
    """`freeze:` and `optimizer.lr_mult:` name parts the family declares."""
    parts = list(spec.parts)
    known = f"(parts of {spec.name}: {', '.join(parts)})"
    for i, name in enumerate(r.freeze):
        if name not in parts:
            errors.add((f"freeze[{i}]",), f"unknown part {name!r}{suggest(name, parts)} {known}")
    if len(set(r.freeze)) != len(r.freeze):
        errors.add(("freeze",), f"lists a part twice: {r.freeze}")
    for name, mult in r.optimizer.lr_mult.items():
        if name not in parts:
            errors.add(("optimizer", "lr_mult", name), f"unknown part {name!r}{suggest(name, parts)} {known}")
        elif mult < 0:
            errors.add(("optimizer", "lr_mult", name), f"must be >= 0, got {mult}")
    if r.action == "run" and parts and set(parts) <= set(r.freeze):
        errors.add(("freeze",), "everything is frozen; nothing would train", [("action",)])
