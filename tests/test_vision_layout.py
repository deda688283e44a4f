"""The vision tower's own parallel layout (`parallel.vision.tp`, mmtrain/models/encoder_parallel.py).

Default tier: the tile split; the gather's forward and its gradient routing on 4 gloo processes
(torch.multiprocessing, no megatron) for every TP x CP shape of 4 ranks; the model at world size 1
(one share: the same numbers as the inherited layout, frozen tower included); recipe validation;
the cost model, dry run and auto-tune's search space. Slow: one torchrun of 4 processes
(tests/workers/vision_layout_worker.py) comparing the two layouts at TP=4, TP=2 x CP=2 and
TP=2 x DP=2 (loss, every gradient, per-rank vision FLOPs) and loading each layout's checkpoint
into the other. The trainer's own path (optimizer, grad norm, clipping) at TP=2 is checked by
benchmarks/bench_vision_layout.py --quick (tests/test_benchmarks_quick.py), and a separate-layout
TP=2 checkpoint resumed at TP=1 by tests/test_train_runtime.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "llava-ov-tiny.yaml"


# ----------------------------------------------------------------------------- the split and the gather


@pytest.mark.unit
def test_shares_are_balanced_contiguous_and_cover_every_tile():
    from mmtrain.models.encoder_parallel import share_sizes

    for tiles in range(0, 40):
        for shares in (1, 2, 3, 4, 8):
            sizes = share_sizes(tiles, shares)
            assert len(sizes) == shares and sum(sizes) == tiles
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _share(tp: int, cp: int, encoder_tp: int, groups: dict):
    """This rank's EncoderShare in a world of tp x cp ranks laid out as megatron does (TP fastest)."""
    import torch.distributed as dist

    from mmtrain.models.encoder_parallel import EncoderShare

    rank = dist.get_rank()
    t, c = rank % tp, rank // tp
    cp_group = groups["cp"][t] if cp > 1 else None
    if encoder_tp == 1:  # every rank a share, TP-major
        order = tuple((g % tp) * cp + g // tp for g in range(tp * cp))
        return EncoderShare(groups["all"], tp * cp, t * cp + c, order, t * cp, cp, cp_group, 1, tp, None)
    return EncoderShare(groups["cp"][t], cp, c, tuple(range(cp)), 0, cp, cp_group, tp, tp, None)


def _gather_rank(rank: int, port: int, world: int) -> None:
    import torch.distributed as dist

    from mmtrain.models import encoder_parallel
    from mmtrain.models.encoder_parallel import gather_shares, scale_gradient, share_sizes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # a tower whole on every TP rank needs a group of each rank alone, made by every rank together
    # (on NCCL a group made by the tower's ranks alone would hang): never made behind their backs
    with pytest.raises(RuntimeError, match="prepare_groups"):
        encoder_parallel._own_rank_group()
    own = encoder_parallel._own_rank_group(create=True)
    assert dist.get_process_group_ranks(own) == [rank] and encoder_parallel._own_rank_group() is own
    for tp, cp, encoder_tp in ((4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 2, 2), (4, 1, 4)):
        groups = {
            "all": dist.new_group(list(range(world))),
            "cp": [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)],
        }
        share = _share(tp, cp, encoder_tp, groups)
        cp_rank = rank // tp
        for tiles in (7, 2, 1):  # uneven shares; empty ones
            x = torch.randn(tiles, 3, 2, generator=torch.Generator().manual_seed(tiles))
            sizes = share_sizes(tiles, share.size)
            first = sum(sizes[: share.index])
            local = x[first : first + sizes[share.index]].clone().requires_grad_()
            out = gather_shares(local, share, sizes)
            assert torch.equal(out, x), (tp, cp, encoder_tp, tiles)
            # each CP rank's loss weighs the tiles its own way (its positions); TP peers alike
            weights = [
                torch.randn(tiles, 3, 2, generator=torch.Generator().manual_seed(100 * tiles + c)) for c in range(cp)
            ]
            (out * weights[cp_rank]).sum().backward()
            want = sum(weights)[first : first + sizes[share.index]]  # d(sum over CP ranks' losses)/d(my tiles)
            assert torch.allclose(local.grad, want, rtol=0, atol=1e-6), (tp, cp, encoder_tp, tiles, rank)
        with pytest.raises(ValueError, match="rows"):
            gather_shares(torch.zeros(5, 3, 2), share, share_sizes(7, share.size))
    x = torch.ones(3, requires_grad=True)
    scale_gradient(x, 4.0).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 4.0))
    dist.barrier()
    dist.destroy_process_group()


