"""The training runtime's pure functions: LR schedule, the family's parts (freezing, param groups,
per-part LRs), checkpoint resolution and per-sample losses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.unit


def test_lr_schedule_warmup_cosine_and_group_peaks():
    from mmtrain.runtime.lr_schedule import LRSchedule

    s = LRSchedule(max_lr=1e-3, min_lr=1e-5, warmup_steps=4, total_steps=20, decay="cosine")
    assert s.lr_at(1, 1e-3, 1e-5) == pytest.approx(2.5e-4)  # first update already trains
    assert s.lr_at(4, 1e-3, 1e-5) == pytest.approx(1e-3)
    assert s.lr_at(12, 1e-3, 1e-5) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))  # half-way
    assert s.lr_at(20, 1e-3, 1e-5) == pytest.approx(1e-5)
    lrs = [s.lr_at(k, 1e-3, 1e-5) for k in range(4, 21)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    groups = [{"max_lr": 1e-3, "min_lr": 1e-5, "wd_mult": 1.0}, {"max_lr": 2e-4, "min_lr": 2e-6, "wd_mult": 0.0}]
    main = s.apply(groups, 4, weight_decay=0.1)
    assert main == pytest.approx(1e-3) and groups[1]["lr"] == pytest.approx(2e-4)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    with pytest.raises(ValueError):
        LRSchedule(max_lr=1e-3, min_lr=1e-5, warmup_steps=0, total_steps=10, decay="exp")


class _Toy(torch.nn.Module):
    """The module names of LlavaOVModel, at toy size."""

    def __init__(self):
        super().__init__()
        self.vision_model = torch.nn.Linear(4, 4)
        self.vision_projection = torch.nn.Linear(4, 4)
        self.language_model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


def test_freeze_and_param_groups_follow_the_declared_parts():
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.runtime.optimizer import ModelParts, apply_freeze, build_param_groups

    model = _Toy()
    parts = ModelParts([model], LLAVA_OV.parts)
    counts = apply_freeze([model], parts, ["vision_tower"])
    assert not any(p.requires_grad for p in model.vision_model.parameters())
    assert counts["frozen"] == 20 and counts["projector"] == 20 and counts["llm"] == 28
    cfg = SimpleNamespace(lr=1e-3, min_lr=1e-5, lr_mult={"vision_tower": 0.2}, weight_decay=0.1)
    groups = build_param_groups([model], parts, cfg)
    assert len(groups) == 2 * len(LLAVA_OV.parts)  # same structure on every rank, empty groups included
    by_id = {id(p): g for g in groups for p in g["params"]}
    assert id(model.vision_model.weight) not in by_id  # frozen: not in the optimizer
    assert by_id[id(model.vision_projection.weight)]["wd_mult"] == 1.0
    assert by_id[id(model.vision_projection.bias)]["wd_mult"] == 0.0
    assert by_id[id(model.language_model[1].weight)]["wd_mult"] == 0.0  # norm scale
    model2 = _Toy()
    groups2 = build_param_groups([model2], ModelParts([model2], LLAVA_OV.parts), cfg)
    vt = [g for g in groups2 if g["part"] == "vision_tower" and g["params"]]
    assert vt and all(g["max_lr"] == 2e-4 and g["min_lr"] == pytest.approx(2e-6) for g in vt)
    assert all(g["max_lr"] == 1e-3 and g["min_lr"] == 1e-5 for g in groups2 if g["part"] != "vision_tower")


def test_megatron_optimizer_groups_get_the_part_lrs(megatron_cpu):
    """The GPU optimizer path: megatron's own param grouping with our overrides gives the vision
    tower its multiplied LRs and no weight decay on biases / norm scales (built on CPU: only
    megatron's grouping runs, not its CUDA optimizer)."""
    from megatron.core.optimizer import _get_param_groups

    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.runtime.optimizer import ModelParts, megatron_optimizer_config

    model = _Toy()
    parts = ModelParts([model], LLAVA_OV.parts)
    cfg = SimpleNamespace(
        lr=1e-3,
        min_lr=1e-5,
        lr_mult={"vision_tower": 0.2},
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
    )
    ctx = SimpleNamespace(precision="fp32", params_dtype=torch.float32, distributed_optimizer=False)
    config, overrides = megatron_optimizer_config(parts, cfg, ctx)
    group_of = {id(p): g for g in _get_param_groups([model], config, overrides) for p in g["params"]}
    vt, proj = group_of[id(model.vision_model.weight)], group_of[id(model.vision_projection.weight)]
    assert (vt["max_lr"], vt["min_lr"]) == (pytest.approx(2e-4), pytest.approx(2e-6)) and vt["wd_mult"] == 1.0
    assert (proj["max_lr"], proj["min_lr"]) == (1e-3, 1e-5)
    assert group_of[id(model.vision_model.bias)]["wd_mult"] == 0.0 and group_of[id(model.vision_model.bias)][
        "max_lr"
    ] == pytest.approx(2e-4)
    assert group_of[id(model.language_model[1].weight)]["wd_mult"] == 0.0


def test_every_parameter_belongs_to_exactly_one_part():
    from mmtrain.runtime.optimizer import ModelParts

    model = _Toy()
    with pytest.raises(ValueError, match=r"'language_model\.0\.weight' belongs to 0 of the declared parts"):
        ModelParts([model], {"vision": ("vision_model",), "projector": ("vision_projection",)})
    with pytest.raises(ValueError, match="belongs to 2"):
        ModelParts([model], {"a": ("vision_model",), "b": ("vision_model", "vision_projection", "language_model")})
    # module paths match whole names, not prefixes of other names
    with pytest.raises(ValueError, match="belongs to 0"):
        ModelParts([model], {"a": ("vision",), "b": ("language_model", "vision_projection")})


def test_resolve_checkpoint_kinds(tmp_path):
    from mmtrain.runtime.checkpoint.layout import resolve_checkpoint

    full = tmp_path / "run" / "checkpoints" / "iter_0000004"
    (full / "model").mkdir(parents=True)
    (full / "trainer_state.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("4\n")
    assert resolve_checkpoint(tmp_path / "run") == ("mmtrain", full)
    assert resolve_checkpoint(full) == ("mmtrain", full)
    weights = tmp_path / "conv" / "iter_0000000"
    (weights / "model").mkdir(parents=True)
    (tmp_path / "conv" / "latest").write_text("0\n")
    assert resolve_checkpoint(tmp_path / "conv") == ("weights", weights)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert resolve_checkpoint(hf) == ("hf", hf)
    with pytest.raises(FileNotFoundError):
        resolve_checkpoint(tmp_path / "nothing")


def test_per_sample_loss_sums_follow_cu_seqlens():
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmtrain.runtime.loss import masked_loss_sum, per_sample_loss_sums

    token_loss = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    labels = torch.tensor([[1, 1, -100, 1, 1, -100], [1, -100, -100, -100, -100, -100]])
    # row 0: samples a (0..2) and b (3..5); row 1: sample c (6..7) then padding (8..11)
    batch = SimpleNamespace(sample_ids=[["a", "b"], ["c"]], cu_seqlens=torch.tensor([0, 3, 6, 8, 12]))
    mask = labels != IGNORE_INDEX
    loss_sum, n, _ = masked_loss_sum(token_loss, mask)
    assert float(loss_sum) == 0 + 1 + 3 + 4 + 6 and int(n) == 5
    assert per_sample_loss_sums(token_loss, mask.to(token_loss.dtype), batch).tolist() == [
        [1.0, 2.0],
        [7.0, 2.0],
        [6.0, 1.0],
    ]
