"""dry_run: analytical parameter counts match the real model; memory estimate behaves."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmtrain.config import load_recipe
from mmtrain.llava_ov.spec import LLAVA_OV
from mmtrain.models.shapes import decoder_layer_params, param_counts
from mmtrain.planning.cost_model import GB, Layout, estimate_memory
from mmtrain.planning.dry_run import build_report, run_dry_run

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TINY = RECIPES / "llava-ov-tiny.yaml"
AQUILA = RECIPES / "aquila-vl-2b.yaml"

# Builds the real megatron-core model (single process, TP=1) for a few variants of the tiny
# recipe, freezes it as training does, and prints sum(p.numel()) per declared part and what
# stays trainable.
_COUNT_SCRIPT = r"""
import json, sys
from mmtrain.config import load_recipe
from mmtrain.llava_ov.spec import LLAVA_OV
from mmtrain.runtime.distributed import ensure_model_parallel
from mmtrain.runtime.optimizer import ModelParts, apply_freeze
ensure_model_parallel(1, 1)
out = []
for overrides in json.loads(sys.argv[2]):
    r = load_recipe(sys.argv[1], overrides)
    m = LLAVA_OV.build_model(r.model)
    parts = ModelParts([m], LLAVA_OV.parts)
    apply_freeze([m], parts, r.freeze)
    counts = dict.fromkeys(LLAVA_OV.parts, 0)
    for p in m.parameters():
        counts[parts.part_of(p)] += p.numel()
    out.append(counts | {"total": sum(p.numel() for p in m.parameters()),
                         "trainable": sum(p.numel() for p in m.parameters() if p.requires_grad)})
