"""Pipeline stages that fit a VLM (mmtrain/models/pipeline_split.py): the decoder's layers per
stage and virtual stage as megatron-core builds them, the TransformerConfig fields that ask it
to, the recipe checks, and the cost model's copy of megatron's interleaved schedule table.
In-process only; training on such layouts (loss equality with PP 1, resume across splits) is
tests/test_train_runtime.py::test_uneven_and_virtual_pipeline_stages_with_the_vision_layout_and_balance_match_one_process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmtrain.config import RecipeError, load_recipe
from mmtrain.models.megatron_config import pipeline_split_kwargs
from mmtrain.models.pipeline_split import PipelineSplitError, interleaved_schedule_problem, split_layers
from mmtrain.planning.cost_model import forwards_in_flight, schedule_table
from tests.fixtures_training import bf16_layout

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[1] / "recipes" / "llava-ov-tiny.yaml"


def test_splits_per_stage_and_per_virtual_stage():
    assert split_layers(28, 2).counts == ((14,), (14,)) and not split_layers(28, 2).explicit
    assert split_layers(28, 2, 2).counts == ((7, 7), (7, 7))
    uneven = split_layers(28, 2, pp_layers=[12, 16])
    assert uneven.counts == ((12,), (16,)) and uneven.explicit and uneven.describe() == "[12, 16]"
    assert split_layers(28, 2, 2, [12, 16]).counts == ((6, 6), (8, 8))  # each stage's split over its chunks
    # pp*vpp entries: one per chunk in megatron's order (chunk c = vp_stage*pp + pp_rank)
    per_chunk = split_layers(4, 2, 2, [0, 2, 1, 1])
    assert per_chunk.counts == ((0, 1), (2, 1)) and per_chunk.describe() == "[[0, 1], [2, 1]]"
    assert [per_chunk.stage_layers(r) for r in range(2)] == [1, 3]
    assert [per_chunk.first_layer(r, v) for v in range(2) for r in range(2)] == [0, 0, 2, 3]
    assert per_chunk.megatron_layout() == [["embedding"], ["decoder"] * 2, ["decoder"], ["decoder", "loss"]]


@pytest.mark.parametrize(
    "args, needle",
    [
        ((28, 2, 1, [12, 15]), "sums to 27, but the decoder has 28 layers"),
        ((28, 2, 1, [10, 10, 8]), "has 3 entries; expected pp = 2"),
        ((28, 2, 2, [10, 10, 8]), "expected pp = 2 (layers per stage) or pp*vpp = 4"),
        ((28, 2, 2, [13, 15]), "13 is not a multiple of 2"),
        ((28, 1, 1, [28]), "needs pipeline parallelism"),
        ((28, 1, 2, []), "parallel.vpp=2 needs pipeline parallelism"),
        ((28, 3, 1, []), "do not split evenly into pp*vpp = 3*1"),
        ((28, 2, 1, [-1, 29]), "must be >= 0"),
    ],
)
def test_splits_megatron_cannot_build_are_refused(args, needle):
    with pytest.raises(PipelineSplitError) as info:
        split_layers(*args)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "num_layers, pp, vpp, pp_layers",
    [
        (28, 2, 1, [12, 16]),
        (28, 4, 1, [4, 8, 8, 8]),
        (28, 2, 2, [12, 16]),
        (8, 2, 2, [0, 3, 2, 3]),
        (24, 4, 3, []),
    ],
)
def test_megatron_builds_the_split_we_describe(num_layers, pp, vpp, pp_layers):
    """megatron-core's own layout object, made from our fields, holds our counts per (stage,
    virtual stage), and its TransformerConfig accepts them (validating the layout); for one chunk
    per stage its layer offsets are our first layers (the global numbers checkpoints use)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_config import TransformerConfig

    split = split_layers(num_layers, pp, vpp, pp_layers)
    kw = pipeline_split_kwargs(split)
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        **kw,
    )
    assert config.virtual_pipeline_model_parallel_size == (vpp if vpp > 1 else None)
    if not pp_layers:
        assert "pipeline_model_parallel_layout" not in kw  # megatron's own even split
        return
    layout = config.pipeline_model_parallel_layout
    assert isinstance(layout, PipelineParallelLayerLayout)
    assert [[chunk.count(LayerType.decoder) for chunk in stage] for stage in layout.layout] == [
        list(c) for c in split.counts
    ]
    if vpp == 1:
        assert [layout.get_layer_offset(pp_rank=r) for r in range(pp)] == [split.first_layer(r) for r in range(pp)]


