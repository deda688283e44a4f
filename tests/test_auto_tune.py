"""auto_tune: the search space (only layouts megatron accepts), pruning by the memory model,
trial order, pruning by history after a simulated OOM and a slow result, the budget stop, reuse
of history.csv, calibration, failure classification, and a non-zero exit when nothing fits.

Trials are simulated here (a function of the layout standing in for `trials.run_trial`); the
real search with 2 CPU processes is the slow test at the end."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from mmtrain.config import load_recipe
from mmtrain.llava_ov.spec import LLAVA_OV
from mmtrain.planning import auto_tune as at
from mmtrain.planning.calibration import Calibration, calibrated_errors, fit
from mmtrain.planning.search_space import (
    DIMENSIONS,
    SpaceContext,
    apply_layout,
    candidate_layouts,
    needs_more_memory,
)
from mmtrain.planning.trials import TrialResult, measure

# `unit` test by test: the real search is slow (two training processes per trial)

REPO = Path(__file__).resolve().parents[1]
AQUILA = REPO / "recipes" / "aquila-vl-2b.yaml"
TINY = REPO / "recipes" / "llava-ov-tiny.yaml"


def _recipe(tmp_path, *overrides, path=AQUILA):
    stage = ["stage=2a"] if path == AQUILA else []
    return load_recipe(path, [*stage, "action=auto_tune", f"run_dir={tmp_path / 'run'}", *overrides])


def _tiny(tmp_path, *overrides):
    """The tiny recipe on 2 processes with 8 sequences a step: 120 candidate layouts."""
    return _recipe(tmp_path, "parallel.nproc_per_node=2", "train.global_batch_size=8", *overrides, path=TINY)


class Simulated:
    """A stand-in for run_trial: tokens/s from the layout, OOM for micro-batch >= `oom_mbs`
    without recompute; records what was run."""

    def __init__(self, oom_mbs: int = 99):
        self.oom_mbs = oom_mbs
        self.ran: list[str] = []

    def __call__(self, recipe, run_dir: Path, limit_s: float) -> TrialResult:
        p, mbs = recipe.parallel, recipe.train.micro_batch_size
        self.ran.append(run_dir.name)
        if mbs >= self.oom_mbs and p.recompute == "none":
            return TrialResult("oom", "CUDA out of memory. Tried to allocate 2.00 GiB", peak_mem_gib=[70.0, 71.0])
        step = (
            1.0 / mbs**0.5
            + 0.1 * (p.tp - 1)
            + 0.2 * (p.pp - 1)
            + {"none": 0, "selective": 0.05, "full": 0.3}[p.recompute]
        )
        return TrialResult("ran", "", 1000.0 / step, step, [10.0 * mbs, 10.0 * mbs + 1], 1.0)


# ----------------------------------------------------------------------------- search space


@pytest.mark.unit
def test_space_holds_only_layouts_megatron_accepts(tmp_path):
    r = _recipe(tmp_path)  # world 8, 12 heads / 2 KV groups, 28 layers, gbs 512
    layouts = candidate_layouts(SpaceContext(r, LLAVA_OV.model_shapes(r.model), on_cuda=True))
    assert len(layouts) == len(set(layouts)) > 100
    for L in layouts:
        assert L.tp * L.pp * L.cp * L.dp == 8 and 28 % L.pp == 0 and 2 % L.tp == 0
        assert L.seq_length % (2 * L.cp * (L.tp if L.sequence_parallel else 1)) == 0 or L.cp == 1
        assert 512 % (L.micro_batch_size * L.dp) == 0
        assert L.tp > 1 or not L.sequence_parallel
        assert L.dp > 1 or L.distributed_optimizer == r.parallel.distributed_optimizer
    assert {L.tp for L in layouts} == {1, 2}  # tp 4, 8 cannot split 2 KV groups
    assert {L.pp for L in layouts} == {1, 2, 4}  # 7, 14, 28 do not divide the world of 8
    assert {L.cp for L in layouts} == {1, 2, 4, 8}
    assert {L.recompute for L in layouts} == {"none", "selective", "full"}
    assert {L.distributed_optimizer for L in layouts} == {True, False}  # on CUDA both
    # on CPU the optimizer substitute does not shard: the recipe's value only
    cpu = candidate_layouts(SpaceContext(r, LLAVA_OV.model_shapes(r.model), on_cuda=False))
    assert {L.distributed_optimizer for L in cpu} == {r.parallel.distributed_optimizer}


@pytest.mark.unit
def test_user_lists_restrict_the_space(tmp_path):
    r = _recipe(
        tmp_path,
        "auto_tune.tp=[2]",
        "auto_tune.pp=[1, 3]",
        "auto_tune.micro_batch_size=[1, 2]",
        "auto_tune.recompute=[full]",
        "auto_tune.sequence_parallel=[true]",
    )
    layouts = candidate_layouts(SpaceContext(r, LLAVA_OV.model_shapes(r.model), on_cuda=False))
    assert {(L.tp, L.pp, L.dp * L.cp, L.micro_batch_size, L.recompute, L.sequence_parallel) for L in layouts} == {
        (2, 1, 4, m, "full", True) for m in (1, 2)
    }  # pp 3 divides neither 28 layers nor 8 ranks
    assert [d.name for d in DIMENSIONS][:2] == ["tp", "pp"]
    # the tuned keys, nested ones too (parallel.vision.tp), are not part of what makes trials comparable
    assert at.fingerprint(apply_layout(r, layouts[0].with_(vision_tp=1, micro_batch_size=2))) == at.fingerprint(r)


@pytest.mark.unit
def test_needs_more_memory_orders_only_memory_dimensions(tmp_path):
    base = candidate_layouts(SpaceContext(_tiny(tmp_path), LLAVA_OV.model_shapes(_tiny(tmp_path).model), False))[0]
    small = base.with_(micro_batch_size=1, recompute="full")
    assert needs_more_memory(small.with_(micro_batch_size=2), small)
    assert needs_more_memory(small.with_(recompute="none"), small)
    assert not needs_more_memory(small, small.with_(micro_batch_size=2))
    assert not needs_more_memory(small.with_(pp=2, dp=1), small)  # another layout: no conclusion
    # recomputing fewer layers (megatron's block method) keeps more activations
    assert needs_more_memory(small.with_(recompute_num_layers=1), small)
    assert needs_more_memory(small.with_(recompute="selective"), small.with_(recompute_num_layers=1))
    assert not needs_more_memory(small, small.with_(recompute_num_layers=1))


@pytest.mark.unit
def test_virtual_stages_join_the_search_space(tmp_path):
    """vpp is a dimension: 2 and 4 where the decoder splits into pp*vpp chunks and the
    micro-batches per DP rank come in groups of pp. The recipe's uneven split goes with the
    layouts it fits (its pp, and vpp dividing its stages) and an even split with the others; the
    chosen layout's recipe carries both and validates. Interleaving shrinks the modelled bubble."""
    from mmtrain.config import load_recipe_dict
    from mmtrain.config.load import recipe_to_dict

    fixed = [
        "auto_tune.tp=[1]",
        "auto_tune.cp=[1]",
        "auto_tune.micro_batch_size=[2]",
        "auto_tune.recompute=[full]",
        "auto_tune.recompute_num_layers=[0]",
        "auto_tune.distributed_optimizer=[true]",
    ]
    r = _recipe(tmp_path, *fixed, "parallel.cp=1", "parallel.pp=2", "parallel.pp_layers=[12,16]")
    shapes = LLAVA_OV.model_shapes(r.model)
    layouts = candidate_layouts(SpaceContext(r, shapes, on_cuda=True))
    assert {(L.pp, L.vpp, L.pp_layers) for L in layouts} == {
        (1, 1, ()),
        (2, 1, (12, 16)),
        (2, 2, (12, 16)),
        (2, 4, (12, 16)),
        (4, 1, ()),
    }  # 28 layers: no 4*2 chunks
    few = _recipe(tmp_path, *fixed, "train.global_batch_size=8")  # 1 micro-batch per DP rank at pp 2
    assert {L.vpp for L in candidate_layouts(SpaceContext(few, shapes, on_cuda=True))} == {1}
    by_vpp = {c.layout.vpp: c for c in at.evaluate(r, LLAVA_OV, on_cuda=True) if c.layout.pp == 2}
    assert by_vpp[2].step.bubble_s == pytest.approx(by_vpp[1].step.bubble_s / 2)
    assert by_vpp[2].est_step_s < by_vpp[1].est_step_s and "vpp2" in by_vpp[2].key
    for L, want in ((by_vpp[4].layout, [12, 16]), (next(L for L in layouts if L.pp == 4), [])):
        chosen = at.best_recipe(r, at.Candidate(L, None, None, 0, 1))
        assert (chosen.parallel.pp, chosen.parallel.vpp, chosen.parallel.pp_layers) == (L.pp, L.vpp, want)
        load_recipe_dict(recipe_to_dict(chosen), family=r.family, source="best.yaml")  # a valid recipe


