"""Recipe validator: errors name the key path; overrides, stages, resolved round trip; the
family's sections, parts and cross-checks come from its FamilySpec."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from mmtrain.config import Recipe, RecipeError, load_recipe, load_recipe_dict, parse_override, save_resolved
from mmtrain.config.errors import RecipeErrors
from mmtrain.config.schema import DataConfig
from mmtrain.config.typed import convert
from mmtrain.spec import FamilySpec

pytestmark = pytest.mark.unit

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


def _unused(*args, **kwargs):
    raise AssertionError("the schema tests build nothing")


TOY = FamilySpec(
    name="toy",
    help="a toy family",
    model_config_cls=_ToyModel,
    data_config_cls=DataConfig,
    parts={"vision_tower": ("vision",), "projector": ("proj",), "llm": ("lm",)},
    check_recipe=lambda recipe, errors: None,
    architecture_keys=("inner",),
    build_model=_unused,
    batch_type=object,
    build_loader=_unused,
    forward_step=_unused,
    model_shapes=_unused,
)

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
    return load_recipe_dict(copy.deepcopy(raw if raw is not None else BASE), overrides, family, TOY)


def errors_of(raw=None, overrides=(), family=None) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load(raw, overrides, family)
    return info.value.errors


def test_valid_recipe_is_typed():
    r = load()
    assert r.model == _ToyModel(inner=_Inner(width=16), depth=3)
    assert r.parallel.dp == 2
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
    assert r.train.iters == 99 and r.data.paths == [os.path.abspath("a"), os.path.abspath("b")]  # paths: absolute
    assert r.checkpoint.load == os.path.abspath("ckpt") and r.model.inner.name == "x"
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
    assert err.startswith("override 'parallel.tp=3': parallel: tp*pp*cp = 3*1*1 = 3 does not divide the world size")
    assert load(overrides=["parallel.tp=2", "parallel.pp=2", "train.global_batch_size=2"]).parallel.dp == 1
    # context parallelism: world = tp*pp*cp*dp, and megatron's 2*cp (x tp with SP) split of the sequence
    assert load(overrides=["parallel.cp=2", "train.global_batch_size=2"]).parallel.dp == 1
    (err,) = errors_of(overrides=["parallel.cp=2", "train.global_batch_size=2", "train.seq_length=130"])
    assert "train.seq_length: 130 is not a multiple of 2*cp = 2*2 = 4" in err
    (err,) = errors_of(
        overrides=[
            "parallel.cp=2",
            "train.global_batch_size=2",
            "train.seq_length=132",
            "parallel.sequence_parallel=true",
        ]
    )
    assert "train.seq_length: 132 is not a multiple of 2*cp*tp = 2*2*2 = 8" in err
    (err,) = errors_of(overrides=["parallel.cp=2", "train.global_batch_size=2", "parallel.cp_comm_type=a2a+p2p"])
    assert "parallel.hierarchical_cp_sizes: must list the a2a and p2p group sizes whose product is parallel.cp=2" in err
    assert load(
        overrides=[
            "parallel.cp=2",
            "train.global_batch_size=2",
            "parallel.cp_comm_type=a2a+p2p",
            "parallel.hierarchical_cp_sizes=[1, 2]",
        ]
    ).parallel.hierarchical_cp_sizes == [1, 2]
    (err,) = errors_of(overrides=["parallel.cp_comm_type=ring"])
    assert "parallel.cp_comm_type" in err and "'all_gather'" in err


def test_other_cross_checks():
    assert errors_of(overrides=["train.seq_length=0"]) == [
        "override 'train.seq_length=0': train.seq_length: must be > 0, got 0"
    ]
    errs = errors_of(overrides=["data.paths=[]", "tokenizer.path="])
    assert any(
        e.endswith("data.paths: must list at least one shard dir or metadataset YAML for action: run") for e in errs
    )
    assert any("tokenizer.path: is required" in e for e in errs)
    # dry_run / auto_tune need no data
    assert load(overrides=["action=dry_run", "data.paths=[]"]).action == "dry_run"
    assert any("everything is frozen" in e for e in errors_of(overrides=["freeze=[vision_tower, projector, llm]"]))
    # data.packing: true | false | plan; a plan file only with plan
    assert load(overrides=["data.packing=plan"]).data.packing == "plan"
    assert load(overrides=["data.packing=false"]).data.packing is False
    assert any("data.packing: expected bool or one of 'plan'" in e for e in errors_of(overrides=["data.packing=plans"]))
    assert any(
        "data.packing_plan: is only read with data.packing: plan" in e
        for e in errors_of(overrides=["data.packing_plan=/x/pack-plan-8192.parquet"])
    )
    # data.balance_window: steps >= 1 or auto, and only for online balancing
    assert load(overrides=["data.balance=true", "data.balance_window=4"]).data.balance_window == 4
    assert load(overrides=["data.balance=true"]).data.balance_window == "auto"
    assert any(
        "data.balance_window: must be >= 1 steps or auto, got 0" in e
        for e in errors_of(overrides=["data.balance=true", "data.balance_window=0"])
    )
    assert any(
        "data.balance_window: is only used by online balancing" in e
        for e in errors_of(overrides=["data.balance_window=4"])
    )
    assert any(
        "data.balance_window: expected int or one of 'auto'" in e
        for e in errors_of(overrides=["data.balance_window=auot"])
    )


def test_family_checks_run_on_its_sections():
    """llava-ov's data: section adds the loader's tile/frame keys and checks them against model:."""
    tiny = RECIPES / "llava-ov-tiny.yaml"
    with pytest.raises(RecipeError) as info:
        load_recipe(tiny, ["data.max_tiles=4"])
    assert any("model.max_tiles=9" in e for e in info.value.errors)
    with pytest.raises(RecipeError) as info:
        load_recipe(tiny, ["data.video_frames=0"])
    assert info.value.errors == ["override 'data.video_frames=0': data.video_frames: must be > 0, got 0"]
    assert load_recipe(tiny).data.video_frames == 8
    # the toy family's data: section is the shared one: no tile keys there
    (err,) = errors_of(overrides=["data.max_tiles=4"])
    assert err.startswith("override 'data.max_tiles=4': data.max_tiles: unknown key")


def test_freeze_and_lr_mult_name_the_familys_parts():
    r = load(overrides=["freeze=[vision_tower]", "optimizer.lr_mult={vision_tower: 0.2}"])
    assert r.freeze == ["vision_tower"] and r.optimizer.lr_mult == {"vision_tower": 0.2}
    (err,) = errors_of(overrides=["freeze=[vision]"])
    assert err.startswith("override 'freeze=[vision]': freeze[0]: unknown part 'vision'; did you mean 'vision_tower'?")
    assert "(parts of toy: vision_tower, projector, llm)" in err
    (err,) = errors_of(overrides=["optimizer.lr_mult.projectr=2"])
    assert "optimizer.lr_mult.projectr: unknown part 'projectr'; did you mean 'projector'?" in err
    (err,) = errors_of(overrides=["optimizer.lr_mult.llm=-1"])
    assert err.endswith("optimizer.lr_mult.llm: must be >= 0, got -1.0")


def test_pre_release_keys_are_plain_errors_with_their_path():
    """No migrations before a release: a key spelled as in a pre-release recipe is refused like
    any other wrong key, naming its path."""
    raw = copy.deepcopy(BASE)
    raw["freeze"] = {"vision_tower": True, "projector": False, "llm": True}
    raw["optimizer"] = {"lr": 1.0e-5, "vision_tower_lr": 2.0e-6}
    errs = errors_of(raw)
    assert "optimizer.vision_tower_lr: unknown key" in errs
    assert any(e.startswith("freeze: expected list of str") for e in errs), errs
    (err,) = errors_of(overrides=["optimizer.vision_tower_lr="])
    assert err == "override 'optimizer.vision_tower_lr=': optimizer.vision_tower_lr: unknown key"


def test_unknown_family_is_named_with_the_known_ones():
    raw = dict(copy.deepcopy(BASE), family="llava-0v")
    with pytest.raises(RecipeError) as info:
        load_recipe_dict(raw)
    assert any(
        e.startswith("family: unknown model family 'llava-0v'; did you mean 'llava-ov'?") for e in info.value.errors
    )


def test_evaluation_needs_validation_data():
    r = load()
    assert r.train.eval_interval == 0 and r.train.eval_iters == 4 and r.data.val_paths == []
    (err,) = errors_of(overrides=["train.eval_interval=100"])
    assert err.startswith("override 'train.eval_interval=100': data.val_paths: must list at least one shard dir")
    assert "train.eval_interval=100" in err
    r = load(overrides=["train.eval_interval=100", "data.val_paths=[held_out]", "train.eval_iters=2"])
    assert (
        r.train.eval_interval == 100 and r.train.eval_iters == 2 and r.data.val_paths == [os.path.abspath("held_out")]
    )
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
        1: {"freeze": ["llm"], "optimizer.lr": 1.0e-3},
        "2": {"optimizer": {"lr": 1.0e-5, "lr_mult": {"vision_tower": 0.2}}},
    }
    r = load(raw)
    assert r.stage == "1" and r.freeze == ["llm"] and r.optimizer.lr == 1e-3
    r = load(raw, ["stage=2", "optimizer.lr_mult.vision_tower=0.3"])
    assert r.stage == "2" and "llm" not in r.freeze and r.optimizer.lr == 1e-5
    assert r.optimizer.lr_mult == {"vision_tower": pytest.approx(0.3)}
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
    again = load_recipe(out, spec=TOY)
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
    assert s1.freeze == ["vision_tower", "llm"]
    assert s1.optimizer.lr == 1e-3 and s1.optimizer.lr_mult == {}
    later = load_recipe(path, ["stage=2a"], family="llava-ov")
    assert later.freeze == []
    assert later.optimizer.lr == 1e-5 and later.optimizer.lr_mult == {"vision_tower": 0.2}
    assert later.optimizer.lr * later.optimizer.lr_mult["vision_tower"] == pytest.approx(2e-6)
    assert later.checkpoint.weights_only and later.checkpoint.load == os.path.abspath(
        "runs/aquila-vl-2b/stage1/checkpoints"
    )
    assert not s1.checkpoint.weights_only and s1.run_dir != later.run_dir
    m, t, p = later.model, later.train, later.parallel
    assert (m.llm.num_layers, m.llm.hidden_size, m.llm.ffn_hidden_size) == (28, 1536, 8960)
    assert (m.llm.num_attention_heads, m.llm.num_query_groups, m.llm.vocab_size) == (12, 2, 151936)
    assert m.llm.tie_word_embeddings and m.vision.num_layers == 26 and m.max_tiles == 9
    assert (t.seq_length, t.micro_batch_size, t.global_batch_size) == (12288, 2, 512)
    assert (p.recompute, p.precision, p.distributed_optimizer, p.nproc_per_node) == ("none", "bf16", True, 8)
    assert (p.cp, p.dp, p.lm_loss) == (2, 4, "auto")  # the long-context layout


def test_tiny_recipe_matches_the_demo_tokenizer(tmp_path):
    # `make demo` trains llava-ov-tiny with the tokenizer built by build_tiny_qwen2_tokenizer
    # (default corpus): the model's placeholder ids and vocabulary must agree with it.
    import transformers

    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(build_tiny_qwen2_tokenizer(tmp_path / "tok"))
    m = load_recipe(RECIPES / "llava-ov-tiny.yaml", family="llava-ov").model
    assert tok.convert_tokens_to_ids(["<image>", "<video>"]) == [m.image_token_id, m.video_token_id]
    assert len(tok) <= m.llm.vocab_size


def test_a_check_over_two_overridden_keys_names_both_in_one_prefix():
    """Issue 45: `override 'parallel.vpp=2': override 'parallel.pp=2': ...` read as two errors."""
    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES / "llava-ov-tiny.yaml", ["parallel.vpp=2", "parallel.pp=2"])
    errs = info.value.errors
    (err,) = [e for e in errs if "parallel.vpp:" in e]
    assert err.startswith("overrides 'parallel.vpp=2', 'parallel.pp=2': parallel.vpp: ")
    assert all(e.count("override") == 1 for e in errs), errs
    errors = RecipeErrors({("a",): "override 'a=1'", ("b",): "stage 'x'", ("c",): "override 'c=2'"})
    errors.add(("a",), "bad", [("b",), ("c",)])
    assert errors.items == ["overrides 'a=1', 'c=2', stage 'x': a: bad"]


def test_counts_in_messages_agree_with_their_noun():
    """Issue 45: "1 entries"; a count that can be 1 goes through mmdata.units.plural."""
    errors = RecipeErrors()
    convert([1], tuple[int, int], ("parallel", "pp_layers"), errors)
    assert errors.items == ["parallel.pp_layers: expected list of 2 (int, int), got 1 item"], errors.items