def test_gather_returns_every_share_and_routes_each_gradient_home():
    """4 gloo processes as TP=4, TP=2 x CP=2, CP=4 (tower whole on each rank) and TP=2 x CP=2, TP=4
    (tower sharded like the LLM): each rank's group of one (the TP group of a whole tower) exists
    only once every rank made it together; the gather gives every rank all tiles in order; the gradient
    that reaches a share is the sum of what each CP rank's loss gives those tiles (TP peers hold
    the same one and count once), for 7 tiles (uneven shares), 2 and 1 (empty shares)."""
    import torch.multiprocessing as mp

    from mmtrain.runtime.distributed import free_port

    mp.start_processes(_gather_rank, args=(free_port(), 4), nprocs=4, start_method="spawn")


# ----------------------------------------------------------------------------- the model, one process


@pytest.fixture(scope="module")
def tiny_pair():
    from tests.llava_tiny import hf_llava

    from mmtrain.llava_ov.state_dict_adapter import llava_config_from_hf, normalize_llava_hf_key

    hf = hf_llava(seed=0)
    cfg = llava_config_from_hf(hf.config.to_dict())
    return cfg, {normalize_llava_hf_key(k): v for k, v in hf.state_dict().items()}


@pytest.mark.unit
def test_one_share_equals_the_inherited_layout_and_a_frozen_tower_trains_the_rest(tiny_pair, megatron_cpu):
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmtrain.llava_ov.forward_step import forward_step
    from mmtrain.llava_ov.hf_inputs import hf_inputs_to_batch
    from mmtrain.llava_ov.model import LlavaOVModel
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.llava_ov.state_dict_adapter import LlavaOVStateDictAdapter
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.models.model_io import load_canonical
    from mmtrain.runtime.optimizer import ModelParts, apply_freeze
    from tests.llava_tiny import hf_image_inputs, images

    cfg, sd = tiny_pair
    adapter = LlavaOVStateDictAdapter(cfg)
    rows, pv, sizes = hf_image_inputs(images())

    def step(encoder_tp, freeze=()):
        m = LlavaOVModel(cfg, options=ParallelOptions(encoder_tp=encoder_tp))
        load_canonical(m, lambda n: adapter.mcore_tensor(n, sd.__getitem__))
        apply_freeze([m], ModelParts([m], LLAVA_OV.parts), list(freeze))
        batch = hf_inputs_to_batch(cfg, rows[0][None], pv[:1], sizes[:1])
        batch.labels = torch.cat([rows[0][None][:, 1:], torch.full((1, 1), IGNORE_INDEX)], dim=1)
        out, loss_fn = forward_step(iter([batch]), m)
        loss_sum, _, _ = loss_fn(out)
        loss_sum.backward()
        return m, loss_sum.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}

    m, loss_i, g_i = step(None)
    assert m.encoder_share is None
    m, loss_s, g_s = step(1)
    assert m.encoder_share is not None and m.encoder_share.size == 1 and not m.encoder_share.replicated_over_tp
    assert torch.equal(loss_i, loss_s) and set(g_i) == set(g_s)
    assert any(k.startswith("vision_model.decoder") for k in g_s)
    for k in g_i:
        assert torch.allclose(g_i[k], g_s[k], rtol=1e-6, atol=1e-7), k
    _, loss_f, g_f = step(1, freeze=["vision_tower"])
    assert torch.equal(loss_f, loss_s) and not any(k.startswith("vision_model.") for k in g_f)
    assert torch.allclose(
        g_f["vision_projection.encoder.linear_fc1.weight"], g_s["vision_projection.encoder.linear_fc1.weight"]
    )
    with pytest.raises(ValueError, match="parallel.vision.tp: 2 with parallel.tp=1"):
        LlavaOVModel(cfg, options=ParallelOptions(encoder_tp=2))


# ----------------------------------------------------------------------------- recipes


