"""The shared training runtime (launch, megatron DDP/schedules, optimizer, checkpoints, resume)
on the tiny LLaVA-OV recipe, real shards and the tiny tokenizer, on CPU/gloo.

Every training run is a real `mmtrain llava-ov recipes/llava-ov-tiny.yaml ...` subprocess; with
`parallel.nproc_per_node=2` the launcher starts the torchrun workers itself.

Fast tier: one reference run (loss decreases, metrics, checkpoint layout, keep-last), exact
resume, resume on a pipeline-parallel layout (re-sharded model + optimizer; also a PP=2 vs PP=1
loss-parity check on identical weights and batches, and the PP=2 validation loss), a checkpoint
of another architecture refused, frozen parameters (LLaVA-OV stage 1) and the next stage
starting from its weights only, periodic evaluation (`val_loss` at the eval steps only, the same
batches every time, no effect on training), context parallelism (CP=2 continuing the reference
run equals it, and its checkpoint resumed at CP=1). Slow tier: the layout parity matrix (TP=2
with sequence parallelism and selective recompute, PP=2 with full recompute, DP=2 from the same
HF weights; CP=2 with each of them on 4 processes; CP=2 on unpacked rows), TP=2 -> TP=1 resume
(the TP=2 run with the vision tower's own layout), DP=2 -> DP=1 resume, the new parallel features
together (an uneven decoder split and virtual stages at TP=2 with the vision tower's own layout
and vision-aware balancing: training and validation losses against one process, resumed from
and saved as a one-process checkpoint), exact resume inside a balancing window (`data.balance_window`), and the
dry-run memory estimate
against a measured peak.
The runtime's pure functions (LR schedule, parts and param groups, checkpoint resolution,
per-sample losses) are in test_runtime_units.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmdata.folder_lock import lock_path
from tests.fixtures_training import (
    assert_same_losses,
    train_env,
    FEATURES_TOGETHER,
    MMTRAIN,
    REPO,
    TINY_RECIPE,
    assert_same_steps,
    continue_at_cp2,
    free_port,
    interrupted_copy,
    metrics,
    read_dist_ckpt,
    train,
)

REQUIRED_METRICS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s")


# ----------------------------------------------------------------------------- fast: training


def test_reference_run_trains_logs_and_checkpoints(ref_run):
    import yaml

    m = metrics(ref_run)
    rows_per_step = yaml.safe_load((ref_run / "config.yaml").read_text())["train"]["global_batch_size"]
    assert sorted(m) == [1, 2, 3, 4, 5, 6]
    for rec in m.values():
        for key in REQUIRED_METRICS:
            assert rec[key] is not None, key
        assert rec["tokens_per_s"] > 0 and rec["samples_per_s"] > 0
        assert rec["mfu"] is None  # CPU: no honest peak to divide by
        assert rec["sample_ids"] and len(rec["sample_losses"]) == len(rec["sample_ids"])
        assert rec["num_loss_tokens"] > 0
        # the packing report: real tokens over the global batch's rows; no CP, so nothing computed beyond them
        assert rec["bin_fill"] == pytest.approx(rec["tokens"] / (rows_per_step * 1024))
        assert rec["executed_token_efficiency"] == pytest.approx(rec["bin_fill"]) and 0 < rec["bin_fill"] <= 1
    step_lines = [line for line in (ref_run.parent / "stderr.txt").read_text().splitlines() if "step 6/6 |" in line]
    fill, executed = m[6]["bin_fill"], m[6]["executed_token_efficiency"]
    assert step_lines and f"| fill {fill:.1%} | exec {executed:.1%} |" in step_lines[-1], step_lines
    # the synthetic data is learnable: the loss goes down
    assert (m[5]["loss"] + m[6]["loss"]) / 2 < m[1]["loss"] - 0.1
    # warmup then cosine decay to min_lr
    assert m[6]["lr"] == pytest.approx(1e-5) and m[2]["lr"] > m[6]["lr"]

    ckpts = ref_run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "6"
    assert sorted(d.name for d in ckpts.glob("iter_*")) == ["iter_0000004", "iter_0000006"]  # keep_last=2
    assert not list((ckpts / ".staging").glob("iter_*"))  # nothing half-written left
    last = ckpts / "iter_0000006"
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["layout"] == {"tp": 1, "pp": 1, "cp": 1, "dp": 1, "world_size": 1}
    for sub in ("model/metadata.json", "optimizer/metadata.json", "rng/rank_00000.pt", "config.yaml"):
        assert (last / sub).exists(), sub
    assert json.loads((last / "loader" / "loader_dp00000_of00001.json").read_text())
    assert (ref_run / "config.yaml").is_file()
    rng = torch.load(last / "rng" / "rank_00000.pt", weights_only=True)
    assert {"python", "numpy", "torch", "tracker"} <= set(rng)

    # `mmtrain worst-samples` points at the data of a step
    out = subprocess.run(
        [sys.executable, "-m", "mmtrain.cli", "worst-samples", str(ref_run), "--step", "1", "--top", "3"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert any(sid in out.stdout for sid in m[1]["sample_ids"])


def test_exact_resume(ref_run, tmp_path, shards_dir, tokenizer_dir):
    """Killed after step 4's checkpoint, rerun: steps 5-6 are the uninterrupted run's, exactly."""
    run = interrupted_copy(ref_run, tmp_path / "run", at_step=4)
    proc = train(run, shards_dir, tokenizer_dir, "train.iters=6", "checkpoint.interval=2", "checkpoint.keep_last=2")
    assert "resumed from" in proc.stderr
    # what a user reads: where the outputs go, an ETA per step, no third-party noise
    assert (
        f"run_dir {run}: metrics {run / 'metrics.jsonl'}, checkpoints {run / 'checkpoints'}/ (every 2 steps "
        "and at the end, keeping the last 2)"
    ) in proc.stderr
    step_lines = [line for line in proc.stderr.splitlines() if " | loss " in line]
    assert len(step_lines) == 2 and all(" | eta " in line for line in step_lines)
    assert "Warning" not in proc.stderr and "Filling reading buffer" not in proc.stderr
    ref, resumed = metrics(ref_run), metrics(run)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):
        assert resumed[step]["loss"] == ref[step]["loss"]
        assert resumed[step]["grad_norm"] == ref[step]["grad_norm"]
        assert resumed[step]["sample_ids"] == ref[step]["sample_ids"]


@pytest.mark.slow
def test_balancing_window_moves_rows_between_steps_and_resumes_inside_one(tmp_path, shards_dir, tokenizer_dir):
    """`data.balance` with `data.balance_window=4`: rows are placed over 4 steps at a time. At a
    learning rate of 0 (the weights never change, so a sample's loss does not depend on its step)
    the first window's 4 steps train the unbalanced run's 4 steps' samples with the same per-sample
    losses, rows moved between steps. The step-3 checkpoint falls inside the window: its loader
    file holds the state from before the window and the 3 steps trained, and a run killed there
    and rerun trains the window's 4th step and the next window's as the uninterrupted run did."""
    fixed = ("train.iters=6", "optimizer.lr=0", "optimizer.min_lr=0")
    plain, windowed = tmp_path / "plain", tmp_path / "windowed"
    train(plain, shards_dir, tokenizer_dir, *fixed, "checkpoint.save=false")
    window = (*fixed, "checkpoint.interval=3", "data.balance=true", "data.balance_window=4")
    train(windowed, shards_dir, tokenizer_dir, *window)
    want, got = metrics(plain), metrics(windowed)

    def by_sample(m: dict, steps) -> list:
        return sorted((i, x) for s in steps for i, x in zip(m[s]["sample_ids"], m[s]["sample_losses"]))

    first = range(1, 5)
    assert [i for i, _ in by_sample(got, first)] == [i for i, _ in by_sample(want, first)]
    assert [x for _, x in by_sample(got, first)] == pytest.approx(
        [x for _, x in by_sample(want, first)], rel=1e-5, abs=1e-6
    )
    assert any(got[s]["sample_ids"] != want[s]["sample_ids"] for s in first)  # rows moved between steps
    loader = json.loads(
        (windowed / "checkpoints" / "iter_0000003" / "loader" / "loader_dp00000_of00001.json").read_text()
    )
    assert loader["mmtrain.balance_window"] == {"steps": 4, "trained": 3}
    run = interrupted_copy(windowed, tmp_path / "run", at_step=3)
    proc = train(run, shards_dir, tokenizer_dir, *window)
    assert "resumed from" in proc.stderr
    assert "4 steps at a time (data.balance_window: 4)" in proc.stderr
    resumed = metrics(run)
    for step in (4, 5, 6):
        assert resumed[step]["loss"] == got[step]["loss"], step
        assert resumed[step]["grad_norm"] == got[step]["grad_norm"], step
        assert resumed[step]["sample_ids"] == got[step]["sample_ids"], step


def _saved_layout(run: Path, step: int) -> dict:
    """The parallel layout `run`'s step-`step` checkpoint records."""
    return json.loads((run / "checkpoints" / f"iter_{step:07d}" / "trainer_state.json").read_text())["layout"]


def _resume_in_one_process(run: Path, step: int, dst: Path, iters: int, shards_dir, tokenizer_dir):
    """`run`'s step-`step` checkpoint continued to step `iters` in one process in `dst`, saving nothing."""
    start = f"checkpoint.load={run / 'checkpoints' / f'iter_{step:07d}'}"
    return train(dst, shards_dir, tokenizer_dir, f"train.iters={iters}", "checkpoint.save=false", start)


def _continue_evaluated(eval_run, run, shards_dir, tokenizer_dir, *layout: str, nproc: int):
    """The evaluated run's step-4 checkpoint continued to step 6 in `layout` on `nproc` processes,
    evaluating every 2 steps (no interval checkpoints: the run's end saves step 6)."""
    start = f"checkpoint.load={eval_run / 'checkpoints' / 'iter_0000004'}"
    evaluation = ("train.eval_interval=2", "train.eval_iters=2", f"data.val_paths=[{shards_dir}]")
    overrides = ("train.iters=6", "checkpoint.interval=0", *layout, start, *evaluation)
    return train(run, shards_dir, tokenizer_dir, *overrides, nproc=nproc)


def test_resume_on_pipeline_parallel_layout(eval_run, tmp_path, shards_dir, tokenizer_dir):
    """A TP1/PP1 checkpoint continued on PP=2 (2 processes started by the launcher): model and
    optimizer re-shard through dist-checkpointing, the loader state carries over (same DP), and
    the PP=2 losses match the single-process run's on the same weights and batches. The run
    continued is the evaluated one (its training is the reference run's): the last stage reduces
    the validation loss to the single-process number. The launcher's workers train under the
    run_dir lock the launcher holds."""
    run = tmp_path / "pp2"
    proc = _continue_evaluated(eval_run, run, shards_dir, tokenizer_dir, "parallel.pp=2", nproc=2)
    assert "same layout: False, loader restored: True" in proc.stderr
    ref, pp2 = metrics(eval_run), metrics(run)
    assert sorted(pp2) == [5, 6]
    for step in (5, 6):
        assert pp2[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5, abs=1e-6)
        assert pp2[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4)
        assert pp2[step]["sample_ids"] == ref[step]["sample_ids"]
    assert _saved_layout(run, 6) == {"tp": 1, "pp": 2, "cp": 1, "dp": 1, "world_size": 2}
    assert "val_loss" not in pp2[5] and pp2[6]["val_tokens"] == ref[6]["val_tokens"]
    assert pp2[6]["val_loss"] == pytest.approx(ref[6]["val_loss"], rel=1e-5, abs=1e-6)
    # the launcher held the run_dir (mmdata/folder_lock.py) and its workers trained under it; released at the end
    assert not lock_path(run).exists()


def test_resume_refuses_a_checkpoint_of_another_architecture(ref_run, tmp_path, shards_dir, tokenizer_dir):
    """The recipe says 3 decoder layers, the checkpoint holds 2: refused before anything is built
    or written (the run checks before training, mmtrain/runtime/preflight.py), in one line naming
    the key (exit code 2), for a resume and for a weights-only start."""
    for extra in ((), ("checkpoint.weights_only=true",)):
        run_dir = tmp_path / f"run{len(extra)}"
        proc = train(
            run_dir,
            shards_dir,
            tokenizer_dir,
            "train.iters=6",
            "model.llm.num_layers=3",
            f"checkpoint.load={ref_run / 'checkpoints'}",
            *extra,
            expect_rc=2,
        )
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("  - checkpoint.load: ")]
        assert "model.llm.num_layers is 3 in the recipe but 2 in the checkpoint" in line
        assert "Traceback" not in proc.stderr and not run_dir.exists()


