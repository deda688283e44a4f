"""The trainer's side of `data.sharding: global` (issue 46), without training: the recipe checks
(one line each), the data identity a resume compares (layout keys left out), the one resume line,
the step metrics' read volume and shares, and the planned shares of a dry run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from mmdata.global_order.sources import source_name
from mmtrain.config import RecipeError, load_recipe
from mmtrain.config.load import recipe_to_dict
from mmtrain.planning.blend_report import blend_lines
from mmtrain.runtime.checkpoint.data_identity import (
    BLEND_IN_DOCUMENT,
    comparable,
    data_identity,
    identity_changes,
    recipe_changes,
)
from mmtrain.runtime.checkpoint.manager import TrainerState, global_order_resume_line
from mmtrain.runtime.step_metrics import global_order_record
from mmtrain.runtime.train_data import check_one_step, global_order_figures

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[1] / "recipes" / "llava-ov-tiny.yaml"
TWO = "data.paths=[/data/web,/data/books]"


def recipe(tmp_path: Path, *overrides: str):
    return load_recipe(TINY, [f"run_dir={tmp_path / 'run'}", "train.global_batch_size=12", *overrides])


def errors(tmp_path: Path, *overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as info:
        recipe(tmp_path, *overrides)
    return info.value.errors


def test_global_order_recipe_refusals_one_line_each(tmp_path):
    (line,) = errors(tmp_path, TWO, "data.blend={weights: {web: 3, books: 1}}")
    assert "data.blend: is only read with data.sharding: global (got sharding: dp)" in line
    (line,) = errors(tmp_path, TWO, "data.sharding=global", "data.blend={weights: {web: 3, news: 1}}")
    assert "data.blend: weights names unknown source 'news': the sources are web, books" in line
    (line,) = errors(tmp_path, TWO, "data.sharding=global", "data.blend={weights: {web: 0, books: 0}}")
    assert "weights are all zero" in line
    (line,) = errors(tmp_path, TWO, "data.sharding=global", "data.blend={weights: {web: -1, books: 1}}")
    assert "a weight must be a finite number >= 0" in line
    (line,) = errors(tmp_path, "data.paths=[/data/mix.yaml]", "data.sharding=global")
    assert "data.paths: /data/mix.yaml is a metadataset YAML" in line and "data.blend" in line
    (line,) = errors(tmp_path, TWO, "data.val_paths=[/data/val.yml]", "data.sharding=global")
    assert "data.val_paths: /data/val.yml is a metadataset YAML" in line
    (line,) = errors(tmp_path, "data.paths=[/a/web,/b/web]", "data.sharding=global")
    assert "two shard folders share the name 'web'" in line
    (line,) = errors(tmp_path, TWO, "data.order_window=2")
    assert line.endswith("data.order_window: is only read with data.sharding: global (got sharding: dp); drop it")
    plan = ("data.paths=[/data/web]", "data.sharding=global", "data.packing=plan")
    (line,) = errors(tmp_path, *plan, "data.blend={weights: {web: 1}}")
    assert "data.blend: mixes the sources the global order plans online" in line and "data.packing: true" in line
    (line,) = errors(tmp_path, *plan, "data.order_window=2")
    assert "data.order_window: is not read with data.packing: plan" in line
    assert recipe(tmp_path, *plan).data.packing == "plan"
    schedule = "data.blend={schedule: [{step: 0, weights: {web: 3}}, {step: 10, weights: {web: 1, books: 1}}]}"
    r = recipe(tmp_path, TWO, "data.sharding=global", schedule, "data.order_window=2")
    assert r.data.blend["schedule"][1]["step"] == 10 and r.data.order_window == 2


def test_a_global_order_resume_compares_no_layout_key(tmp_path):
    """Micro-batch, worker count, the order's window and its blend may change under the global
    order (the DP size never was in the identity; a checkpoint from before the loader document
    recorded the blend still refuses a changed one); in the other modes they still refuse. A
    changed blend is announced; the keys only the other loaders read are in no global identity."""
    dp4 = recipe(tmp_path, TWO, "data.sharding=global", "data.num_workers=2")
    saved = data_identity(dp4)
    other = recipe(
        tmp_path, TWO, "data.sharding=global", "data.num_workers=3", "train.micro_batch_size=2", "data.order_window=3"
    )
    assert identity_changes(*comparable(saved, data_identity(other), "global")) == []
    blended = recipe(tmp_path, TWO, "data.sharding=global", "data.blend={weights: {web: 1, books: 2}}")
    assert identity_changes(*comparable(saved, data_identity(blended), "global")) == []
    older = {k: v for k, v in saved.items() if k != BLEND_IN_DOCUMENT}  # its document has no blend
    (change,) = identity_changes(*comparable(older, data_identity(blended), "global"))
    assert change.startswith("data.blend (unset) -> ")  # refused, as before
    buffers = ("data.packing_buffer_size=64", "data.shuffle_buffer_size=7", "data.plan_allow_estimated_lengths=true")
    unread = recipe(tmp_path, TWO, "data.sharding=global", *buffers)  # keys only the other loaders read
    assert identity_changes(*comparable(saved, data_identity(unread), "global")) == []
    recorded = {**saved, "data.packing_buffer_size": None, "data.shuffle_buffer_size": 100}  # as older ones did
    assert identity_changes(*comparable(recorded, data_identity(unread), "global")) == []
    assert not {"data.packing_buffer_size", "data.shuffle_buffer_size"} & set(data_identity(unread))
    reordered = recipe(tmp_path, "data.paths=[/data/books,/data/web]", "data.sharding=global")
    assert identity_changes(*comparable(saved, data_identity(reordered), "global"))  # the paths stay in it
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(yaml.safe_dump(recipe_to_dict(dp4)))
    (line,) = recipe_changes(ckpt, yaml.safe_dump(recipe_to_dict(blended)))
    assert line.startswith("data.blend (unset) -> ") and "continues from the same position" in line
    plain = recipe(tmp_path, TWO, "data.num_workers=3")
    assert "data.num_workers 2 -> 3" in identity_changes(data_identity(recipe(tmp_path, TWO)), data_identity(plain))
    assert "data.blend" not in data_identity(plain) and "data.order_window" not in data_identity(plain)


def test_the_resume_line_names_the_step_and_the_layout_change():
    saved = TrainerState(step=9, layout={"dp": 4}, data={"train.micro_batch_size": 1, "data.num_workers": 2})
    doc = json.dumps({"version": 1, "step": 9, "window_start": {}})
    line = global_order_resume_line(doc, saved, {"dp": 3, "micro_batch_size": 1, "num_workers": 1})
    assert line == (
        "data order continues at step 9 (global order), layout changed: DP 4 -> 3, micro-batch 1, "
        "data.num_workers 2 -> 1"
    )
    same = global_order_resume_line(doc, saved, {"dp": 4, "micro_batch_size": 1, "num_workers": 2})
    assert "same layout: DP 4" in same


def test_step_metrics_carry_bytes_per_rank_and_planned_shares():
    micro = [
        SimpleNamespace(global_order={"bytes_read": 1000, "units": {"web": 30, "books": 10}}),
        SimpleNamespace(global_order={"bytes_read": 500, "units": {"web": 30, "books": 10}}),
    ]
    assert global_order_figures(micro) == (1500, {"web": 30.0, "books": 10.0})
    assert global_order_figures([SimpleNamespace(global_order=None)]) == (0, {})
    record = global_order_record([1500, 1400, 1600], {"web": 30.0, "books": 10.0})
    assert record["bytes_read"] == 1500 and record["bytes_read_per_rank"] == [1500, 1400, 1600]
    assert record["shares"] == {"web": 0.75, "books": 0.25}


def test_dry_run_prints_the_planned_shares_over_the_run(tmp_path):
    schedule = (
        "data.blend={schedule: [{step: 0, weights: {web: 3, books: 1}}, {step: 40, weights: {web: 1, books: 1}}], "
        "ramp: linear}"
    )
    r = recipe(tmp_path, TWO, "data.sharding=global", schedule, "train.iters=101")
    head, *steps = blend_lines(r)
    assert "blend unit samples, ramp linear" in head
    shown = {line.split(":")[0].strip(): line for line in steps}
    assert list(shown) == ["step 0", "step 25", "step 40", "step 50", "step 75", "step 100"]
    assert "web 75.0%, books 25.0%" in shown["step 0"] and "web 50.0%, books 50.0%" in shown["step 40"]
    assert "web 59.4%" in shown["step 25"]  # the ramp: 3/4 -> 1/2 over steps 0-40
    assert blend_lines(recipe(tmp_path, TWO)) == []


def test_a_symlinked_folder_is_named_as_written(tmp_path):
    """`data.paths` names a source by the path as written: a link `news -> store/web` is `news`
    (in the recipe check as in `load_source`), and two links to one folder are two names."""
    (tmp_path / "store" / "web").mkdir(parents=True)
    for link in ("news", "books"):
        (tmp_path / link).symlink_to(tmp_path / "store" / "web", target_is_directory=True)
    paths = f"data.paths=[{tmp_path / 'news'},{tmp_path / 'books'}]"
    r = recipe(tmp_path, paths, "data.sharding=global", "data.blend={weights: {news: 3, books: 1}}")
    assert r.data.blend == {"weights": {"news": 3, "books": 1}}
    assert source_name(tmp_path / "news") == "news" and source_name("rel/../web/") == "web"


def test_a_step_of_micro_batches_from_two_steps_stops_the_run():
    """The trainer takes M micro-batches per step by count: a loader that left one out would shift
    the rank's steps; that stops loudly instead of saving another step than the other ranks."""

    def micro(step: int, m: int) -> SimpleNamespace:
        return SimpleNamespace(global_order={"step": step, "micro_batch": m})

    check_one_step([micro(3, 0), micro(3, 1)])
    with pytest.raises(RuntimeError, match=r"\(3, 1\), \(4, 0\)"):
        check_one_step([micro(3, 1), micro(4, 0)])
