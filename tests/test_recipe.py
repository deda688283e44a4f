"""Recipe validator: errors name the key path; overrides, stages, resolved round trip."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from mmtrain.recipe import Recipe, RecipeError, load_recipe, load_recipe_dict, parse_override, save_resolved

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@dataclass
class _Inner:
    width: int = 8
    ratio: float = 0.5
    sizes: tuple[int, ...] = (1, 2)
    name: str | None = None


@dataclass
class _ToyModel:
    """A small stand-in family config: the schema is generic over any nested dataclass."""

    inner: _Inner = field(default_factory=_Inner)
    depth: int = 2
    max_tiles: int = 9


BASE = {
    "family": "toy",
    "run_dir": "runs/toy",
    "model": {"inner": {"width": 16}, "depth": 3},
    "data": {"paths": ["shards"]},
    "tokenizer": {"path": "tok"},
    "train": {"iters": 10, "seq_length": 128, "micro_batch_size": 2, "global_batch_size": 8},
    "parallel": {"nproc_per_node": 4, "tp": 2},
}


def load(raw=None, overrides=(), family=None) -> Recipe:
    return load_recipe_dict(copy.deepcopy(raw if raw is not None else BASE), overrides, family, _ToyModel)


def errors_of(raw=None, overrides=(), family=None) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load(raw, overrides, family)
    return info.value.errors


def test_valid_recipe_is_typed():
    r = load()
    assert r.model == _ToyModel(inner=_Inner(width=16), depth=3)
    assert r.parallel.dp == 2 and r.grad_accum_steps == 2
    assert r.optimizer.decay == "cosine" and r.action == "run"


def test_unknown_key_has_path_and_suggestion():
    raw = copy.deepcopy(BASE)
    raw["train"]["micro_batch_szie"] = 2
    raw["model"]["inner"]["widht"] = 3
    errs = errors_of(raw)
    assert any(e.startswith("train.micro_batch_szie: unknown key") and "'micro_batch_size'" in e for e in errs)
    assert any(e.startswith("model.inner.widht: unknown key") and "'width'" in e for e in errs)


def test_unknown_top_level_section():
    raw = dict(BASE, optimiser={"lr": 1.0})
    (err,) = errors_of(raw)
    assert err.startswith("optimiser: unknown key") and "'optimizer'" in err


def test_wrong_types_name_path_expected_and_got():
    raw = copy.deepcopy(BASE)
    raw["train"]["iters"] = "10"  # no silent str -> int
    raw["model"]["inner"]["sizes"] = [1, "x"]
    raw["logging"] = {"tensorboard": 1}  # not a bool
    errs = errors_of(raw)
    assert "train.iters: expected int, got '10' (str)" in errs
    assert any(e.startswith("model.inner.sizes[1]: expected int") for e in errs)
    assert any(e.startswith("logging.tensorboard: expected bool, got 1 (int)") for e in errs)


def test_int_accepted_for_float_and_bool_not_for_int():
    r = load(overrides=["optimizer.lr=1", "model.inner.ratio=2"])
    assert r.optimizer.lr == 1.0 and isinstance(r.optimizer.lr, float)
    assert r.model.inner.ratio == 2.0
    assert errors_of(overrides=["train.iters=true"]) == [
        "override 'train.iters=true': train.iters: expected int, got True (bool)"
    ]


def test_scientific_notation_float_override():
    # PyYAML (YAML 1.1) reads 1e-3 as a string; float keys accept that spelling.
    assert load(overrides=["optimizer.lr=1e-3"]).optimizer.lr == pytest.approx(1e-3)
    assert errors_of(overrides=["optimizer.lr=fast"])[0].endswith("expected float, got 'fast' (str)")


def test_bad_enum_suggests():
    (err,) = errors_of(overrides=["parallel.recompute=ful"])
    assert "parallel.recompute: expected one of 'none', 'full', 'selective'" in err
    assert "did you mean 'full'" in err and err.startswith("override 'parallel.recompute=ful'")


def test_missing_required_keys():
    raw = {k: v for k, v in BASE.items() if k not in ("run_dir", "model")}
    errs = errors_of(raw)
    assert any(e.startswith("run_dir: missing required key") for e in errs)
    assert any(e.startswith("model: missing required key") for e in errs)


def test_overrides_apply_and_bad_override_is_named():
    r = load(overrides=["train.iters=99", "data.paths=[a, b]", "checkpoint.load=ckpt", "model.inner.name=x"])
    assert r.train.iters == 99 and r.data.paths == ["a", "b"]
    assert r.checkpoint.load == "ckpt" and r.model.inner.name == "x"
    (err,) = errors_of(overrides=["train.itres=5"])
    assert err.startswith("override 'train.itres=5': train.itres: unknown key") and "'iters'" in err
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        parse_override("train.iters")
    with pytest.raises(RecipeError, match="train.iters is a int, not a section"):
        load(overrides=["train.iters.x=1"])


def test_divisibility_checks():
    (err,) = errors_of(overrides=["train.global_batch_size=6"])
    assert err.startswith("override 'train.global_batch_size=6': train.global_batch_size: 6 is not divisible")
    assert "micro_batch_size*dp = 2*2 = 4" in err
    (err,) = errors_of(overrides=["parallel.tp=3"])
    assert err.startswith("override 'parallel.tp=3': parallel: tp*pp = 3*1 = 3 does not divide the world size")
    assert load(overrides=["parallel.tp=2", "parallel.pp=2", "train.global_batch_size=2"]).parallel.dp == 1


def test_other_cross_checks():
    assert errors_of(overrides=["train.seq_length=0"]) == [
        "override 'train.seq_length=0': train.seq_length: must be > 0, got 0"
    ]
    errs = errors_of(overrides=["data.paths=[]", "tokenizer.path="])
    assert any(e.endswith("data.paths: must list at least one shard dir or metadataset YAML for action: run") for e in errs)
    assert any("tokenizer.path: is required" in e for e in errs)
    # dry_run / auto_tune need no data
    assert load(overrides=["action=dry_run", "data.paths=[]"]).action == "dry_run"
    assert any("model.max_tiles=9" in e for e in errors_of(overrides=["data.max_tiles=4"]))
    assert any("everything is frozen" in e for e in errors_of(
        overrides=["freeze.vision_tower=true", "freeze.projector=true", "freeze.llm=true"]))


def test_evaluation_needs_validation_data():
    r = load()
    assert r.train.eval_interval == 0 and r.train.eval_iters == 4 and r.data.val_paths == []
    (err,) = errors_of(overrides=["train.eval_interval=100"])
    assert err.startswith("override 'train.eval_interval=100': data.val_paths: must list at least one shard dir")
    assert "train.eval_interval=100" in err
    r = load(overrides=["train.eval_interval=100", "data.val_paths=[held_out]", "train.eval_iters=2"])
    assert r.train.eval_interval == 100 and r.train.eval_iters == 2 and r.data.val_paths == ["held_out"]
    assert errors_of(overrides=["train.eval_iters=0"]) == [
        "override 'train.eval_iters=0': train.eval_iters: must be > 0, got 0"
    ]


def test_family_must_match_subcommand():
    (err,) = errors_of(family="emu3")
    assert err == "family: recipe is for 'toy' but was run as `mmtrain emu3`"


def test_stages_patch_then_overrides_win():
    raw = copy.deepcopy(BASE)
    raw["stage"] = 1
    raw["stages"] = {
        1: {"freeze": {"llm": True}, "optimizer.lr": 1.0e-3},
        "2": {"optimizer": {"lr": 1.0e-5, "vision_tower_lr": 2.0e-6}},
    }
    r = load(raw)
    assert r.stage == "1" and r.freeze.llm and r.optimizer.lr == 1e-3
    r = load(raw, ["stage=2", "optimizer.vision_tower_lr=3e-6"])
    assert r.stage == "2" and not r.freeze.llm and r.optimizer.lr == 1e-5
    assert r.optimizer.vision_tower_lr == pytest.approx(3e-6)
    with pytest.raises(RecipeError, match="unknown stage '3'"):
        load(raw, ["stage=3"])
    with pytest.raises(RecipeError, match="has no stages: table"):
        load(BASE, ["stage=1"])
    raw["stages"]["2"]["optimizer"]["decay"] = "cos"
    (err,) = errors_of(raw, ["stage=2"])
    assert err.startswith("stage '2': optimizer.decay: expected one of")


def test_resolved_round_trip(tmp_path):
    raw = copy.deepcopy(BASE)
    raw["stage"] = "a"
    raw["stages"] = {"a": {"optimizer.lr": 1.0e-3}}
    r = load(raw, ["optimizer.lr=5e-4", "model.inner.sizes=[3, 4, 5]", "parallel.precision=bf16"])
    out = save_resolved(r, tmp_path / "run" / "config.yaml")
    text = out.read_text()
    assert "stages" not in yaml.safe_load(text)
    again = load_recipe(out, model_config_cls=_ToyModel)
    assert again == r and again.optimizer.lr == 5e-4 and again.model.inner.sizes == (3, 4, 5)
    assert list(tmp_path.joinpath("run").iterdir()) == [out]  # no temp file left behind


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates_and_round_trips(path, tmp_path):
    raw = yaml.safe_load(path.read_text())
    recipe = load_recipe(path, family=raw["family"])
    assert load_recipe(save_resolved(recipe, tmp_path / "config.yaml")) == recipe
    for stage in raw.get("stages", {}):
        staged = load_recipe(path, [f"stage={stage}"], family=raw["family"])
        assert staged.stage == str(stage)


def test_aquila_stage_settings():
    path = RECIPES / "aquila-vl-2b.yaml"
    s1 = load_recipe(path, ["stage=1"], family="llava-ov")
    assert (s1.freeze.vision_tower, s1.freeze.projector, s1.freeze.llm) == (True, False, True)
    assert s1.optimizer.lr == 1e-3
    later = load_recipe(path, ["stage=2a"], family="llava-ov")
    assert not (later.freeze.vision_tower or later.freeze.projector or later.freeze.llm)
    assert later.optimizer.lr == 1e-5 and later.optimizer.vision_tower_lr == 2e-6
    assert later.checkpoint.weights_only and later.checkpoint.load == "runs/aquila-vl-2b/stage1/checkpoints"
    assert not s1.checkpoint.weights_only and s1.run_dir != later.run_dir
    m, t, p = later.model, later.train, later.parallel
    assert (m.llm.num_layers, m.llm.hidden_size, m.llm.ffn_hidden_size) == (28, 1536, 8960)
    assert (m.llm.num_attention_heads, m.llm.num_query_groups, m.llm.vocab_size) == (12, 2, 151936)
    assert m.llm.tie_word_embeddings and m.vision.num_layers == 26 and m.max_tiles == 9
    assert (t.seq_length, t.micro_batch_size, t.global_batch_size) == (12288, 2, 512)
    assert (p.recompute, p.precision, p.distributed_optimizer, p.nproc_per_node) == ("full", "bf16", True, 8)


def test_tiny_recipe_matches_the_demo_tokenizer(tmp_path):
    # `make demo` trains llava-ov-tiny with the tokenizer built by build_tiny_qwen2_tokenizer
    # (default corpus): the model's placeholder ids and vocabulary must agree with it.
    transformers = pytest.importorskip("transformers")
    from mmdata.energon_loaders.tiny_tokenizer import build_tiny_qwen2_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(build_tiny_qwen2_tokenizer(tmp_path / "tok"))
    m = load_recipe(RECIPES / "llava-ov-tiny.yaml", family="llava-ov").model
    assert tok.convert_tokens_to_ids(["<image>", "<video>"]) == [m.image_token_id, m.video_token_id]
    assert len(tok) <= m.llm.vocab_size