STAGE1 = ("train.iters=2", "optimizer.lr=1.0e-2")


@pytest.fixture(scope="module")
def stage1_run(tmp_path_factory, shards_dir, tokenizer_dir) -> Path:
    """LLaVA-OV stage 1: the vision tower and the LLM frozen, 2 steps, a checkpoint after each."""
    run = tmp_path_factory.mktemp("stage1") / "run"
    train(
        run,
        shards_dir,
        tokenizer_dir,
        *STAGE1,
        "checkpoint.interval=1",
        "checkpoint.keep_last=0",
        "freeze=[vision_tower, llm]",
    )
    return run


def test_frozen_parameters_do_not_change(stage1_run):
    """LLaVA-OV stage 1: only the projector trains."""
    run = stage1_run
    a = read_dist_ckpt(run / "checkpoints" / "iter_0000001" / "model")
    b = read_dist_ckpt(run / "checkpoints" / "iter_0000002" / "model")
    assert a.keys() == b.keys()
    projector = [k for k in a if k.startswith("vision_projection.")]
    frozen = [k for k in a if not k.startswith("vision_projection.")]
    assert (
        projector
        and any(k.startswith("vision_model.") for k in frozen)
        and any(k.startswith("language_model.") for k in frozen)
    )
    for k in frozen:
        assert torch.equal(a[k], b[k]), f"frozen {k} changed"
    assert all(not torch.equal(a[k], b[k]) for k in projector)
    optim = read_dist_ckpt(run / "checkpoints" / "iter_0000002" / "optimizer")
    assert optim and all(".vision_projection." in k for k in optim)  # no moments for frozen params


