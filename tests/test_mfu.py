"""MFU accounting (review B1): model FLOPs of a step from its real packed layout, freeze set and media.

Every expected number below is worked out by hand from a tiny shape, so a change in the formula
shows up as a changed number rather than as a re-derived one:

decoder: 2 layers, hidden 64, FFN 128, 4 heads x 16 channels (q = 64), 2 KV groups (kv = 32),
vocabulary 1000 (tied, no padding), no qkv bias. Parameters per layer:
    attention  64 x (64 + 2 x 32) + 64 x 64 = 8192 + 4096 = 12288
    SwiGLU     64 x 2 x 128 + 128 x 64      = 16384 + 8192 = 24576
    2 norms    2 x 64                        = 128            -> 36992
  forward per position: 2 layers x 2 x 36992 + LM head 2 x 64 x 1000 = 147968 + 128000 = 275968
  causal attention per sample of length n: 2 layers x 2 x q x n^2 = 256 n^2 (half of Q K^T + P V)
encoder (per tile of 28 px at patch 14 = 4 patches): 2 layers, hidden 32, FFN 64, 3 channels
    layer params 3x32x32 + 96 + 32x32 + 32 + 32x64 + 64 + 64x32 + 32 + 4x32 = 8544
    per tile: layers 4 x 2 x 2 x 8544 = 136704, attention 2 x 4 x 32 x 4^2 = 4096,
    patch conv 4 x 2 x (3 x 14 x 14) x 32 = 150528
projector (per patch): Linear(32 -> 64) = 2048 weights reading the tower, Linear(64 -> 64) = 4096
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.tiny_models import tiny_llm
from mmtrain.models.shapes import Connector, DecoderShape, EncoderShape, ModelShapes
from tests.fixtures_training import bf16_layout, logging_trainer, step_result

pytestmark = pytest.mark.unit

DEC = DecoderShape.from_llm(tiny_llm(2, 64, 128, 4, 2, vocab=1000, positions=4096, qkv_bias=False), 1)
ENC = EncoderShape(layers=2, hidden=32, ffn=64, heads=2, image_size=28, patch_size=14, channels=3)
TEXT = ModelShapes(decoder=DEC, decoder_part="llm")  # an Emu3-like family: no encoder
VLM = ModelShapes(
    decoder=DEC,
    decoder_part="llm",
    encoder=ENC,
    encoder_part="vision_tower",
    connectors=(Connector("projector", 6144 + 128, 6144, input_matmul_params=2048), Connector("llm", 64)),
)
PER_TOKEN = 2 * 2 * 36992 + 2 * 64 * 1000  # = 275968


def test_hand_numbers_of_the_tiny_shape():
    from mmtrain.models.shapes import decoder_layer_params, encoder_layer_params

    assert decoder_layer_params(DEC) == 36992 and PER_TOKEN == 275968
    assert encoder_layer_params(ENC) == 8544 and ENC.patches == 4


def test_one_4096_sample_vs_four_1024_samples_in_a_row():
    """THD attention runs per packed sample: four 1024-token samples cost a quarter of the
    attention of one 4096-token sample (sum len^2 = 4 x 1024^2 vs 4096^2); the matmuls are the same."""
    from mmtrain.models.flops import step_flops

    one = step_flops(TEXT, [[0, 4096]], 0, ["llm"])
    four = step_flops(TEXT, [[0, 1024, 2048, 3072, 4096]], 0, ["llm"])
    # one sample:  3 x (4096 x 275968 + 256 x 4096^2) = 3 x (1130364928 + 4294967296) = 16275996672
    assert one.total == 3 * (4096 * 275968 + 256 * 4096**2) == 16_275_996_672
    # four samples: 3 x (4096 x 275968 + 256 x 4 x 1024^2) = 3 x (1130364928 + 1073741824) = 6612320256
    assert four.total == 3 * (4096 * 275968 + 256 * 4 * 1024**2) == 6_612_320_256
    assert (one.tokens, one.sum_len_sq, four.sum_len_sq) == (4096, 4096**2, 4 * 1024**2)
    # micro-batches (or rows) add up: two rows of two 1024-token samples = the four-sample row
    assert step_flops(TEXT, [[0, 1024, 2048], [0, 1024, 2048]], 0, ["llm"]).total == four.total


def test_the_old_whole_row_formula_is_the_one_sample_case():
    """`training_flops_per_token` (planning) is the one-sample-per-row, all-trained case."""
    from mmtrain.models.flops import step_flops, training_flops_per_token

    assert training_flops_per_token(TEXT, 4096) * 4096 == pytest.approx(step_flops(TEXT, [[0, 4096]], 0, ["llm"]).total)


def test_cp_padding_counted_as_executed():
    """Under CP every segment is padded to 2*cp*tp (here 8): a 1000-token sample stays 1000, a
    30-token padding run becomes 32; both run through the matmuls and attention."""
    from mmtrain.models.flops import executed_lengths, step_flops

    assert executed_lengths(torch.tensor([0, 1000, 1030], dtype=torch.int32), pad_to=8) == [1000, 32]
    f = step_flops(TEXT, [[0, 1000, 1030]], 0, ["llm"], pad_to=8)
    # 3 x ((1000 + 32) x 275968 + 256 x (1000^2 + 32^2)) = 3 x (284798976 + 256262144) = 1623183360
    assert f.total == 3 * (1032 * 275968 + 256 * (1000**2 + 32**2)) == 1_623_183_360


def test_frozen_llm_at_stage_1_counts_2x_and_the_frozen_tower_1x():
    """LLaVA-OV stage 1: tower and LLM frozen, projector trained. One row of two 1024-token
    samples, three tiles (12 patches)."""
    from mmtrain.models.flops import part_passes, step_flops

    p = part_passes(VLM, ["projector"])
    assert (p["vision_tower"].weights, p["vision_tower"].core, p["vision_tower"].inputs) == (1, 1, 1)
    assert (p["projector"].weights, p["projector"].inputs) == (3, 2)  # no input grad into a frozen tower
    assert (p["llm"].weights, p["llm"].core) == (2, 3)  # input grads only; attention's dQ, dK, dV

    f = step_flops(VLM, [[0, 1024, 2048]], 3, ["projector"])
    # LLM: 2 x 2048 x 275968 + 3 x 256 x 2 x 1024^2 = 1130364928 + 1610612736 = 2740977664
    assert f.by_part["llm"] == 2 * 2048 * 275968 + 3 * 256 * 2 * 1024**2 == 2_740_977_664
    # tower, forward only: 3 tiles x (136704 + 4096 + 150528) = 873984
    assert f.by_part["vision_tower"] == 3 * (136704 + 4096 + 150528) == 873_984
    # projector on 12 patches: 3 x 12 x 2 x 4096 + 2 x 12 x 2 x 2048 = 294912 + 98304 = 393216
    assert f.by_part["projector"] == 3 * 12 * 2 * 4096 + 2 * 12 * 2 * 2048 == 393_216
    assert f.total == 2_740_977_664 + 873_984 + 393_216
    # what d23ed41 logged for the same step: 3 x (decoder + head) with attention over the whole row
    # = 3 x (565182464 + 1073741824) = 4916772864: 1.79x the real count on this small model
    old = 3 * (2048 * 275968 + 256 * 2048**2)
    assert old == 4_916_772_864 and old / f.total == pytest.approx(1.793, abs=1e-3)


def test_vision_tower_counted_when_everything_trains():
    from mmtrain.models.flops import step_flops

    f = step_flops(VLM, [[0, 1024, 2048]], 3, ["vision_tower", "projector", "llm"])
    # tower trains, nothing before it: layers and attention 3x, the patch conv 2x (no pixel grads)
    assert f.by_part["vision_tower"] == 3 * 3 * (136704 + 4096) + 2 * 3 * 150528 == 2_170_368
    assert f.by_part["projector"] == 3 * 12 * 2 * (4096 + 2048) == 442_368
    assert f.by_part["llm"] == 3 * (2048 * 275968 + 256 * 2 * 1024**2) == 3_306_160_128  # 3 x (565182464 + 536870912)
    assert step_flops(VLM, [[0, 1024, 2048]], 0, ["vision_tower", "projector", "llm"]).by_part.keys() == {"llm"}


def _llava_batch(cu: list[int], tiles: list[int]):
    from mmdata.energon_loaders.llava_ov.batch import LlavaOVBatch

    s, n = cu[-1], len(tiles)
    z = torch.zeros(1, s, dtype=torch.int64)
    return LlavaOVBatch(
        input_ids=z,
        labels=z,
        position_ids=z,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in zip(cu, cu[1:])),
        pixel_values=torch.zeros(sum(tiles), 3, 28, 28, dtype=torch.uint8),
        tiles_per_media=torch.tensor(tiles),
        media_kind=torch.zeros(n, dtype=torch.int64),
        image_sizes=torch.zeros(n, 2, dtype=torch.int64),
        grid_shapes=torch.zeros(n, 2, dtype=torch.int64),
        num_media_tokens=torch.zeros(n, dtype=torch.int64),
    )


def test_trainer_step_flops_from_its_micro_batches():
    """What `Trainer.train_step` adds to the step's counts (`StepMetrics`): the batches' host
    cu_seqlens, the family's tile count and the recipe's freeze set (stage 1)."""
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.runtime.step_metrics import StepMetrics

    t = StepMetrics(LLAVA_OV, VLM, freeze=["vision_tower", "llm"], ctx=SimpleNamespace(cp=1, tp=1))
    batches = [_llava_batch([0, 1024, 2048], [1, 2]), _llava_batch([0, 4096], [])]
    assert LLAVA_OV.encoder_inputs(batches[0]) == 3 and LLAVA_OV.encoder_inputs(batches[1]) == 0
    flops = t.model_flops(batches)
    second = 2 * 4096 * 275968 + 3 * 256 * 4096**2  # the frozen LLM on one 4096-token sample
    assert flops == 2_740_977_664 + 873_984 + 393_216 + second


def test_logged_mfu_uses_the_step_flops():
    """`_log` divides the step's FLOPs (not flops-per-token x tokens/s) by time, devices and peak."""
    t, records = logging_trainer(world_size=2, interval=1000, peak_flops=1e12)
    r = step_result(flops=6e12)
    t._log(r)
    assert records[0]["mfu"] == pytest.approx(6e12 / 2.0 / (2 * 1e12))  # 1.5 TFLOP/s per device / 1 TFLOP/s
    assert records[0]["model_tflops_per_s"] == pytest.approx(1.5)
    t.peak_flops = None  # CPU: no honest peak
    t._log(r)
    assert records[1]["mfu"] is None and records[1]["model_tflops_per_s"] == pytest.approx(1.5)


