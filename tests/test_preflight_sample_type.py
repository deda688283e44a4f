"""Shards of the wrong kind are refused before anything is built: Emu3 VQ token shards given to
`mmtrain llava-ov`, or LLaVA image/text shards given to `mmtrain emu3`, cost one problem line
naming both sample types (exit 2, run_dir untouched), also for a leaf of a metadataset blend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.emu3_tiny import DEV_SAMPLES_PER_SHARD, dev_samples
from tests.fixtures_training import the_one_refusal
from tests.fixtures_training import train_family as run

REPO = Path(__file__).resolve().parents[1]
LLAVA_RECIPE = REPO / "recipes" / "llava-ov-tiny.yaml"
EMU3_RECIPE = REPO / "recipes" / "emu3-tiny.yaml"
VQ_TYPE = "mmdata.energon_loaders.emu3.vq_token_sample.VQTokenSample"
CONV_TYPE = "mmdata.energon_loaders.sample.ConversationSample"


@pytest.fixture(scope="module")
def llava_shards(tmp_path_factory) -> Path:
    """LLaVA image/text shards (ConversationSample), written without the Ray job."""
    from mmdata.dev.shards import write_dev_shards

    return write_dev_shards(
        tmp_path_factory.mktemp("kind") / "llava", dev_samples(8), samples_per_shard=DEV_SAMPLES_PER_SHARD
    )


@pytest.fixture(scope="module")
def token_shards(demo_token_dir) -> Path:
    """Emu3 VQ token shards (VQTokenSample): the session's, from `mmdata tokenize-images`."""
    return demo_token_dir


@pytest.fixture(scope="module")
def llava_tok(tmp_path_factory) -> Path:
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("kind") / "tok")


def test_sample_types_are_read_from_the_energon_index(llava_shards, token_shards):
    from mmtrain.runtime.preflight import dataset_sample_type

    assert dataset_sample_type(llava_shards) == CONV_TYPE
    assert dataset_sample_type(token_shards) == VQ_TYPE


def test_llava_ov_refuses_emu3_token_shards(token_shards, llava_tok, tmp_path):
    run_dir = tmp_path / "run"
    proc = run("llava-ov", LLAVA_RECIPE, run_dir, token_shards, llava_tok)
    line = the_one_refusal(proc)
    assert line.startswith(f"  - data.paths[0]: {token_shards} holds VQTokenSample samples, Emu3 VQ token shards"), line
    assert "mmtrain llava-ov trains on ConversationSample samples, LLaVA image/text shards" in line, line
    assert "`mmtrain emu3`" in line, line
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 20
    assert not run_dir.exists()


def test_emu3_refuses_llava_shards(llava_shards, emu3_tok_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = run("emu3", EMU3_RECIPE, run_dir, llava_shards, emu3_tok_dir)
    line = the_one_refusal(proc)
    assert f"data.paths[0]: {llava_shards} holds ConversationSample samples, LLaVA image/text shards" in line, line
    assert "mmtrain emu3 trains on VQTokenSample samples" in line and "`mmtrain llava-ov`" in line, line
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def test_each_leaf_of_a_metadataset_blend_is_checked(llava_shards, token_shards, llava_tok, tmp_path):
    from mmtrain.config.load import load_recipe
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.runtime.preflight import PreflightError, preflight

    blend = tmp_path / "blend.yaml"
    ours = {"dataset_config": "mmdata.yaml"}  # our sample types (energon's default: InterleavedSample)
    blend.write_text(
        yaml.safe_dump(
            {
                "__module__": "megatron.energon",
                "__class__": "MetadatasetV2",
                "splits": {
                    "train": {
                        "blend": [
                            {"weight": 1.0, "path": str(llava_shards), **ours},
                            {"weight": 1.0, "path": os.path.relpath(token_shards, tmp_path), **ours},
                        ]
                    }
                },
            }
        )
    )
    overrides = [
        f"data.paths=[{blend}]",
        f"tokenizer.path={llava_tok}",
        "logging.tensorboard=false",
        f"run_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(PreflightError) as err:
        preflight(load_recipe(LLAVA_RECIPE, overrides), LLAVA_OV)
    assert len(err.value.problems) == 1
    leaf = tmp_path / os.path.relpath(token_shards, tmp_path)
    assert err.value.problems[0].startswith(
        f"data.paths[0]: {blend} (its dataset {leaf}) holds VQTokenSample samples"
    ), err.value.problems
    # the same blend without the token shards passes
    blend.write_text(
        yaml.safe_dump(
            {
                "__module__": "megatron.energon",
                "__class__": "MetadatasetV2",
                "splits": {"train": {"blend": [{"weight": 1.0, "path": str(llava_shards), **ours}]}},
            }
        )
    )
    preflight(load_recipe(LLAVA_RECIPE, overrides), LLAVA_OV)
    # ... but not without `dataset_config`: energon would hand the task encoder InterleavedSample
    blend.write_text(
        yaml.safe_dump(
            {
                "__module__": "megatron.energon",
                "__class__": "MetadatasetV2",
                "splits": {"train": {"blend": [{"weight": 1.0, "path": str(llava_shards)}]}},
            }
        )
    )
    with pytest.raises(PreflightError) as err:
        preflight(load_recipe(LLAVA_RECIPE, overrides), LLAVA_OV)
    assert len(err.value.problems) == 1 and "\n" not in err.value.problems[0]
    assert err.value.problems[0].startswith(f"data.paths[0]: {blend}: the entry of {llava_shards} reads `dataset.yaml`")
    assert "add `dataset_config: mmdata.yaml`" in err.value.problems[0], err.value.problems