def test_next_stage_takes_weights_only(stage1_run, tmp_path, shards_dir, tokenizer_dir):
    """A later stage (`checkpoint.weights_only: true`) starts from the previous stage's weights
    with a fresh step counter, optimizer, LR schedule and data position, instead of resuming the
    previous run (which would restore its step and train nothing)."""
    stage2 = tmp_path / "stage2"
    train(
        stage2,
        shards_dir,
        tokenizer_dir,
        *STAGE1,
        f"checkpoint.load={stage1_run / 'checkpoints'}",
        "checkpoint.weights_only=true",
        "checkpoint.save=false",
    )
    first, second = metrics(stage1_run), metrics(stage2)
    assert sorted(second) == [1, 2]  # a fresh step counter: the stage really trains
    assert second[1]["lr"] == first[1]["lr"]  # a fresh LR schedule (warmup restarts)
    # same seed -> the same first batch; the trained weights fit it better than the random init
    assert second[1]["sample_ids"] == first[1]["sample_ids"]
    assert second[1]["loss"] < first[1]["loss"] - 1e-3


# ----------------------------------------------------------------------------- fast: evaluation


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, shards_dir, tokenizer_dir) -> Path:
    """`ref_run`'s recipe plus an evaluation every 2 steps (2 global batches; the validation data
    is the training shards, read by its own loader)."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    train(
        run_dir,
        shards_dir,
        tokenizer_dir,
        "train.iters=6",
        "checkpoint.interval=2",
        "checkpoint.keep_last=2",
        "train.eval_interval=2",
        "train.eval_iters=2",
        f"data.val_paths=[{shards_dir}]",
    )
    return run_dir


def test_evaluation_logs_val_loss_at_eval_steps(eval_run):
    m = metrics(eval_run)
    assert sorted(m) == [1, 2, 3, 4, 5, 6]
    assert [s for s in m if "val_loss" in m[s]] == [2, 4, 6]
    assert not any("val_tokens" in m[s] for s in (1, 3, 5))
    for step in (2, 4, 6):
        assert 0 < m[step]["val_loss"] < 20 and m[step]["val_tokens"] > 0
    assert m[6]["val_tokens"] == m[2]["val_tokens"]  # the same validation batches each time
    # the model trains on the data it is evaluated on, so the validation loss follows it down
    assert m[6]["val_loss"] < m[2]["val_loss"]


def test_evaluation_does_not_change_training(ref_run, eval_run):
    """Same recipe with and without evaluation: identical losses, weights and loader position."""
    ref, ev = metrics(ref_run), metrics(eval_run)
    for step in range(1, 7):
        assert ev[step]["loss"] == ref[step]["loss"], step
        assert ev[step]["grad_norm"] == ref[step]["grad_norm"], step
        assert ev[step]["sample_ids"] == ref[step]["sample_ids"], step
    last = Path("checkpoints") / "iter_0000006"
    a, b = read_dist_ckpt(ref_run / last / "model"), read_dist_ckpt(eval_run / last / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loader = last / "loader" / "loader_dp00000_of00001.json"
    assert (ref_run / loader).read_text() == (eval_run / loader).read_text()


def test_evaluations_on_the_same_weights_agree(tmp_path, shards_dir, tokenizer_dir):
    """With LR 0 the weights never change, so every evaluation must give the same number: the
    validation stream restarts from its first batch each time."""
    run = tmp_path / "run"
    proc = train(
        run,
        shards_dir,
        tokenizer_dir,
        "train.iters=2",
        "checkpoint.save=false",
        "optimizer.lr=0",
        "optimizer.min_lr=0",
        "train.eval_interval=1",
        "train.eval_iters=2",
        f"data.val_paths=[{shards_dir}]",
    )
    m = metrics(run)
    assert m[1]["val_loss"] == m[2]["val_loss"] and m[1]["val_tokens"] == m[2]["val_tokens"] > 0
    assert m[1]["loss"] != m[2]["loss"]  # while training moves on to other batches
    assert proc.stderr.count("| val_loss ") == 2


# ----------------------------------------------------------------------------- context parallelism


def test_context_parallel_continues_one_process_and_resumes_at_cp1(ref_run, tmp_path, shards_dir, tokenizer_dir):
    """CP=2 (2 processes; packed rows with images split over the ranks after splicing) continuing
    the one-process run from its step-4 checkpoint: steps 5-6 (losses, grad norms, per-sample
    losses, the samples) equal the one-process run's. Its step-5 checkpoint resumes at CP=1 and
    continues the CP=2 run: model, optimizer and loader state do not depend on CP, either way."""
    run = tmp_path / "cp2"
    proc, cp2 = continue_at_cp2(train, run, shards_dir, tokenizer_dir, ref_run, "checkpoint.interval=1")
    ref = metrics(ref_run)
    for step in (5, 6):  # the same rows, but CP pads every segment to 2*cp: more computed, fewer executed
        assert cp2[step]["bin_fill"] == pytest.approx(ref[step]["bin_fill"])
        assert cp2[step]["executed_token_efficiency"] < ref[step]["executed_token_efficiency"]
    assert f"| exec {cp2[6]['executed_token_efficiency']:.1%} |" in proc.stderr
    assert _saved_layout(run, 5) == {"tp": 1, "pp": 1, "cp": 2, "dp": 1, "world_size": 2}
    cp1 = tmp_path / "cp1"
    proc = _resume_in_one_process(run, 5, cp1, 6, shards_dir, tokenizer_dir)
    assert "same layout: False, loader restored: True" in proc.stderr
    resumed = metrics(cp1)
    assert sorted(resumed) == [6]
    assert_same_steps(resumed, cp2, (6,))


# ----------------------------------------------------------------------------- slow: layout matrix


def write_tiny_hf_model(recipe_path: Path, out: Path) -> Path:
    """A random HF LLaVA-OV with the tiny recipe's sizes: the common starting point of the parity
    runs (each layout converts it on the fly through the model's state-dict adapter)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    from mmtrain.config import load_recipe
    from mmtrain.llava_ov.state_dict_adapter import hf_config_from_llava

    recipe = load_recipe(recipe_path, ["action=dry_run"])
    cfg = hf_config_from_llava(recipe.model)
    cfg.pop("model_type", None)
    cfg.pop("architectures", None)
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration(LlavaOnevisionConfig(**cfg))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def parity_reference(tmp_path_factory, shards_dir, tokenizer_dir):
    base = tmp_path_factory.mktemp("parity")
    hf = write_tiny_hf_model(TINY_RECIPE, base / "hf")
    ref = base / "ref"
    common = ("train.iters=3", "checkpoint.save=false", "data.sharding=replicated", f"checkpoint.load={hf}")
    train(ref, shards_dir, tokenizer_dir, *common)
    return common, metrics(ref)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.recompute=selective"),
        ("parallel.pp=2", "parallel.recompute=full"),
        ("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
        ("parallel.cp=2", "parallel.pp=2"),
        ("parallel.cp=2",),
    ],
    ids=["tp2-sp-recompute-selective", "pp2-recompute-full", "tp2-sp-cp2", "pp2-cp2", "dp2-cp2"],
)
def test_layout_parity(layout, parity_reference, tmp_path, shards_dir, tokenizer_dir):
    """Same HF weights, same global batches (`data.sharding=replicated`): TP=2 and PP=2 (2
    processes each; DP=2: test_data_parallel_checkpoint_resumes_at_dp1), and each of them with
    CP=2 (4 processes: the gradient reduction over the data-parallel x CP group, the loss over the
    CP group, pipeline shapes of per-rank token counts), reproduce the single-process losses of the
    first steps. Activation recompute and sequence parallelism change memory and communication,
    not the math: the TP=2 run has sequence parallelism and selective recompute, the PP=2 run full
    recompute."""
    common, ref = parity_reference
    run = tmp_path / "run"
    train(run, shards_dir, tokenizer_dir, *common, *layout, nproc=4 if "parallel.cp=2" in layout else 2)
    got = metrics(run)
    assert sorted(got) == [1, 2, 3]
    assert_same_losses(got, ref, (1, 2, 3))