def _load(*overrides, path=TINY):
    from mmtrain.config import load_recipe

    return load_recipe(path, ["action=dry_run", *overrides])


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ("parallel.nproc_per_node=4", "parallel.tp=4", "parallel.vision.tp=2"),
            "parallel.vision.tp: 2 with parallel.tp=4: the vision tower's own layout is TP 1",
        ),
        (("parallel.vision.tp=0",), "parallel.vision.tp: must be >= 1 or null, got 0"),
        (("parallel.vision.tp=one",), "parallel.vision.tp: expected int or null"),
        (("auto_tune.vision_tp=[null, 0]",), "auto_tune.vision_tp: candidates must be >= 1 or null"),
    ],
)
def test_recipe_refuses_a_vision_layout_that_cannot_run(overrides, message):
    from mmtrain.config import RecipeError

    with pytest.raises(RecipeError, match=re.escape(message)):
        _load(*overrides)


@pytest.mark.unit
def test_recipe_takes_the_vision_layout_where_it_fits_and_emu3_has_none():
    from mmtrain.config import RecipeError

    assert _load().parallel.vision.tp is None  # the default: the language model's layout
    for vtp in (1, 2):
        assert (
            _load("parallel.nproc_per_node=2", "parallel.tp=2", f"parallel.vision.tp={vtp}").parallel.vision.tp == vtp
        )
    with pytest.raises(RecipeError, match="parallel.vision.tp: family emu3 has no vision tower"):
        _load("parallel.vision.tp=1", path=REPO / "recipes" / "emu3-tiny.yaml")


# ----------------------------------------------------------------------------- planning


@pytest.mark.unit
def test_cost_model_dry_run_and_search_space_know_the_vision_layout(tmp_path):
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.models.shapes import encoder_params
    from mmtrain.planning.cost_model import Hardware, Layout, estimate_memory, estimate_step_time
    from mmtrain.planning.dry_run import build_report
    from mmtrain.planning.search_space import SpaceContext, candidate_layouts, tp_valid

    aquila = _load("stage=2a", "parallel.tp=2", "parallel.cp=1", path=REPO / "recipes" / "aquila-vl-2b.yaml")
    shapes, hw = LLAVA_OV.model_shapes(aquila.model), Hardware.from_auto_tune(aquila.auto_tune)
    inherited = Layout.from_recipe(aquila)
    separate = Layout.from_recipe(
        dataclasses.replace(
            aquila,
            parallel=dataclasses.replace(aquila.parallel, vision=dataclasses.replace(aquila.parallel.vision, tp=1)),
        )
    )
    assert (inherited.vision_tp, separate.vision_tp, separate.encoder_shares) == (None, 1, 2)
    mi, ms = (estimate_memory(shapes, [], L) for L in (inherited, separate))
    # the whole tower on every rank (bf16 weights: 2 bytes), its activations over the 2 shares
    assert ms.weights - mi.weights == pytest.approx(encoder_params(shapes.encoder) / 2 * 2)
    assert ms.encoder_activations < mi.encoder_activations
    ti, ts = (estimate_step_time(shapes, [], L, hw) for L in (inherited, separate))
    assert ts.encoder_comm_s < ti.encoder_comm_s and ti.tp_comm_s == ts.tp_comm_s and ts.compute_s == ti.compute_s
    # frozen, the tower's backward all-reduces go (and its gradient average too)
    assert estimate_step_time(shapes, ["vision_tower"], inherited, hw).encoder_comm_s < ti.encoder_comm_s
    text = build_report(
        dataclasses.replace(
            aquila,
            parallel=dataclasses.replace(aquila.parallel, vision=dataclasses.replace(aquila.parallel.vision, tp=1)),
        ),
        LLAVA_OV,
    ).text
    assert "vision tower: its own layout, tp 1; a micro-batch's tiles split over 2 ranks" in text
    assert "vision comm" in build_report(aquila, LLAVA_OV).text

    tiny = _load("action=auto_tune", f"run_dir={tmp_path}", "parallel.nproc_per_node=2", "train.global_batch_size=8")
    ctx = SpaceContext(tiny, LLAVA_OV.model_shapes(tiny.model), on_cuda=False)
    layouts = candidate_layouts(ctx)
    assert {L.vision_tp for L in layouts} == {None, 1}
    assert all(L.tp * L.cp > 1 for L in layouts if L.vision_tp == 1)
    # with its own TP 1 the tower no longer has to split its heads over the LLM's TP
    wide = dataclasses.replace(ctx.shapes, encoder=dataclasses.replace(ctx.shapes.encoder, heads=3))
    L = layouts[0].with_(tp=2, vision_tp=None)
    assert not tp_valid(L, dataclasses.replace(ctx, shapes=wide)) and tp_valid(
        L.with_(vision_tp=1), dataclasses.replace(ctx, shapes=wide)
    )