print("COUNTS " + json.dumps(out))
"""

VARIANTS = [
    [],
    [
        "model.llm.tie_word_embeddings=false",
        "model.llm.qkv_bias=false",
        "model.llm.num_query_groups=4",
        "model.vision.image_size=56",
        "model.llm.vocab_size=1000",
    ],
    ["freeze=[vision_tower, llm]"],
]


@pytest.fixture(scope="module")
def real_counts():
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_SCRIPT, str(TINY), json.dumps(VARIANTS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COUNTS "))
    return json.loads(line[len("COUNTS ") :])


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_tiny_counts_equal_the_built_model(real_counts, variant):
    recipe = load_recipe(TINY, VARIANTS[variant])
    counts = param_counts(LLAVA_OV.model_shapes(recipe.model), recipe.freeze)
    real = real_counts[variant]
    assert counts.parts == {k: real[k] for k in ("vision_tower", "projector", "llm")}
    assert counts.total == real["total"]
    assert counts.total_trainable == real["trainable"]


@pytest.mark.unit
def test_aquila_counts_match_published_sizes():
    recipe = load_recipe(AQUILA, ["stage=2a"])
    c = param_counts(LLAVA_OV.model_shapes(recipe.model), recipe.freeze)
    # Qwen2.5-1.5B model card: 1.54B parameters (tied embeddings)
    assert c.parts["llm"] == pytest.approx(1.54e9, rel=0.01)
    # BAAI/Aquila-VL-2B-llava-qwen: 4.36 GB of bf16 safetensors, which store the tied lm_head
    # as its own tensor: 2.18B numbers
    assert c.total + c.decoder_embedding == pytest.approx(4.36e9 / 2, rel=0.01)
    # the same figure written out from the sizes (Qwen2.5-1.5B + SigLIP 26 layers + mlp2x_gelu)
    h, f, v, d = 1536, 8960, 151936, 128
    llm = v * h + 28 * (h * (12 + 2 * 2) * d + (12 + 2 * 2) * d + h * h + 3 * h * f + 2 * h) + h + h
    hv, fv = 1152, 4304
    vit = 3 * 14 * 14 * hv + hv + 729 * hv + 26 * (4 * hv * hv + 4 * hv + 2 * hv * fv + fv + hv + 4 * hv) + 2 * hv
    proj = hv * h + h * h + 2 * h
    assert (c.parts["llm"], c.parts["vision_tower"], c.parts["projector"]) == (llm, vit, proj)
    assert 1.9e9 < c.total < 2.0e9  # unique parameters: ~1.95B


def _mem(recipe, spec=LLAVA_OV, **layout):
    shapes = spec.model_shapes(recipe.model)
    return estimate_memory(shapes, recipe.freeze, Layout.from_recipe(recipe).with_(**layout))


@pytest.mark.unit
def test_memory_estimate_responds_to_the_layout():
    r = load_recipe(AQUILA, ["stage=2a", "parallel.cp=1", "parallel.recompute=full"])  # FlagScale's layout
    base = _mem(r)
    assert base.optimizer == pytest.approx(_mem(r, distributed_optimizer=False).optimizer / 8)
    assert _mem(r, recompute="none").activations > 5 * base.activations
    assert _mem(r, tp=2, dp=4, sequence_parallel=True).weights == pytest.approx(base.weights / 2, rel=0.01)
    assert _mem(r, pp=4, dp=2).weights < 0.5 * base.weights
    assert _mem(r, micro_batch_size=1).activations == pytest.approx(base.activations / 2)
    fp32 = _mem(r, precision="fp32")
    assert fp32.weights == pytest.approx(2 * base.weights)
    # stage 1 trains only the projector: no LLM/vision grads or optimizer states
    s1 = load_recipe(AQUILA, ["stage=1", "parallel.cp=1", "parallel.recompute=full"])
    m1 = _mem(s1)
    assert m1.grads == pytest.approx(param_counts(LLAVA_OV.model_shapes(s1.model)).parts["projector"] * 4)
    assert m1.total < base.total


@pytest.mark.unit
def test_dry_run_prints_counts_and_memory():
    recipe = load_recipe(AQUILA, ["stage=2a", "action=dry_run"])
    buf = io.StringIO()
    report = run_dry_run(recipe, LLAVA_OV, out=buf)
    text = buf.getvalue()
    for needle in (
        "vision_tower",
        "projector",
        "llm",
        "total",
        "memory per rank",
        "weights",
        "gradients",
        "optimizer states (sharded / dp x cp)",
        "activations (recompute none)",
        "logits + loss (chunked)",
        "tp 1 x pp 1 x cp 2 x dp 4",
        "without the distributed optimizer",
        "analytical model",
    ):
        assert needle in text, needle
    assert f"{report.params.total:,}" in text
    assert report.fits and 20 * GB < report.memory.total < 80 * GB
    stage1 = build_report(load_recipe(AQUILA, ["stage=1"]), LLAVA_OV)
    assert stage1.params.total_trainable == stage1.params.parts["projector"]
    assert "frozen" in stage1.text


@pytest.mark.unit
def test_dry_run_follows_the_pipeline_split_and_virtual_stages():
    """Aquila-VL-2B on pp 2 (64 micro-batches per DP rank): two decoder layers moved off the first
    stage (which also holds the vision tower, projector and embedding) take their weights,
    activations and compute to the last stage, and the step runs at the slower stage's pace;
    two virtual stages halve the bubble to (pp-1)/(vpp*m) of it and keep megatron's extra warm-up
    forwards of the first chunk in flight (3 instead of 2 through the vision tower)."""
    base = ["stage=2a", "action=dry_run", "parallel.cp=1", "parallel.pp=2"]
    recipe = load_recipe(AQUILA, base)
    even = build_report(recipe, LLAVA_OV)
    moved = build_report(load_recipe(AQUILA, [*base, "parallel.pp_layers=[12,16]"]), LLAVA_OV)
    virtual = build_report(load_recipe(AQUILA, [*base, "parallel.vpp=2"]), LLAVA_OV)
    assert [m.decoder_layers for m in even.stage_memory] == [14, 14]
    assert [m.decoder_layers for m in moved.stage_memory] == [12, 16]
    two_layers = 2 * decoder_layer_params(LLAVA_OV.model_shapes(recipe.model).decoder) * 2  # bf16 weights
    e, m = even.stage_memory, moved.stage_memory
    assert e[0].weights - m[0].weights == pytest.approx(two_layers)
    assert m[1].weights - e[1].weights == pytest.approx(two_layers)
    assert m[0].activations < e[0].activations and m[1].activations > e[1].activations
    assert m[0].encoder_activations == e[0].encoder_activations > 0 and m[1].encoder_activations == 0
    (e0, e1), (m0, m1) = even.step.stage_s, moved.step.stage_s
    assert e0 - m0 == pytest.approx(m1 - e1) and m0 < e0  # two layers' compute from stage 0 to stage 1
    for r in (even, moved, virtual):
        s = r.step
        assert s.compute_s + s.tp_comm_s + s.cp_comm_s == pytest.approx(max(s.stage_s))
        assert s.bubble_s == pytest.approx(s.compute_s * (2 - 1) / (r.layout.vpp * 64))
    assert virtual.step.bubble_s == pytest.approx(even.step.bubble_s / 2)
    assert virtual.step.stage_s == pytest.approx(even.step.stage_s)  # the same work per stage
    v = virtual.stage_memory[0]
    assert v.encoder_activations == pytest.approx(e[0].encoder_activations * 3 / 2)
    assert v.activations > e[0].activations and v.weights == e[0].weights
    assert "stage 0: 12 decoder layers + vision_tower, projector, embedding: " in moved.text
    assert "stage 1: 16 decoder layers + LM head + loss: " in moved.text
    assert "pipeline stages (1F1B; decoder layers [12, 16], parallel.pp_layers)" in moved.text
    assert "(interleaved 1F1B, 2 virtual stages per rank; decoder layers [[7, 7], [7, 7]], even split)" in virtual.text
    assert "stage 0: 14 decoder layers (7 + 7)" in virtual.text and "bubble (pp-1)/(vpp*m) = 1/(2*64)" in virtual.text
    assert (
        "tp 1 x pp 2 (x vpp 2) x cp 1 x dp 4" in virtual.text
        and "pipeline stages" not in build_report(load_recipe(AQUILA, ["stage=2a", "action=dry_run"]), LLAVA_OV).text
    )
    # a pp that does not divide the 28 layers: megatron refuses to build it; estimated spread evenly
    odd = build_report(load_recipe(AQUILA, [*base[:3], "parallel.pp=3", "parallel.nproc_per_node=6"]), LLAVA_OV)
    assert [m.decoder_layers for m in odd.stage_memory] == [9, 9, 10] and "which megatron refuses" in odd.text


@pytest.mark.unit
def test_cli_dry_run(capsys):
    from mmtrain.cli import main

    assert main(["llava-ov", str(AQUILA), "action=dry_run", "stage=2a"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "1,945,595,424 parameters" in out
    assert main(["llava-ov", str(AQUILA), "action=dry_run", "parallel.tp=5"]) == 2
    assert "parallel.tp=5" in capsys.readouterr().err


# ----------------------------------------------------------------------------- emu3

EMU3_TINY, EMU3_8B = RECIPES / "emu3-tiny.yaml", RECIPES / "emu3-8b.yaml"


def _hf_emu3_text_numel(llm) -> int:
    """numel of transformers' Emu3 text model + lm_head (Emu3ForConditionalGeneration without its
    VQ model) for these sizes, built on the meta device (no memory, any size)."""
    import torch
    from transformers import Emu3ForCausalLM, Emu3TextConfig

    from mmtrain.models.state_dict_adapter import hf_llama_text_config

    fields = {k: v for k, v in hf_llama_text_config(llm).items() if k not in ("attention_bias", "mlp_bias")}
    with torch.device("meta"):
        model = Emu3ForCausalLM(Emu3TextConfig(**fields, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.unit
def test_emu3_counts_equal_the_built_model_and_hf(megatron_cpu):
    from mmtrain.emu3.spec import EMU3

    recipe = load_recipe(EMU3_TINY)
    counts = param_counts(EMU3.model_shapes(recipe.model))
    built = EMU3.build_model(recipe.model)
    assert counts.total == sum(p.numel() for p in built.parameters())
    assert counts.vocab_padding == (1504 - 1503) * 64 * 2  # untied: embedding and output layer rows
    assert counts.unpadded_total == _hf_emu3_text_numel(recipe.model.llm)


@pytest.mark.unit
def test_emu3_8b_counts_equal_hf_and_the_layout_fits_80gb():
    from transformers import Emu3TextConfig

    from mmtrain.emu3.spec import EMU3

    recipe = load_recipe(EMU3_8B, ["action=dry_run"])
    llm = recipe.model.llm
    published = Emu3TextConfig()  # transformers' defaults are Emu3-8B's (Emu3-Chat-hf)
    assert (
        llm.num_layers,
        llm.hidden_size,
        llm.ffn_hidden_size,
        llm.num_attention_heads,
        llm.num_query_groups,
        llm.vocab_size,
        llm.rope_theta,
        llm.tie_word_embeddings,
    ) == (
        published.num_hidden_layers,
        published.hidden_size,
        published.intermediate_size,
        published.num_attention_heads,
        published.num_key_value_heads,
        published.vocab_size,
        published.rope_parameters["rope_theta"],
        published.tie_word_embeddings,
    )
    buf = io.StringIO()
    report = run_dry_run(recipe, EMU3, out=buf)
    assert report.params.unpadded_total == _hf_emu3_text_numel(llm) == 8_492_011_520
    assert f"{report.params.unpadded_total:,} parameters with the true vocabulary" in buf.getvalue()
    assert report.fits and report.memory.total < 0.9 * 80 * GB
    assert report.layout.seq_length >= 32768 and report.layout.tp * report.layout.dp == 8


@pytest.mark.unit
def test_emu3_8b_long_stage_fits_131072_tokens_with_context_parallelism():
    """Emu3's published 131,072-token chat context on the recipe's 8 GPUs: CP splits the
    sequence, the lean loss keeps the 184,622-word logits out of memory (full logits would
    take ~10x more)."""
    from mmtrain.emu3.spec import EMU3

    recipe = load_recipe(EMU3_8B, ["action=dry_run", "stage=long"])
    report = run_dry_run(recipe, EMU3, out=io.StringIO())
    L = report.layout
    assert (L.seq_length, L.cp, L.tp * L.cp * L.dp, L.tokens_per_rank) == (131072, 2, 8, 65536)
    assert report.fits and report.memory.total < 0.9 * 80 * GB
    assert report.memory.logits < 2.5 * GB
    assert _mem(recipe, EMU3, lm_loss="plain").logits > 8 * report.memory.logits


@pytest.mark.unit
def test_dry_run_footnotes_the_frozen_post_layernorm():
    """Issue 45: stage 2a trains the vision tower but shows `frozen 2.304K` for it; a footnote says
    what those are (the unused post-layernorm, mmtrain/llava_ov/vision.py)."""
    text = build_report(load_recipe(AQUILA, ["stage=2a"]), LLAVA_OV).text
    (row,) = [line for line in text.splitlines() if line.startswith("vision_tower")]
    assert row.split()[-1] == "2.304K"
    assert "(vision_tower's 2.304K frozen: the unused post-layernorm" in text
    stage1 = build_report(load_recipe(AQUILA, ["stage=1"]), LLAVA_OV).text
    assert "post-layernorm" not in stage1  # all of the tower frozen: nothing to explain


def test_dry_run_imports_neither_torch_nor_megatron():
    """Issue 45: a dry run of aquila-vl-2b printed nothing for up to 40 s on a busy machine: all of
    it was importing torch and megatron-core, which an analytical report does not need."""
    code = (
        "import sys; from mmtrain.cli import main; "
        f"rc = main(['train', {str(AQUILA)!r}, 'action=dry_run']); "
        "print('heavy:', sorted(m for m in ('torch', 'megatron.core', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert "memory per rank" in out and out.splitlines()[-1] == "heavy: []", out[-500:]
