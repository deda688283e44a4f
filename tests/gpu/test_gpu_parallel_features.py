"""The parallel features of issue 32 on CUDA (bf16, megatron's distributed optimizer, nccl), each
against the same run on one GPU: the vision tower's own layout at TP=2, virtual pipeline stages
at PP=2, vision-aware balancing on one GPU and its row exchange over NCCL at DP=2, and all of them
together on 4 GPUs. A test that needs more GPUs than are visible skips with that reason.

What the CPU tiers cannot show, and these do (docs/gpu.md, "The parallel features on CUDA"):
- `parallel.vision.tp=1`: the fresh tower weights broadcast over TP through the run's device (the
  patch conv and norms are still on the host at build time; NCCL takes CUDA tensors only), the
  tiles' all-gather and its backward on NCCL;
- `parallel.vpp`: megatron's interleaved schedule with unbatched p2p (`overlap_p2p_comm`) on NCCL,
  one DDP per chunk with the distributed optimizer and the parameter all-gather overlapped with
  the chunks' forwards (every chunk's gather dispatched at the step start, forward-only too);
- `data.balance`: the joined rows pinned again before their asynchronous copy, and the rows'
  bytes exchanged as CUDA uint8 tensors over the DP group's NCCL communicator;
- together (4 GPUs): the group of each rank alone that the tower's own layout needs is made by
  every rank, not by the first stage's ranks alone (on NCCL that hung: torch splits the world's
  communicator for a new group).
"""

from __future__ import annotations

import pytest

from tests.fixtures_training import FEATURES_TOGETHER
from tests.gpu import runs

pytestmark = pytest.mark.gpu

#: two bf16 GPU runs of the same batches in other layouts: the sums run in another order (TP
#: all-reduces, pipeline stages, micro-batches), and bf16 rounds each partial result to 8 bits;
#: the first steps' mean loss over ~100 label tokens stays well within 1% of each other, while
#: a lost gradient (a tower that does not train, a stage's chunk without its update) or a
#: misplaced row changes the per-sample losses by far more from step 2 on
LAYOUT_REL = 1e-2
#: grad norms sum squares of every bf16-rounded gradient: looser than the loss
GRAD_REL = 5e-2

#: 3 steps of 4 micro-batches of one sample (image and text-only alternating) from the common HF
#: start, every layout reading the same global batches, an evaluation at step 3
STEPS = 3
COMMON = (
    "train.iters=3",
    "checkpoint.interval=0",
    "data.sharding=replicated",
    "train.global_batch_size=4",
    "train.eval_interval=3",
    "train.eval_iters=1",
    *runs.LLAVA_ORDERED,
    *runs.GPU,
)


def _common(llava_shards, llava_hf_start) -> tuple[str, ...]:
    return (*COMMON, f"checkpoint.load={llava_hf_start}", f"data.val_paths=[{llava_shards}]")


@pytest.fixture
def train_common(tmp_path, llava_shards, qwen_tok, llava_hf_start):
    """`train_common(*layout)`: the common run in tmp_path / "run" in the layout the overrides
    give; returns its process."""

    def train(*layout: str):
        common = _common(llava_shards, llava_hf_start)
        return runs.train("llava-ov", tmp_path / "run", llava_shards, qwen_tok, *common, *layout)

    return train


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory, llava_shards, qwen_tok, llava_hf_start) -> dict[int, dict]:
    """The reference: the common run on one GPU (TP = PP = DP = 1)."""
    run = tmp_path_factory.mktemp("gpu_one") / "run"
    runs.train("llava-ov", run, llava_shards, qwen_tok, *_common(llava_shards, llava_hf_start))
    m = runs.metrics(run)
    runs.assert_finite(m, range(1, STEPS + 1))
    return m


def _assert_matches(got: dict[int, dict], ref: dict[int, dict]) -> None:
    """Every step's loss, grad norm and per-sample losses (by sample) within the layout tolerance,
    and the step-3 validation loss."""
    runs.assert_finite(got, range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=LAYOUT_REL), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=GRAD_REL), step
        mine, theirs = runs.by_sample(got[step]), runs.by_sample(ref[step])
        assert [i for i, _ in mine] == [i for i, _ in theirs], step
        assert [x for _, x in mine] == pytest.approx([x for _, x in theirs], rel=LAYOUT_REL), step
    if "val_loss" in ref[STEPS]:
        assert got[STEPS]["val_loss"] == pytest.approx(ref[STEPS]["val_loss"], rel=LAYOUT_REL)


@runs.needs_gpus(2)
def test_vision_tower_own_layout_at_tp2(one_gpu, tmp_path, train_common):
    """`parallel.vision.tp=1` at TP=2 on 2 GPUs: the tower whole on each rank, encoding half the
    tiles, the outputs all-gathered over NCCL; its fresh weights broadcast from TP rank 0 at build
    time (before the trainer moves the model to the GPU). Same numbers as one GPU."""
    proc = train_common("parallel.nproc_per_node=2", "parallel.tp=2", "parallel.vision.tp=1")
    assert "vision tower: its own layout, TP 1; a micro-batch's tiles split over 2 ranks" in proc.stderr
    assert "backend=nccl" in proc.stderr
    _assert_matches(runs.metrics(tmp_path / "run"), one_gpu)


