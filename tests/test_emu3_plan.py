"""Packing plans for Emu3 token shards: `mmdata tokenize-images --tokenizer` writes a length index
(each sample's length per Emu3 task, keys kept with their gaps), `mmtrain pack-plan RECIPE`
draws each sample's task and caption drop and records its geometry, the real loader follows the
plan with exactly the planned lengths, and training refuses a plan whose geometry is not the
recipe's. The token shards are the `token_dir` fixture (dev records: multi-image, text-only,
captions, quarantined records)."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from mmdata import shard_format as sf
from mmdata.packing.emu3_geometry import GENERATE, GENERATE_UNCOND, UNDERSTAND, UNENCODABLE
from mmdata.packing.plan_file import plan_path, read_plan_info

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "emu3-tiny.yaml"
SEQ = 512
# a high CFG rate and a non-empty unconditional prompt, so every variant is drawn and counted
SETTINGS = ("data.p_uncond=0.5", "data.uncond_prompt=a picture", "data.tasks={understanding: 1.0, generation: 2.0}")


def _recipe_args(token_dir: Path, tok: Path, *extra: str) -> list[str]:
    return [
        f"data.paths=[{token_dir}]",
        f"tokenizer.path={tok}",
        f"train.seq_length={SEQ}",
        "data.packing=plan",
        "logging.tensorboard=false",
        "run_dir=/nonexistent/run",
        *SETTINGS,
        *extra,
    ]


def _pack_plan(token_dir: Path, tok: Path, *extra: str) -> int:
    from mmtrain.cli import main

    sets = [a for s in _recipe_args(token_dir, tok, *extra) for a in ("--set", s)]
    return main(["pack-plan", str(RECIPE), *sets, "--jobs", "1", "--no-progress"])


def test_the_length_index_lists_every_written_sample_with_its_key(token_dir, emu3_tok_dir):
    manifest = json.loads((token_dir / sf.MANIFEST_NAME).read_text())
    index = pq.read_table(token_dir / "lengths.parquet")
    li = manifest["length_index"]
    assert li["kind"] == "emu3" and li["sha256"] and li["system_prompt"] == "You are a helpful assistant."
    from mmdata.shard_job.lengths import tokenizer_fingerprint

    assert li["tokenizer_sha256"] == tokenizer_fingerprint(emu3_tok_dir)
    keys = []  # in energon's global order: shard by shard
    for shard in manifest["shards"]:
        with tarfile.open(token_dir / shard["name"]) as t:
            keys += list(dict.fromkeys(m.name.split(".", 1)[0] for m in t.getmembers()))
    assert index.column("key").to_pylist() == keys
    assert index.column("index").to_pylist() == list(range(len(keys)))
    assert keys != [f"{i:010d}" for i in range(len(keys))]  # quarantined records left gaps
    assert np.bincount(index.column("shard").to_numpy()).tolist() == [s["samples"] for s in manifest["shards"]]
    und, gen, block = (
        index.column(c).to_numpy() for c in ("understanding_tokens", "generation_tokens", "image_block_tokens")
    )
    assert (
        (und > 0).all() and (gen == UNENCODABLE).any() and (gen > block).any()
    )  # text-only, multi-image: no generation
    assert ((block == 0) == (gen == UNENCODABLE)).sum() >= 1


def test_plan_lengths_are_what_the_loader_encodes(token_dir, emu3_tok_dir, capsys):
    """`mmtrain pack-plan RECIPE` on token shards (refused before this feature): the loader in plan mode
    gives every planned sample its planned task, caption drop and exact length, in plan order."""
    from mmdata.energon_loaders.emu3.loader import build_emu3_loader

    assert _pack_plan(token_dir, emu3_tok_dir) == 0
    assert "generation (" in capsys.readouterr().out
    path = plan_path(token_dir, SEQ)
    info = read_plan_info(path)
    assert info["geometry"] == {
        "kind": "emu3",
        "tokenizer_sha256": info["geometry"]["tokenizer_sha256"],
        "system_prompt": "You are a helpful assistant.",
        "uncond_prompt": "a picture",
        "tasks": {"generation": 2.0, "understanding": 1.0},
        "p_uncond": 0.5,
    }
    plan = pq.read_table(path)
    bins, keys, variants, tokens = (plan.column(c).to_pylist() for c in ("bin", "key", "variant", "tokens"))
    assert {UNDERSTAND, GENERATE, GENERATE_UNCOND} <= set(variants)
    loader = build_emu3_loader(
        token_dir,
        emu3_tok_dir,
        seq_length=SEQ,
        micro_batch_size=1,
        num_workers=1,
        packing="plan",
        encoder={"p_uncond": 0.5, "uncond_prompt": "a picture", "tasks": {"understanding": 1.0, "generation": 2.0}},
    )
    it = iter(loader)
    task = {UNDERSTAND: "understanding", GENERATE: "generation", GENERATE_UNCOND: "generation"}
    for b in range(info["bins"]):
        batch = next(it)
        rows = [j for j, x in enumerate(bins) if x == b]
        assert [k.rsplit("#", 1)[-1] for k in batch.sample_keys[0]] == [keys[j] for j in rows]
        assert batch.tasks[0] == [task[variants[j]] for j in rows]
        assert np.diff(batch.cu_seqlens.tolist())[: len(rows)].tolist() == [tokens[j] for j in rows], b
    stats = loader.stats
    assert stats.skipped == {}
    assert stats.counters["task/generation_uncond"] == variants.count(GENERATE_UNCOND)


def test_a_plan_of_other_settings_is_refused(token_dir, emu3_tok_dir, tmp_path, capsys):
    from mmtrain.config.load import load_recipe
    from mmtrain.emu3.spec import EMU3
    from mmtrain.runtime.preflight import PreflightError, preflight

    assert _pack_plan(token_dir, emu3_tok_dir) == 0
    preflight(load_recipe(RECIPE, _recipe_args(token_dir, emu3_tok_dir)), EMU3)  # the plan's own settings pass
    with pytest.raises(PreflightError) as e:
        preflight(
            load_recipe(RECIPE, _recipe_args(token_dir, emu3_tok_dir, "data.p_uncond=0.1", "data.uncond_prompt=''")),
            EMU3,
        )
    (line,) = e.value.problems
    assert line.startswith("data.packing: plan: ") and "other settings than the recipe's" in line, line
    assert "uncond_prompt 'a picture' (recipe: '')" in line and "p_uncond 0.5 (recipe: 0.1)" in line, line
    assert "system_prompt" not in line.split("RECIPE.yaml")[0] and "tasks" not in line.split("RECIPE.yaml")[0], line
    assert f"mmtrain pack-plan RECIPE.yaml {token_dir} --set train.seq_length={SEQ}" in line, line
    # another tokenizer than the one the index counted with: pack-plan says how to recount; training refuses the plan
    other = tmp_path / "tok"
    shutil.copytree(emu3_tok_dir, other)
    (other / "notes.txt").write_text("another tokenizer folder")
    capsys.readouterr()
    assert _pack_plan(token_dir, other) == 2
    assert "another tokenizer than the recipe's" in capsys.readouterr().err
    with pytest.raises(PreflightError, match=r"tokenizer_sha256 '[0-9a-f]+.*\(recipe: '[0-9a-f]+"):
        preflight(load_recipe(RECIPE, _recipe_args(token_dir, other)), EMU3)
    # token shards without a length index
    bare = tmp_path / "bare"
    shutil.copytree(token_dir, bare)
    (bare / "lengths.parquet").unlink()
    assert _pack_plan(bare, emu3_tok_dir) == 2
    assert "rerun `mmdata tokenize-images` with --tokenizer" in capsys.readouterr().err