@pytest.mark.slow
def test_uneven_and_virtual_pipeline_stages_with_the_vision_layout_and_balance_match_one_process(
    eval_run, tmp_path, shards_dir, tokenizer_dir
):
    """The new parallel features together (4 processes): the evaluated one-process run's step-4
    checkpoint continued on TP=2 x PP=2 x VPP=2 (megatron's interleaved 1F1B) with the decoder
    split [0, 1, 0, 1] per virtual stage (stage 0 holds only the vision tower, projector and
    embedding: two chunks without decoder layers; stage 1 both layers and the loss), the vision
    tower's own layout (`parallel.vision.tp=1`: whole on each TP rank of the first chunk, half the
    tiles each, its gradients summed through megatron's TP average across the chunks' DDPs) and
    `data.balance` (each step's rows placed by cost over the micro-batches, the same on every
    stage). Steps 5-6 (losses, grad norms, per-sample losses by sample) and the step-6 validation
    loss (the interleaved schedule forward only) equal the one-process run's, and the step-6
    checkpoint holds the same tensors under the same names (layers stacked on a global layer
    axis; the replicated tower saved whole), weights and optimizer moments alike: it resumes at
    any split and layout. (It is also the pipeline's validation-loss check: the last stage
    reduces it to the one-process number.)"""
    run = tmp_path / "tp2-pp2-vpp2"
    proc = _continue_evaluated(eval_run, run, shards_dir, tokenizer_dir, *FEATURES_TOGETHER, nproc=4)
    assert "decoder layers per stage [[0, 0], [1, 1]], 2 virtual stages per rank" in proc.stderr
    assert "vision tower: its own layout, TP 1; a micro-batch's tiles split over 2 ranks" in proc.stderr
    assert "same layout: False, loader restored: True" in proc.stderr
    ref, got = metrics(eval_run), metrics(run)
    assert sorted(got) == [5, 6]
    assert_same_steps(got, ref, (5, 6), any_order=True)
    assert any(got[s]["sample_ids"] != ref[s]["sample_ids"] for s in (5, 6))  # balancing did move rows
    assert got[6]["val_loss"] == pytest.approx(ref[6]["val_loss"], rel=1e-5, abs=1e-6)
    last = Path("checkpoints") / "iter_0000006"
    for part in ("model", "optimizer"):
        a, b = read_dist_ckpt(eval_run / last / part), read_dist_ckpt(run / last / part)
        assert a.keys() == b.keys(), part
        assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a), part
    assert a["optimizer.state.exp_avg.language_model.decoder.layers.mlp.linear_fc1.weight"].shape[0] == 2