@runs.needs_gpus(2)
def test_virtual_pipeline_stages_at_pp2(one_gpu, tmp_path, train_common):
    """`parallel.vpp=2` at PP=2 on 2 GPUs with an uneven split (stage 0: only the vision tower,
    projector and embedding, its second chunk empty; stage 1: both decoder layers and the loss; the
    split the CPU slow tier proves): megatron's interleaved 1F1B with unbatched p2p
    on NCCL, one DDP per chunk under the distributed optimizer with the parameter all-gathers
    overlapped (training and the forward-only evaluation). Same numbers as one GPU, and the step-3
    checkpoint is the distributed optimizer's."""
    run = tmp_path / "run"
    pipeline = ("parallel.pp=2", "parallel.vpp=2", "parallel.pp_layers=[0,1,0,1]")
    proc = train_common("parallel.nproc_per_node=2", *pipeline, "checkpoint.interval=3")
    assert "decoder layers per stage [[0, 0], [1, 1]], 2 virtual stages per rank" in proc.stderr
    _assert_matches(runs.metrics(run), one_gpu)
    state = (runs.iter_dir(run, STEPS) / "trainer_state.json").read_text()
    assert "megatron.DistributedOptimizer" in state


def _unbalanced_and_balanced(tmp_path, shards, tokenizer, overrides) -> dict[str, dict]:
    """The same run without and with `data.balance`: the same samples with the same losses."""
    got = {}
    for balance in ("false", "true"):
        run = tmp_path / f"balance-{balance}"
        runs.train("llava-ov", run, shards, tokenizer, *overrides, f"data.balance={balance}")
        got[balance] = runs.metrics(run)
    _assert_matches(got["true"], got["false"])
    return got


def test_balance_on_one_gpu(tmp_path, llava_halves_shards, qwen_tok, llava_hf_start):
    """`data.balance` on one GPU (DP=1, replicated): a step of 16 micro-batches of 2 rows drawn in
    key order from the halves (8 micro-batches of two images, then 8 of two text-only rows) placed
    by cost, so that every micro-batch joins an image row and a text-only row (mixed media at
    micro-batch 2), and the joined micro-batches pinned again before their asynchronous copy.
    Against the same run unbalanced: the same samples with the same losses, the rows moved.
    (The alternating shards would not do: their micro-batches of 2 are balanced as drawn.)"""
    overrides = (
        *_common(llava_halves_shards, llava_hf_start),
        "train.micro_batch_size=2",
        "train.global_batch_size=32",
    )
    got = _unbalanced_and_balanced(tmp_path, llava_halves_shards, qwen_tok, overrides)
    for step in range(1, STEPS + 1):
        assert got["true"][step]["sample_ids"] != got["false"][step]["sample_ids"], step


@runs.needs_gpus(2)
def test_balance_exchanges_rows_over_nccl(tmp_path, llava_halves_shards, qwen_tok, llava_hf_start):
    """`data.balance` at DP=2 with `data.sharding=dp` on 2 GPUs: one rank draws only image rows,
    the other only text-only rows; the ranks exchange rows as bytes (CUDA uint8 tensors, sizes
    gathered first) over the DP group's NCCL communicator. Against the same run unbalanced: the
    same samples with the same losses, and the vision work spread (vision_balance 2.0 -> lower)."""
    overrides = (
        "train.iters=3",
        "checkpoint.interval=0",
        "data.sharding=dp",
        "train.global_batch_size=4",
        f"checkpoint.load={llava_hf_start}",
        "parallel.nproc_per_node=2",
        *runs.LLAVA_ORDERED,
        *runs.GPU,
        "data.balance_window=1",
    )
    got = _unbalanced_and_balanced(tmp_path, llava_halves_shards, qwen_tok, overrides)
    for step in range(1, STEPS + 1):
        assert got["false"][step]["vision_balance"] == pytest.approx(2.0)  # the images all on one rank
        assert got["true"][step]["vision_balance"] < 1.5, step


@runs.needs_gpus(4)
def test_the_features_together_on_four_gpus(one_gpu, tmp_path, train_common):
    """TP=2 x PP=2 x VPP=2 with an uneven split, the vision tower's own layout and balancing, on 4
    GPUs: the second stage's ranks hold no tower but still join the making of each rank's group of
    one (NCCL splits the world's communicator for it; made by the first stage alone, it hung).
    Same numbers as one GPU."""
    train_common("parallel.nproc_per_node=4", *FEATURES_TOGETHER)
    _assert_matches(runs.metrics(tmp_path / "run"), one_gpu)


@runs.needs_gpus(2)
def test_balance_window_exchanges_steps_of_rows_over_nccl(tmp_path, llava_halves_shards, qwen_tok, llava_hf_start):
    """`data.balance` with its default window at DP=2, one rank drawing only image rows and the
    other only text-only rows, 2 rows per rank per step (auto: windows of 4 steps): the 4 steps'
    rows travel over NCCL as one exchange; the 4 steps train the same samples as the unbalanced
    run's 4 steps, every step's vision work spread over the ranks (2.0 unbalanced: the images all on
    one rank), and the losses are finite (steps differ from the unbalanced run's: rows moved between them)."""
    overrides = (
        "train.iters=4",
        "checkpoint.interval=0",
        "data.sharding=dp",
        "train.global_batch_size=4",
        f"checkpoint.load={llava_hf_start}",
        "parallel.nproc_per_node=2",
        *runs.LLAVA_ORDERED,
        *runs.GPU,
    )
    got = {}
    for balance in ("false", "true"):
        run = tmp_path / f"balance-{balance}"
        runs.train("llava-ov", run, llava_halves_shards, qwen_tok, *overrides, f"data.balance={balance}")
        got[balance] = runs.metrics(run)
    runs.assert_finite(got["true"], range(1, 5))
    assert sorted(i for s in range(1, 5) for i, _ in runs.by_sample(got["true"][s])) == sorted(
        i for s in range(1, 5) for i, _ in runs.by_sample(got["false"][s])
    )
    for step in range(1, 5):
        assert got["false"][step]["vision_balance"] == pytest.approx(2.0)
        assert got["true"][step]["vision_balance"] < 1.5, step