def test_planning_estimate_follows_the_freeze_set():
    """dry_run / auto_tune count a frozen LLM under a trained projector at 2x (matmuls) and the
    frozen tower at 1x, the same rule as the train loop."""
    from mmtrain.models.flops import step_flops
    from mmtrain.planning.cost_model import Hardware, estimate_step_time

    layout = bf16_layout(global_batch_size=4, seq_length=2048)
    hw = Hardware(100.0, 0.5, 100.0, 100.0)
    est = estimate_step_time(VLM, ["vision_tower", "llm"], layout, hw, media_token_fraction=0.0)
    assert est.model_flops == 4 * step_flops(VLM, [[0, 2048]], 0, ["projector"]).total
    assert est.model_flops == 4 * (2 * 2048 * 275968 + 3 * 256 * 2048**2)


# ----------------------------------------------------------------------------- review N7: padding, HFU, peak


def test_a_rows_padding_run_is_not_model_flops():
    """Review N7: a row's padding run is one `cu_seqlens` segment, but no model work. With the
    row's real samples given (`len(sample_ids[row])`), only their segments count, as
    `per_sample_loss_sums` reads them; without, every segment counts (what the device executes)."""
    from mmtrain.models.flops import sample_lengths, step_flops

    one_sample = step_flops(TEXT, [[0, 70, 1024]], 0, ["llm"], samples=[[1]])
    assert one_sample == step_flops(TEXT, [[0, 70]], 0, ["llm"])
    assert one_sample.total == 3 * (70 * 275968 + 256 * 70**2) and one_sample.tokens == 70
    executed = step_flops(TEXT, [[0, 70, 1024]], 0, ["llm"])
    assert executed.total == 3 * (1024 * 275968 + 256 * (70**2 + 954**2))
    # two rows of 64 in one micro-batch's stream: samples [10, 20] + padding, then [20] + padding
    cu = torch.tensor([0, 10, 30, 64, 84, 128], dtype=torch.int32)
    assert sample_lengths(cu, [2, 1]) == [10, 20, 20]
    assert step_flops(TEXT, [cu], 0, ["llm"], samples=[[2, 1]]) == step_flops(TEXT, [[0, 10, 30, 50]], 0, ["llm"])
    # a full row has no padding run: both counts agree
    assert step_flops(TEXT, [[0, 30, 64]], 0, ["llm"], samples=[[2]]) == step_flops(TEXT, [[0, 30, 64]], 0, ["llm"])
    with pytest.raises(ValueError, match="not 3 rows"):
        sample_lengths([0, 10, 64], [1, 1, 1])