@pytest.mark.slow
def test_tensor_parallel_checkpoint_resumes_at_tp1(tmp_path, shards_dir, tokenizer_dir):
    """A TP=2 checkpoint (vocab-parallel embedding, column/row-parallel linears, sharded Adam
    moments) continued at TP=1 follows the TP=2 run's loss curve. The TP=2 run gives the vision
    tower its own layout (`parallel.vision.tp=1`: whole on each rank, half the tiles each): its
    weights and moments are saved whole, its step-3 update (grad norm, clipping) is TP=1's, and
    across the switch the checkpoint resumes (the other direction: tests/test_vision_layout.py).
    The TP=2 run is started by a launcher that is not ours (`torchrun --nproc_per_node 2 mmtrain
    ...`) without `parallel.nproc_per_node`: its world comes from torchrun's environment."""
    tp2 = tmp_path / "tp2"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        *MMTRAIN[1:],
        f"run_dir={tp2}",
        f"data.paths=[{shards_dir}]",
        f"tokenizer.path={tokenizer_dir}",
        "data.num_workers=1",
        "train.seq_length=1024",
        "logging.tensorboard=false",
        "train.iters=4",
        "checkpoint.interval=2",
        "parallel.tp=2",
        "parallel.vision.tp=1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=train_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "vision tower: its own layout, TP 1; a micro-batch's tiles split over 2 ranks" in proc.stderr
    assert _saved_layout(tp2, 2) == {"tp": 2, "pp": 1, "cp": 1, "dp": 1, "world_size": 2}
    tp1 = tmp_path / "tp1"
    proc = _resume_in_one_process(tp2, 2, tp1, 4, shards_dir, tokenizer_dir)
    assert "same layout: False" in proc.stderr
    a, b = metrics(tp2), metrics(tp1)
    assert sorted(a) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5, abs=1e-6)
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_data_parallel_checkpoint_resumes_at_dp1(parity_reference, tmp_path, shards_dir, tokenizer_dir):
    """DP=2 (2 processes) from the parity runs' HF weights reproduces the single-process losses;
    DP=2 -> DP=1 with `data.sharding=replicated`: the loader state moves with the checkpoint
    (energon refuses per-DP-rank states at another DP size), so the continuation is exact."""
    common, ref = parity_reference
    dp2 = tmp_path / "dp2"
    train(dp2, shards_dir, tokenizer_dir, *common, "checkpoint.save=true", "checkpoint.interval=2", nproc=2)
    a = metrics(dp2)
    assert sorted(a) == [1, 2, 3]
    assert_same_losses(a, ref, (1, 2, 3))
    dp1 = tmp_path / "dp1"
    proc = train(dp1, shards_dir, tokenizer_dir, *common, f"checkpoint.load={dp2 / 'checkpoints' / 'iter_0000002'}")
    assert "same layout: False, loader restored: True" in proc.stderr
    b = metrics(dp1)
    assert sorted(b) == [3]
    assert b[3]["loss"] == pytest.approx(a[3]["loss"], rel=1e-5, abs=1e-6)
    assert b[3]["sample_ids"] == a[3]["sample_ids"]