@pytest.mark.unit
def test_recomputing_some_layers_sits_between_none_and_full(tmp_path):
    from mmtrain.planning.cost_model import Hardware, Layout, estimate_memory, estimate_step_time

    r = _recipe(tmp_path)  # 28 layers
    shapes, hw = LLAVA_OV.model_shapes(r.model), Hardware.from_auto_tune(r.auto_tune)
    L = Layout.from_recipe(r).with_(pp=1, dp=8)
    mem = {n: estimate_memory(shapes, [], L.with_(recompute="full", recompute_num_layers=n)).total for n in (0, 7, 14)}
    step = {
        n: estimate_step_time(shapes, [], L.with_(recompute="full", recompute_num_layers=n), hw).total_s
        for n in (0, 7, 14)
    }
    none = L.with_(recompute="none")
    assert mem[0] < mem[14] < mem[7] < estimate_memory(shapes, [], none).total
    assert step[0] > step[14] > step[7] > estimate_step_time(shapes, [], none, hw).total_s
    layouts = candidate_layouts(SpaceContext(r, shapes, on_cuda=False))
    assert {L.recompute_num_layers for L in layouts} == {0, 7, 14}  # auto: all, 1/4, 1/2 of the layers
    assert all(L.recompute == "full" and L.recompute_num_layers < 28 // L.pp for L in layouts if L.recompute_num_layers)
    best = at.best_recipe(r, at.Candidate(L.with_(recompute="full", recompute_num_layers=7), None, None, 0, 1))
    assert (best.parallel.recompute, best.parallel.recompute_num_layers) == ("full", 7)


# ----------------------------------------------------------------------------- memory pruning and order


@pytest.mark.unit
def test_memory_model_prunes_and_orders(tmp_path):
    r = _recipe(tmp_path, "auto_tune.min_memory_fraction=0.3")  # band 24..72 GiB of 80
    cands = at.evaluate(r, LLAVA_OV, on_cuda=True)
    at.prune_by_memory(cands, r)
    kept = [c for c in cands if not c.status]
    over = [c for c in cands if c.status == at.PRUNED_MEMORY and ">" in c.reason]
    under = [c for c in cands if c.status == at.PRUNED_MEMORY and "band" in c.reason]
    assert kept and over and under
    assert all(24 <= c.est_mem_gib <= 72 for c in kept)
    assert all(c.est_mem_gib > 72 for c in over) and all(c.est_mem_gib < 24 for c in under)
    times = [c.est_step_s for c in kept]
    assert times == sorted(times)  # most promising first
    # the recipe's own layout runs first (the speedup's reference), then the model's order
    order = at.trial_order(cands)
    assert order[0].baseline and [c.est_step_s for c in order[1:]] == sorted(c.est_step_s for c in order[1:])
    # under the band's lower edge the recipe's own layout still runs (the speedup's reference)
    high = _recipe(tmp_path, "auto_tune.min_memory_fraction=0.85")
    cands = at.evaluate(high, LLAVA_OV, on_cuda=True)
    at.prune_by_memory(cands, high)
    base = next(c for c in cands if c.baseline)
    assert base.est_mem_gib < 68 and not base.status


@pytest.mark.unit
def test_context_parallelism_divides_the_activations(tmp_path):
    r = _recipe(tmp_path)
    by_cp = {
        c.layout.cp: c
        for c in at.evaluate(r, LLAVA_OV, on_cuda=True)
        if (c.layout.tp, c.layout.pp, c.layout.micro_batch_size, c.layout.recompute, c.layout.distributed_optimizer)
        == (1, 1, 1, "none", False)
    }
    assert {1, 2, 4} <= set(by_cp)  # (cp 8 leaves dp 1: the recipe's optimizer setting only)
    assert by_cp[2].memory.activations == pytest.approx(by_cp[1].memory.activations / 2)
    assert by_cp[2].layout.dp == by_cp[1].layout.dp // 2


@pytest.mark.unit
def test_calibration_file_moves_the_estimates(tmp_path):
    cal = Calibration(memory_offset_gib=2.0, memory_scale=1.5, time_scale=3.0)
    path = cal.save(tmp_path / "cal.yaml")
    assert Calibration.load(path) == cal
    r = _recipe(tmp_path, f"auto_tune.calibration={path}")
    raw = {c.key: c for c in at.evaluate(r, LLAVA_OV, on_cuda=True, calibration=Calibration())}
    for c in at.evaluate(r, LLAVA_OV, on_cuda=True):
        assert c.est_mem_gib == pytest.approx(2.0 + 1.5 * raw[c.key].est_mem_gib)
        assert c.est_step_s == pytest.approx(3.0 * raw[c.key].est_step_s)
    from mmtrain.planning.dry_run import build_report

    assert (
        "calibrated for"
        in build_report(load_recipe(AQUILA, ["stage=2a", f"auto_tune.calibration={path}"]), LLAVA_OV).text
    )


@pytest.mark.unit
def test_calibration_fit_and_leave_one_out_error():
    est = [1.0, 2.0, 3.0, 4.0]
    meas = [0.5 + 2 * e for e in est]  # an offset and a scale
    cal = fit(est, meas, est, [3 * e for e in est])
    assert cal.memory_offset_gib == pytest.approx(0.5) and cal.memory_scale == pytest.approx(2.0)
    assert cal.time_scale == pytest.approx(3.0) and cal.trials == 4
    mem_err, step_err, loo = calibrated_errors(est, meas, est, [3 * e for e in est])
    assert loo and mem_err.worst == pytest.approx(0, abs=1e-9) and step_err.median == pytest.approx(0, abs=1e-9)


# ----------------------------------------------------------------------------- trials and history


@pytest.mark.unit
def test_oom_prunes_the_layouts_it_dominates(tmp_path):
    r = _tiny(tmp_path, "auto_tune.max_trials=40", "auto_tune.slow_margin=100")
    sim = Simulated(oom_mbs=2)
    res = at.run_auto_tune(r, LLAVA_OV, out=io.StringIO(), trial_fn=sim, on_cuda=False)
    by_key = {c.key: c for c in res.candidates}
    ooms = [c for c in res.candidates if c.status == at.FAILED]
    assert ooms and all(c.reason.startswith("oom: CUDA out of memory") for c in ooms)
    history = [c for c in res.candidates if c.status == at.PRUNED_HISTORY]
    assert history
    for c in history:  # each one needs at least the memory of a layout that ran out of it
        assert "ran out of memory" in c.reason
        assert needs_more_memory(c.layout, by_key[c.reason.split()[6].rstrip(",")].layout)
        assert c.key not in sim.ran
    assert res.best.measured and res.best.layout.recompute in ("none", "selective", "full")
    assert res.exit_code == 0


@pytest.mark.unit
def test_slow_results_prune_what_cannot_beat_the_best(tmp_path):
    r = _tiny(tmp_path, "auto_tune.max_trials=40", "auto_tune.slow_margin=0")
    sim = Simulated()
    res = at.run_auto_tune(r, LLAVA_OV, out=io.StringIO(), trial_fn=sim, on_cuda=False)
    slow = [c for c in res.candidates if c.status == at.PRUNED_HISTORY]
    assert slow and all("model predicts at best" in c.reason for c in slow)
    assert len(sim.ran) + len(slow) + sum(c.status == at.PRUNED_MEMORY for c in res.candidates) == len(res.candidates)


@pytest.mark.unit
def test_budget_stops_the_search_and_best_yaml_is_the_best_measured(tmp_path):
    r = _tiny(tmp_path, "auto_tune.max_trials=3", "auto_tune.slow_margin=100")
    sim = Simulated()
    buf = io.StringIO()
    res = at.run_auto_tune(r, LLAVA_OV, out=buf, trial_fn=sim, on_cuda=False)
    assert len(sim.ran) == 3
    not_run = [c for c in res.candidates if c.status == at.NOT_RUN]
    assert not_run and all("max_trials=3" in c.reason for c in not_run)
    ran = [c for c in res.candidates if c.status == at.RAN]
    assert res.best is max(ran, key=lambda c: c.trial.tokens_per_s) and ran[0].baseline
    best = load_recipe(res.recipe_path, family="llava-ov")
    assert best.action == "run" and best == res.best_recipe
    L = res.best.layout
    assert (
        best.parallel.tp,
        best.parallel.pp,
        best.parallel.cp,
        best.train.micro_batch_size,
        best.parallel.recompute,
    ) == (L.tp, L.pp, L.cp, L.micro_batch_size, L.recompute)
    text = buf.getvalue()
    assert "speedup over the recipe's own layout" in text and "pruned without running" in text
    rows = list(csv.DictReader(res.csv_path.open()))
    assert len(rows) == len(res.candidates) == 120  # 72 layouts, the 48 with tp x cp > 1 also with vision_tp 1
    assert {row["status"] for row in rows} >= {"ran", "not_run"}
    ran_rows = [row for row in rows if row["status"] == "ran"]
    assert all(float(row["meas_tokens_per_s"]) > 0 and row["meas_mem_gib_by_rank"].count(";") == 1 for row in ran_rows)
    assert (res.csv_path.parent / "calibration.yaml").exists()


@pytest.mark.unit
def test_minutes_budget_stops_the_search(tmp_path, monkeypatch):
    """A clock that advances 4 minutes per reading: auto_tune.max_minutes=10 allows 2 trials."""
    clock = iter(range(0, 10**6, 240))
    monkeypatch.setattr(at, "_now", lambda: float(next(clock)))
    sim = Simulated()
    res = at.run_auto_tune(
        _tiny(tmp_path, "auto_tune.max_minutes=10", "auto_tune.slow_margin=100"),
        LLAVA_OV,
        out=io.StringIO(),
        trial_fn=sim,
        on_cuda=False,
    )
    assert len(sim.ran) == 2
    assert all("max_minutes=10 spent" in c.reason for c in res.candidates if c.status == at.NOT_RUN)


@pytest.mark.unit
def test_rerun_reuses_finished_trials(tmp_path):
    r = _tiny(tmp_path, "auto_tune.max_trials=3", "auto_tune.slow_margin=100")
    first = Simulated()
    at.run_auto_tune(r, LLAVA_OV, out=io.StringIO(), trial_fn=first, on_cuda=False)
    again = Simulated()
    res = at.run_auto_tune(r, LLAVA_OV, out=io.StringIO(), trial_fn=again, on_cuda=False)
    assert not set(again.ran) & set(first.ran) and len(again.ran) == 3  # 3 new trials, none repeated
    reused = [c for c in res.candidates if c.reused]
    assert sorted(c.key for c in reused) == sorted(first.ran)
    # another recipe (here: a longer sequence) does not reuse them
    other = Simulated()
    at.run_auto_tune(
        _tiny(tmp_path, "auto_tune.max_trials=3", "train.seq_length=1024"),
        LLAVA_OV,
        out=io.StringIO(),
        trial_fn=other,
        on_cuda=False,
    )
    assert other.ran[:1] == first.ran[:1]


@pytest.mark.unit
def test_failures_are_classified_from_the_trial_log(tmp_path):
    r = _tiny(tmp_path)
    (tmp_path / "trial.log").write_text("step 1\nTraceback...\ntorch.OutOfMemoryError: CUDA out of memory. Tried\n")
    assert measure(tmp_path, r, 1, False, 3.0, 60).status == "oom"
    (tmp_path / "trial.log").write_text("Traceback...\nValueError: bad shape\n")
    crash = measure(tmp_path, r, 1, False, 3.0, 60)
    assert crash.status == "crash" and crash.reason == "ValueError: bad shape"
    assert measure(tmp_path, r, -9, True, 60.0, 60).status == "timeout"
    # a success: medians over the steps after the warm-up (a stalled step does not decide),
    # and every rank's peak memory growth
    import json

    steps = [(1, 9.0), (2, 9.0), (3, 1.0), (4, 30.0), (5, 1.2), (6, 0.8)]  # r.auto_tune.warmup_steps == 2
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "tokens": 4096, "step_time_s": t}) + "\n"
            for s, t in steps[: r.auto_tune.trial_steps]
        )
    )
    (tmp_path / "memory").mkdir()
    for rank, grown in ((0, 0.25), (1, 0.5)):
        (tmp_path / "memory" / f"rank{rank:05d}.json").write_text(json.dumps({"grown_gib": grown}))
    ok = measure(tmp_path, r, 0, False, 20.0, 60)
    assert (
        ok.status == "ran"
        and ok.step_time_s == pytest.approx(1.1)
        and ok.tokens_per_s == pytest.approx((4096 / 1.2 + 4096 / 1.0) / 2)
    )
    assert ok.peak_mem_gib == [0.25, 0.5] and ok.max_peak_gib == 0.5


