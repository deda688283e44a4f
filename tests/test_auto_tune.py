"""auto_tune: only valid layouts, ranked by modelled time within the memory budget; the
written best recipe validates."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from mmtrain.config import load_recipe
from mmtrain.llava_ov.spec import LLAVA_OV
from mmtrain.planning.auto_tune import evaluate, run_auto_tune
from mmtrain.planning.cost_model import GB

pytestmark = pytest.mark.unit

AQUILA = Path(__file__).resolve().parents[1] / "recipes" / "aquila-vl-2b.yaml"


def _recipe(tmp_path, *overrides):
    return load_recipe(AQUILA, ["stage=2a", "action=auto_tune", f"run_dir={tmp_path / 'run'}", *overrides])


def test_candidates_are_valid_layouts_and_ranked(tmp_path):
    r = _recipe(tmp_path)
    cands = evaluate(r, LLAVA_OV)
    assert cands
    budget = r.auto_tune.device_memory_gb * GB * r.auto_tune.memory_fraction
    for c in cands:
        L = c.layout
        assert L.tp * L.pp * L.cp * L.dp == 8 and r.model.llm.num_layers % L.pp == 0
        assert L.seq_length % (2 * L.cp * (L.tp if L.sequence_parallel else 1)) == 0
        assert r.model.llm.num_query_groups % L.tp == 0 and L.global_batch_size % (L.micro_batch_size * L.dp) == 0
        assert c.fits == (c.memory.total <= budget)
        assert L.sequence_parallel == (L.tp > 1)
    fits = [c for c in cands if c.fits]
    assert fits and cands[: len(fits)] == fits  # fitting layouts first
    times = [c.step.total_s for c in fits]
    assert times == sorted(times)
    assert {c.layout.recompute for c in cands} == {"none", "selective", "full"}
    assert {c.layout.tp for c in cands} == {1, 2}  # 12 heads / 2 KV groups: tp 4, 8 impossible
    assert {c.layout.cp for c in cands} == {1, 2, 4, 8}
    # context parallelism divides the per-rank activations (same tp/pp/mbs, no recompute)
    by_cp = {c.layout.cp: c for c in cands if (c.layout.tp, c.layout.pp, c.layout.micro_batch_size,
                                                c.layout.recompute) == (1, 1, 1, "none")}
    assert by_cp[2].memory.activations == pytest.approx(by_cp[1].memory.activations / 2)


def test_recompute_trades_memory_for_time(tmp_path):
    by_key = {(c.layout.tp, c.layout.pp, c.layout.micro_batch_size, c.layout.recompute): c
              for c in evaluate(_recipe(tmp_path, "auto_tune.cp=[1]"), LLAVA_OV)}
    none, full = by_key[(1, 1, 2, "none")], by_key[(1, 1, 2, "full")]
    assert full.memory.total < none.memory.total
    assert full.step.total_s > none.step.total_s


def test_budget_and_explicit_space(tmp_path):
    r = _recipe(tmp_path, "auto_tune.device_memory_gb=40", "auto_tune.tp=[1]", "auto_tune.pp=[1, 2]",
                "auto_tune.micro_batch_size=[1, 2]")
    cands = evaluate(r, LLAVA_OV)
    assert {(c.layout.tp, c.layout.pp, c.layout.micro_batch_size) for c in cands} <= {
        (1, p, m) for p in (1, 2) for m in (1, 2)}
    assert all(c.memory.total <= 36 * GB for c in cands if c.fits)
    assert any(not c.fits for c in cands)


def test_run_writes_best_recipe_that_validates(tmp_path):
    r = _recipe(tmp_path)
    buf = io.StringIO()
    res = run_auto_tune(r, LLAVA_OV, out=buf)
    text = buf.getvalue()
    assert "MODEL-BASED SEARCH" in text and "no trial runs" in text
    assert res.recipe_path == tmp_path / "run" / "auto_tune.yaml" and res.csv_path.exists()
    again = load_recipe(res.recipe_path, family="llava-ov")
    assert again == res.best_recipe and again.action == "run"
    L = res.best.layout
    assert (again.parallel.tp, again.parallel.pp, again.parallel.cp, again.train.micro_batch_size,
            again.parallel.recompute) == (L.tp, L.pp, L.cp, L.micro_batch_size, L.recompute)
    assert len(res.csv_path.read_text().splitlines()) == len(res.candidates) + 1


def test_nothing_fits(tmp_path, capsys):
    res = run_auto_tune(_recipe(tmp_path, "auto_tune.device_memory_gb=1"), LLAVA_OV, out=io.StringIO())
    assert res.best is None and res.recipe_path is None
    assert "no layout fits" in res.text
    assert not (tmp_path / "run" / "auto_tune.yaml").exists()
    # the command fails too, so a script notices (and succeeds when a layout fits)
    from mmtrain.cli import main

    args = ["llava-ov", str(AQUILA), "stage=2a", "action=auto_tune", f"run_dir={tmp_path / 'cli'}"]
    assert main([*args, "auto_tune.device_memory_gb=1"]) == 1
    assert main(args) == 0
    assert "no layout fits" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["auto_tune.memory_fraction=1.5", "auto_tune.tp=[0]", "auto_tune.device_tflops=0"])
def test_auto_tune_keys_validated(tmp_path, bad):
    from mmtrain.config import RecipeError

    with pytest.raises(RecipeError, match=bad.split("=")[0].replace(".", r"\.")):
        _recipe(tmp_path, bad)