def test_virtual_stages_get_megatron_lms_unbatched_p2p():
    """With pp 2 a batched exchange with the one neighbour in both directions hands activations to
    the gradient buffer (it hung on gloo): the interleaved schedule gets megatron-LM's default."""
    assert pipeline_split_kwargs(None) == {} and pipeline_split_kwargs(split_layers(4, 2)) == {}
    kw = pipeline_split_kwargs(split_layers(4, 2, 2))
    assert kw == {"virtual_pipeline_model_parallel_size": 2, "overlap_p2p_comm": True, "batch_p2p_comm": False}


def test_an_import_spreads_layers_a_pp_does_not_divide():
    from mmtrain.models.pipeline_split import balanced_layers
    from mmtrain.runtime.hf_conversion import import_split

    assert balanced_layers(28, 3) == [9, 9, 10] and balanced_layers(2, 3) == [0, 1, 1]
    assert balanced_layers(28, 4) == [7, 7, 7, 7]
    assert import_split(28, 4) is None and import_split(28, 1) is None  # megatron's own even split
    assert import_split(28, 3).counts == ((9,), (9,), (10,)) and import_split(28, 3).explicit


def test_interleaved_schedule_needs_micro_batches_in_groups_of_pp():
    assert interleaved_schedule_problem(3, 4, 1) is None  # 1F1B takes any number
    assert interleaved_schedule_problem(8, 4, 2) is None
    assert "= 6) to be a multiple of parallel.pp=4" in interleaved_schedule_problem(6, 4, 2)
    assert interleaved_schedule_problem(2, 4, 2) is not None


def test_recipe_checks_name_the_keys():
    def errors(*overrides: str) -> str:
        with pytest.raises(RecipeError) as info:
            load_recipe(TINY, ["action=dry_run", "parallel.nproc_per_node=2", *overrides])
        return "\n".join(info.value.errors)

    ok = load_recipe(
        TINY,
        [
            "action=dry_run",
            "parallel.nproc_per_node=2",
            "parallel.pp=2",
            "model.llm.num_layers=4",
            "parallel.pp_layers=[1,3]",
            "parallel.vpp=1",
        ],
    )
    assert ok.parallel.pp_layers == [1, 3]
    assert "parallel.pp_layers: parallel.pp_layers=[1, 2] sums to 3, but the decoder has 2 layers" in errors(
        "parallel.pp=2", "parallel.pp_layers=[1,2]"
    )
    assert "parallel.vpp: parallel.vpp=2 needs pipeline parallelism" in errors("parallel.vpp=2")
    assert "parallel.vpp: the decoder's 2 layers do not split evenly into pp*vpp = 2*2" in errors(
        "parallel.pp=2", "parallel.vpp=2"
    )
    # the tiny recipe's 2 sequences a step at dp 1 are fine for pp 2; 3 are not a multiple of it
    assert "train.global_batch_size: parallel.vpp=2 runs megatron's interleaved schedule" in errors(
        "parallel.pp=2", "parallel.vpp=2", "model.llm.num_layers=4", "train.global_batch_size=3"
    )
    assert "parallel.vpp: must be > 0" in errors("parallel.vpp=0")


def test_schedule_table_is_megatrons():
    """The cost model's copy of the interleaved schedule's order of forward passes (the cost model
    imports no megatron) against megatron's own table."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    for m, vpp, group in ((4, 2, 2), (5, 2, 3), (8, 3, 4), (6, 1, 2)):
        assert schedule_table(m, vpp, group) == get_schedule_table(m, vpp, group)


def test_forwards_in_flight_follow_megatrons_warm_up():
    """1F1B holds pp - stage micro-batches on a stage; interleaving holds megatron's warm-up
    ((pp - stage - 1)*2 + (vpp - 1)*pp, + 1) chunk passes, i.e. its memory penalty
    1 + (pp-1)/(pp*vpp) on the first stage for even chunks, and charges the first chunk (where
    the vision tower runs) for more micro-batches than 1F1B does."""
    L = bf16_layout(pp=4, global_batch_size=16, seq_length=8)
    assert [forwards_in_flight(L, s) for s in range(4)] == [[4], [3], [2], [1]]
    assert forwards_in_flight(L.with_(global_batch_size=2), 0) == [2]  # no more than the step's micro-batches
    v2 = L.with_(vpp=2)
    assert forwards_in_flight(v2, 0) == [7, 4] and forwards_in_flight(v2, 3) == [4, 1]
    assert sum(forwards_in_flight(v2, 0)) / 2 == pytest.approx(4 * (1 + 3 / (4 * 2)))