def _text_batch(rows: list[list[int]], seq_length: int):
    """A PackedBatch of rows holding samples of these lengths, each row padded to `seq_length`."""
    from mmdata.energon_loaders.batch import PackedBatch

    lens = [n for row in rows for n in row + ([seq_length - sum(row)] if sum(row) < seq_length else [])]
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    z = torch.zeros(len(rows), seq_length, dtype=torch.int64)
    return PackedBatch(
        input_ids=z,
        labels=z,
        position_ids=z,
        cu_seqlens=cu,
        max_seqlen=max(lens),
        sample_ids=[[f"s{r}_{k}" for k in range(len(row))] for r, row in enumerate(rows)],
        num_real_tokens=sum(map(sum, rows)),
    )


def test_step_metrics_count_model_flops_for_the_mfu_and_executed_flops_for_the_hfu():
    """The trainer's counts (`StepMetrics`): the MFU's FLOPs are the real samples' (the tiny
    recipe's unpacked row of one 70-token sample in 1024 was charged x23 before), the HFU's what
    ran: the padding run, CP padding and recompute's extra forward."""
    from mmtrain.models.flops import recomputed_layer_count
    from mmtrain.runtime.step_metrics import StepMetrics

    spec = SimpleNamespace(parts=["llm"], encoder_inputs=None)
    batch = _text_batch([[70]], 1024)
    plain = StepMetrics(spec, TEXT, freeze=[], ctx=SimpleNamespace(cp=1, tp=1))
    real = 3 * (70 * 275968 + 256 * 70**2)
    executed = 3 * (1024 * 275968 + 256 * (70**2 + 954**2))
    assert plain.model_flops([batch]) == real
    assert plain.hardware_flops([batch]) == executed
    # full recompute of both layers: one more forward of the layers (not the LM head)
    full = StepMetrics(
        spec,
        TEXT,
        freeze=[],
        ctx=SimpleNamespace(cp=1, tp=1),
        recompute="full",
        recomputed_layers=recomputed_layer_count([2], 0),
    )
    assert full.hardware_flops([batch]) == executed + 2 * 2 * 36992 * 1024 + 256 * (70**2 + 954**2)
    assert full.model_flops([batch]) == real  # recompute is not model work
    # selective: the core attention of every layer again
    selective = StepMetrics(spec, TEXT, freeze=[], ctx=SimpleNamespace(cp=1, tp=1), recompute="selective")
    assert selective.hardware_flops([batch]) == executed + 256 * (70**2 + 954**2)
    # block recompute of 1 layer per chunk: over chunks [1, 1] both layers, over [2, 2] one of each
    assert recomputed_layer_count([1, 1], 1) == 2 and recomputed_layer_count([2, 2], 1) == 2
    # CP pads every segment to 2*cp*tp (8 here): 70 -> 72, 954 -> 960, executed only
    cp = StepMetrics(spec, TEXT, freeze=[], ctx=SimpleNamespace(cp=4, tp=1))
    assert cp.model_flops([batch]) == real
    assert cp.hardware_flops([batch]) == 3 * (1032 * 275968 + 256 * (72**2 + 960**2))


