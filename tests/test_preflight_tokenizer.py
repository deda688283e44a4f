"""A tokenizer of the other family is refused by preflight (issue 45): a Qwen2 tokenizer given to
`mmtrain emu3` costs one problem line naming the VQ model the token shards were made with (exit 2,
before `run_dir` is written: it used to end in the loader's internal error after `config.yaml`
and `hf_assets/` were written), and an Emu3 tokenizer given to `mmtrain llava-ov` is named as one
(not a `video_token_id` to change)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.emu3_tiny import DEV_SAMPLES_PER_SHARD, dev_samples
from tests.fixtures_training import the_one_refusal
from tests.fixtures_training import train_family as run

REPO = Path(__file__).resolve().parents[1]
LLAVA_RECIPE = REPO / "recipes" / "llava-ov-tiny.yaml"
EMU3_RECIPE = REPO / "recipes" / "emu3-tiny.yaml"


@pytest.fixture(scope="module")
def qwen2_tok(tmp_path_factory) -> Path:
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok") / "qwen2")


def test_emu3_refuses_a_qwen2_tokenizer_naming_the_shards_vq(demo_token_dir, qwen2_tok, tiny_vq_dir, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    proc = run("emu3", EMU3_RECIPE, run_dir, demo_token_dir, qwen2_tok)
    line = the_one_refusal(proc)
    assert line.startswith(
        f"  - tokenizer.path: the tokenizer at {qwen2_tok} is not an Emu3 tokenizer (it has no Emu3 bos token"
    ), line
    assert f"the token shards at {demo_token_dir} were made with the VQ model at {tiny_vq_dir.resolve()}" in line, line
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert not run_dir.exists()


def test_emu3_check_passes_its_own_tokenizer_and_names_a_short_codebook(demo_token_dir, emu3_tok_dir, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    from mmtrain.config.load import load_recipe
    from mmtrain.emu3.tokenizer_check import check_tokenizer

    recipe = load_recipe(
        EMU3_RECIPE, [f"data.paths=[{demo_token_dir}]", f"tokenizer.path={emu3_tok_dir}", f"run_dir={tmp_path / 'run'}"]
    )
    tok = AutoTokenizer.from_pretrained(emu3_tok_dir)
    assert check_tokenizer(recipe, tok) == []
    recipe.model.llm.vocab_size = len(tok) - 1
    assert check_tokenizer(recipe, tok) == [
        f"tokenizer.path: the tokenizer at {emu3_tok_dir} has {len(tok)} tokens but "
        f"model.llm.vocab_size is {len(tok) - 1}; use the model's own tokenizer "
        "(or a larger vocab_size)"
    ]


@pytest.mark.unit
def test_llava_ov_names_an_emu3_tokenizer(emu3_tok_dir, tmp_path):  # noqa: F811
    from mmdata.dev.shards import write_dev_shards
    from mmtrain.config.load import load_recipe
    from mmtrain.llava_ov.spec import LLAVA_OV
    from mmtrain.runtime.preflight import PreflightError, preflight

    shards = write_dev_shards(tmp_path / "llava", dev_samples(8), samples_per_shard=DEV_SAMPLES_PER_SHARD)
    recipe = load_recipe(
        LLAVA_RECIPE,
        [
            f"data.paths=[{shards}]",
            f"tokenizer.path={emu3_tok_dir}",
            "logging.tensorboard=false",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(PreflightError) as err:
        preflight(recipe, LLAVA_OV)
    assert err.value.problems == [
        f"tokenizer.path: the tokenizer at {emu3_tok_dir} is an Emu3 tokenizer (it holds Emu3's visual tokens); "
        "mmtrain llava-ov needs the tokenizer of its LLM (e.g. the Qwen2 tokenizer of checkpoint.load); Emu3 token "
        "shards are trained with `mmtrain emu3`"
    ], err.value.problems
    assert not (tmp_path / "run").exists()