@pytest.mark.unit
def test_nothing_fits_exits_non_zero(tmp_path, capsys):
    res = at.run_auto_tune(
        _recipe(tmp_path, "auto_tune.device_memory_gb=1"), LLAVA_OV, out=io.StringIO(), trial_fn=Simulated()
    )
    assert res.best is None and res.recipe_path is None and "no layout fits" in res.text
    assert not (tmp_path / "run" / "auto_tune" / "best.yaml").exists()
    assert all(c.status == at.PRUNED_MEMORY for c in res.candidates)
    from mmtrain.cli import main

    args = [
        "llava-ov",
        str(AQUILA),
        "stage=2a",
        "action=auto_tune",
        f"run_dir={tmp_path / 'cli'}",
        "auto_tune.max_trials=0",
    ]
    assert main([*args, "auto_tune.device_memory_gb=1"]) == 1
    assert main(args) == 0  # model-only: the model's pick, nothing launched
    out = capsys.readouterr().out
    assert "no layout fits" in out and "MODEL-BASED" in out
    assert load_recipe(tmp_path / "cli" / "auto_tune" / "best.yaml", family="llava-ov").action == "run"


@pytest.mark.unit
def test_trials_refuse_what_cannot_start(tmp_path):
    """Checked once before the first trial: a multi-node recipe, and the checks of action: run."""
    from mmdata.errors import UserError

    with pytest.raises(UserError, match="this node only"):
        at.check_trials_can_start(_tiny(tmp_path, "parallel.nnodes=2"), LLAVA_OV)
    with pytest.raises(UserError, match="data.paths"):
        at.check_trials_can_start(_tiny(tmp_path, f"data.paths=[{tmp_path / 'missing'}]"), LLAVA_OV)