def test_a_frozen_model_recomputes_nothing():
    from mmtrain.models.flops import recompute_flops, step_flops

    f = step_flops(VLM, [[0, 1024]], 0, [])
    assert recompute_flops(VLM, f, [], "full", 2) == 0 and recompute_flops(VLM, f, [], "selective") == 0
    # the LLM frozen under a trained projector still back-propagates, so it recomputes
    assert recompute_flops(VLM, f, ["projector"], "selective") == 256 * 1024**2


def test_logged_hfu_next_to_the_mfu():
    t, records = logging_trainer(world_size=2, interval=1, peak_flops=1e12)
    r = step_result(flops=6e12, hardware_flops=8e12)
    t._log(r)
    assert records[0]["mfu"] == pytest.approx(1.5) and records[0]["hfu"] == pytest.approx(2.0)
    t.peak_flops = None
    t._log(r)
    assert records[1]["mfu"] is None and records[1]["hfu"] is None


@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),  # SXM5
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "bf16", 835.0),
        ("NVIDIA H100 PCIe", "fp32", 378.0),  # TF32
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA H100 96GB something new", "bf16", None),  # not listed: no MFU rather than another part's peak
        ("NVIDIA GeForce RTX 4090", "bf16", None),
    ],
)
def test_peak_from_the_exact_device_name(name, precision, tflops, monkeypatch):
    """Review N7: "H100 PCIe" and "H100 NVL" got the SXM figure by name fragment."""
    from mmtrain.models.hardware import peak_tflops
    from mmtrain.runtime.throughput import device_peak_flops

    assert peak_tflops(name, precision) == tflops
    monkeypatch.delenv("MMTRAIN_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    expected = tflops * 1e12 if tflops is not None else None
    assert device_peak_flops(torch.device("cuda", 0), precision) == expected
