"""A pack plan records the image token geometry it counted with, `mmtrain pack-plan RECIPE`
counts with the recipe's (the tiny recipe's 30-px tiles, not LLaVA-OV's 384-px ones), and
training refuses (preflight, exit 2, before run_dir is written) a plan made with another
geometry, or an old plan without a recorded one unless the recipe uses the default geometry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mmdata.packing.plan_file import plan_path, read_plan_info
from tests.fixtures_preprocess import tokenized_shards

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "llava-ov-tiny.yaml"
#: recipes/llava-ov-tiny.yaml's model.vision, model.max_tiles / grid_max, data.video_frames
TINY = {"image_size": 30, "patch_size": 14, "max_tiles": 9, "grid_max": 6, "video_frames": 8}
TINY_FLAGS = "--image-size 30 --patch-size 14 --max-tiles 9 --grid-max 6 --video-frames 8"
DEFAULT = {"image_size": 384, "patch_size": 14, "max_tiles": 9, "grid_max": 6, "video_frames": 32}
SEQ = 1024


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMTRAIN_CPU_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """120 synthetic records through the job with the tiny tokenizer (exact text tokens)."""
    return tokenized_shards(tmp_path_factory.mktemp("plangeo"), 120, seed=3, samples_per_tar=40, samples_per_shard=40)


def make_plan(shards: Path, *args: str, tool: str = "mmdata.cli") -> dict:
    proc = cli(tool, "pack-plan", *args, "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    return read_plan_info(plan_path(shards, SEQ))


def train(run_dir: Path, shards: Path, tok: Path, *extra: str) -> subprocess.CompletedProcess:
    return cli(
        "mmtrain.cli",
        "llava-ov",
        str(TINY_RECIPE),
        f"run_dir={run_dir}",
        f"data.paths=[{shards}]",
        f"tokenizer.path={tok}",
        "data.num_workers=1",
        f"train.seq_length={SEQ}",
        "train.iters=1",
        "logging.tensorboard=false",
        "data.packing=plan",
        *extra,
    )


def test_recipe_plan_counts_what_the_loader_counts(data):
    """`mmtrain pack-plan RECIPE` records the recipe's geometry and plans each sample at the length the loader's
    own task encoder gives it with that geometry; the default plan counts 384-px tiles."""
    from megatron.energon import SkipSample

    from mmdata.energon_loaders.llava_ov.task_encoder import LlavaOVEncoderConfig, LlavaOVTaskEncoder
    from mmdata.energon_loaders.sample import ConversationSample
    from mmdata.inspect import random_samples

    shards, tok = data
    info = make_plan(shards, str(TINY_RECIPE), str(shards), "--set", f"train.seq_length={SEQ}", tool="mmtrain.cli")
    assert info["geometry"] == TINY and info["seq_length"] == SEQ
    assert (info["packing_report"]["cp"], info["packing_report"]["tp"]) == (1, 1)  # the recipe's parallel sizes
    assert info["packing_report"]["computed_tokens"] == info["bins"] * SEQ  # no CP: the rows, nothing more
    plan = pq.read_table(plan_path(shards, SEQ))
    tokens = dict(zip(plan.column("index").to_pylist(), plan.column("tokens").to_pylist()))
    g = TINY
    encoder = LlavaOVTaskEncoder(
        str(tok),
        LlavaOVEncoderConfig(
            seq_length=1 << 20,
            image_size=g["image_size"],
            patch_size=g["patch_size"],
            max_tiles=g["max_tiles"],
            grid_max=g["grid_max"],
            max_video_frames=g["video_frames"],
        ),
    )
    checked = 0
    for sample in random_samples(shards, 40, seed=4):
        cs = ConversationSample(
            __key__=sample.key, __restore_key__=(), __subflavors__=None, __sources__=(), **sample.to_energon_fields()
        )
        try:
            enc = encoder.preencode_sample(cs)
        except SkipSample:
            continue
        assert tokens[int(sample.key)] == len(enc.input_ids), sample.key
        checked += 1
    assert checked >= 20
    # the default plan counts LLaVA-OV's tiles: its lengths are the length index's, far longer
    default = make_plan(shards, str(shards), "--seq-length", str(SEQ))
    assert default["geometry"] == DEFAULT
    cp = make_plan(
        shards,
        str(TINY_RECIPE),
        str(shards),
        "--set",
        f"train.seq_length={SEQ}",
        "--set",
        "parallel.cp=2",
        "--set",
        "parallel.nproc_per_node=2",
        "--tp",
        "2",
        tool="mmtrain.cli",
    )["packing_report"]
    assert (cp["cp"], cp["tp"]) == (2, 2) and cp["real_tokens"] == info["packing_report"]["real_tokens"]
    assert cp["computed_tokens"] > info["packing_report"]["computed_tokens"]  # CP pads each segment to 8
    lengths = pq.read_table(shards / "lengths.parquet").column("total_tokens").to_numpy()
    assert default["tokens"] == int(lengths.sum()) > 2 * info["tokens"]


def test_training_refuses_a_plan_of_another_geometry(data, tmp_path):
    shards, tok = data
    make_plan(shards, str(shards), "--seq-length", str(SEQ))  # LLaVA-OV's 384-px geometry
    run_dir = tmp_path / "run"
    proc = train(run_dir, shards, tok)
    assert proc.returncode == 2, proc.stderr[-3000:]
    problems = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1, proc.stderr[-3000:]
    line = problems[0]
    assert "data.packing: plan" in line and "image_size 384 (recipe: 30)" in line, line
    assert "max_tiles" not in line  # only the fields that differ
    assert f"mmdata pack-plan {shards} --seq-length {SEQ} {TINY_FLAGS}" in line, line
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def test_rebuilt_plan_passes_preflight_and_old_format_plans_are_refused(data):
    from mmdata.energon_loaders.plan_packing import PlanError, plan_for_data
    from mmdata.packing.geometry import DEFAULT_GEOMETRY, PlanGeometry
    from mmtrain.config.load import load_recipe
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.runtime.preflight import preflight

    shards, tok = data
    # the command the refusal names makes a plan the run accepts
    make_plan(shards, str(shards), "--seq-length", str(SEQ), *TINY_FLAGS.split())
    recipe = load_recipe(
        TINY_RECIPE,
        [
            f"data.paths=[{shards}]",
            f"tokenizer.path={tok}",
            f"train.seq_length={SEQ}",
            "data.packing=plan",
            "logging.tensorboard=false",
            "run_dir=/nonexistent/run",
        ],
    )
    preflight(recipe, LLAVA_OV)
    # a plan of the format before plans recorded their geometry: refused, whatever the geometry, naming the command
    make_plan(shards, str(shards), "--seq-length", str(SEQ))
    path = plan_path(shards, SEQ)
    table = pq.read_table(path)
    info = json.loads(table.schema.metadata[b"mmdata.pack_plan"])
    info["format"] = 1
    del info["geometry"]
    pq.write_table(table.replace_schema_metadata({"mmdata.pack_plan": json.dumps(info)}), path)
    for geometry in (DEFAULT_GEOMETRY, PlanGeometry(**TINY)):
        with pytest.raises(PlanError, match=r"has format 1, this mmdata reads format 2: rerun `mmdata pack-plan`"):
            plan_for_data([shards], None, SEQ, geometry=geometry)


def test_pack_plan_refuses_overrides_without_a_recipe(data):
    shards, _ = data
    proc = cli("mmdata.cli", "pack-plan", str(shards), "--set", "train.seq_length=512")
    assert proc.returncode == 2 and "need --recipe" in proc.stderr, proc.stderr