@pytest.mark.unit
@pytest.mark.parametrize(
    "bad",
    [
        "auto_tune.memory_fraction=1.5",
        "auto_tune.tp=[0]",
        "auto_tune.device_tflops=0",
        "auto_tune.min_memory_fraction=0.95",
        "auto_tune.trial_steps=2",
        "auto_tune.max_minutes=0",
        "parallel.recompute_num_layers=-1",
    ],
)
def test_auto_tune_keys_validated(tmp_path, bad):
    from mmtrain.config import RecipeError

    with pytest.raises(RecipeError, match=bad.split("=")[0].replace(".", r"\.")):
        _recipe(tmp_path, bad)
    with pytest.raises(RecipeError, match="needs parallel.recompute=full"):
        _recipe(tmp_path, "parallel.recompute=none", "parallel.recompute_num_layers=2")


# ----------------------------------------------------------------------------- slow: a real search


@pytest.mark.slow
def test_real_search_on_two_cpu_processes(tmp_path, shards_dir):
    """The tiny recipe on 2 gloo processes: the memory model prunes most of the 120 layouts, the
    recipe's own layout and the most promising survivor run as real trials (torchrun, the real
    loader and model), history.csv holds ran and pruned rows, and --launch trains best.yaml."""
    import subprocess
    import sys

    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer
    from tests.fixtures_training import train_env

    tok = build_tiny_qwen2_tokenizer(tmp_path / "tokenizer")
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "mmtrain.cli",
        "llava-ov",
        str(TINY),
        "action=auto_tune",
        f"run_dir={run}",
        f"data.paths=[{shards_dir}]",
        f"tokenizer.path={tok}",
        "data.num_workers=1",
        "train.seq_length=512",
        "train.iters=2",
        "parallel.nproc_per_node=2",
        "train.global_batch_size=8",
        # a band around the recipe's own layout: the memory model keeps 15 of the 120
        "auto_tune.device_memory_gb=0.02",
        "auto_tune.min_memory_fraction=0.6",
        "auto_tune.memory_fraction=0.7",
        "auto_tune.max_trials=2",
        "auto_tune.trial_steps=3",
        "auto_tune.warmup_steps=1",
        "auto_tune.trial_timeout_s=300",
        "--launch",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, env=train_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    rows = list(csv.DictReader((run / "auto_tune" / "history.csv").open()))
    status = [row["status"] for row in rows]
    assert len(rows) == 120 and status.count("ran") >= 1
    assert status.count("pruned_memory") + status.count("pruned_history") >= 0.8 * len(rows)
    ran = [row for row in rows if row["status"] == "ran"]
    assert any(row["baseline"] == "True" for row in ran)
    for row in ran:
        assert float(row["meas_tokens_per_s"]) > 0 and len(row["meas_mem_gib_by_rank"].split(";")) == 2
    assert "pruned without running" in proc.stdout and "memory model vs measured peak" in proc.stdout
    best = load_recipe(run / "auto_tune" / "best.yaml", family="llava-ov")
    assert best.action == "run" and best.run_dir == str(run)
    # --launch trained the best layout in the run_dir
    from mmtrain.runtime.metrics import read_metrics

    assert [r["step"] for r in read_metrics(run)] == [1, 2]