@pytest.mark.unit
def test_cost_model_counts_the_tp_gradient_averages_flatten_and_copy_back():
    """Review N9: with `vision.tp: 1` megatron's finalize_model_grads flattens the replicated
    tower's fp32 gradients into one new buffer, all-reduces it over TP (AVG) and copies it back,
    after the step's DP reduce. The step time counts the all-reduce and both copies (a read and a
    write of every gradient each, at memory bandwidth); the memory the fp32 buffer, which lives
    after the backward, in the activations' place."""
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.models.shapes import param_counts
    from mmtrain.planning.cost_model import Hardware, Layout, estimate_memory, estimate_step_time

    aquila = _load(
        "stage=2a",
        "parallel.tp=2",
        "parallel.cp=1",
        "parallel.vision.tp=1",
        path=REPO / "recipes" / "aquila-vl-2b.yaml",
    )
    shapes, hw, L = (
        LLAVA_OV.model_shapes(aquila.model),
        Hardware.from_auto_tune(aquila.auto_tune),
        Layout.from_recipe(aquila),
    )
    grads = param_counts(shapes, [], L.tp).trainable["vision_tower"] * 4  # fp32 main grads, the whole tower
    trained = estimate_step_time(shapes, [], L, hw).encoder_comm_s
    frozen = estimate_step_time(shapes, ["vision_tower"], L, hw).encoder_comm_s  # nothing to average
    all_reduce = 2 * (L.tp - 1) / L.tp * grads / (hw.tp_bandwidth_gbps * 1e9)
    copies = 2 * 2 * grads / (hw.memory_bandwidth_gbps * 1e9)
    assert trained - frozen == pytest.approx(all_reduce + copies)

    m = estimate_memory(shapes, [], L)
    assert m.stage == 0 and m.grad_average_buffer == grads
    assert estimate_memory(shapes, [], L.with_(vision_tp=None)).grad_average_buffer == 0
    assert estimate_memory(shapes, ["vision_tower"], L).grad_average_buffer == 0
    fixed = m.weights + m.grads + m.optimizer
    assert m.total == pytest.approx(fixed + max(m.activations + m.logits + m.encoder_activations, grads))
    huge = dataclasses.replace(m, grad_average_buffer=1e15)
    assert huge.total == pytest.approx(fixed + 1e15)


# ----------------------------------------------------------------------------- slow: 4 processes


@pytest.mark.slow
def test_separate_layout_equals_inherited_at_tp4_and_tp2_with_a_quarter_of_the_vision_flops(tmp_path):
    from tests.fixtures_convert import torchrun

    result = tmp_path / "res.json"
    torchrun(REPO / "tests" / "workers" / "vision_layout_worker.py", str(tmp_path / "ckpt"), str(result), nproc=4)
    res = json.loads(result.read_text())
    for name, tp, cp in (("tp4-cp1", 4, 1), ("tp2-cp2", 2, 2), ("tp2-cp1", 2, 1)):
        r = res[name]
        assert r["loss_separate"] == pytest.approx(r["loss_inherited"], rel=1e-6), name
        assert r["max_grad_rel_err"] < 1e-5, (name, r["worst_param"])
        assert r["vision_params"] > 20 and r["vision_grad_nonzero"], name
        # FLOPs counted on each rank: each of the tp x cp ranks sharing a micro-batch encodes its
        # share of the tiles once; the busiest does ceil(tiles / shares) of them
        shares, per_tile = tp * cp, r["flops_whole_tower"] / sum(r["tiles"])
        groups = [r["flops_separate"][i : i + shares] for i in range(0, 4, shares)]
        for group in groups:
            assert sum(group) == pytest.approx(r["flops_whole_tower"])
            assert max(group) == pytest.approx(per_tile * sum(math.ceil(t / shares) for t in r["tiles"]))
        assert max(r["flops_separate"]) <= r["flops_whole_tower"] / shares * 1.2
        # inherited: at least the TP share of the whole tower on every rank (the patch conv and
        # norms are whole on each), under CP more where media straddle chunks
        assert min(r["flops_inherited"]) >= r["flops_whole_tower"] / tp
        assert max(r["flops_inherited"]) > max(r["flops_separate"])
    c = res["checkpoint"]
    assert c["separate_to_other_max_abs_err"] == 0 and c["inherited_to_other_max_abs_err"] == 0
    assert c["saved_vision_tensors"] > 10 and c["saved_vs_hf_max_abs_err"] == 0