@pytest.mark.slow
def test_context_parallel_unpacked_rows(parity_reference, tmp_path, shards_dir, tokenizer_dir):
    """Unpacked rows (one sample + a padding run each) at CP=2 equal one process."""
    common, _ = parity_reference
    runs = {}
    for name, extra, nproc in (("cp1", (), 1), ("cp2", ("parallel.cp=2",), 2)):
        runs[name] = tmp_path / name
        train(runs[name], shards_dir, tokenizer_dir, *common, "data.packing=false", *extra, nproc=nproc)
    assert_same_steps(metrics(runs["cp2"]), metrics(runs["cp1"]), (1, 2, 3))


@pytest.mark.slow
def test_dry_run_memory_matches_a_measured_peak(tmp_path, shards_dir, tokenizer_dir):
    """The dry-run estimate of a recipe against the peak memory two training steps of it take
    on CPU (RSS over the steps minus RSS before the model was built), with the chunked and the
    full-logits loss: each total within 20% of the measured peak, and the memory the chunked loss
    saves as estimated within 25%. A decoder-heavy shape (vocab 32,768, 4,096 tokens) so the
    modelled parts dominate the process's own noise."""
    out = {}
    for loss in ("chunked", "plain"):
        result = tmp_path / f"{loss}.json"
        overrides = [
            f"run_dir={tmp_path / loss}",
            f"data.paths=[{shards_dir}]",
            f"tokenizer.path={tokenizer_dir}",
            "data.num_workers=1",
            "logging.tensorboard=false",
            "train.seq_length=4096",
            "model.llm.vocab_size=32768",
            "model.llm.hidden_size=256",
            "model.llm.ffn_hidden_size=1024",
            "model.llm.num_layers=4",
            "train.global_batch_size=1",
            f"parallel.lm_loss={loss}",
            "auto_tune.media_token_fraction=0.5",
        ]
        # large blocks always from mmap, so RSS follows what is live (no heap fragmentation)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "tests" / "workers" / "memory_worker.py"),
                str(TINY_RECIPE),
                str(result),
                json.dumps(overrides),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stderr[-5000:]
        out[loss] = json.loads(result.read_text())
    for loss, r in out.items():
        assert r["total"] == pytest.approx(r["measured"], rel=0.2), (loss, r)
    saved_measured = out["plain"]["measured"] - out["chunked"]["measured"]
    saved_estimate = out["plain"]["estimate"]["logits"] - out["chunked"]["estimate"]["logits"]
    assert saved_measured == pytest.approx(saved_estimate, rel=0.25)
