"""Both tiny families train on CUDA the way a user runs them (`mmtrain FAMILY RECIPE` in a
subprocess, bf16, megatron's distributed optimizer so DDP overlaps the grad reduce, nccl), with
Transformer Engine and with it hidden.

Review findings proved here: A1 (every trainable parameter gets a gradient on every micro-batch:
the last micro-batch of each LLaVA-OV step is text-only, at each stage's freeze set), A2 (a host
without TE builds and trains on the SDPA fallback and says so; with TE, the TE paths build), A7
(backend=auto on a GPU host is nccl on the GPU).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.gpu import runs

pytestmark = pytest.mark.gpu

#: LLaVA-OV's parts (mmtrain/llava_ov/spec.py PARTS) -> their model checkpoint key prefixes
PART_KEYS = {
    "vision_tower": ("vision_model.",),
    "projector": ("vision_projection.",),
    "llm": ("language_model.", "image_newline"),
}
#: the stages' freeze sets: stage 1 (projector only), stage 1.5/2 (all), and LLM + projector
FREEZE_SETS = {"all": [], "projector-only": ["vision_tower", "llm"], "frozen-vision": ["vision_tower"]}


def _part_of(key: str) -> str:
    return next(part for part, prefixes in PART_KEYS.items() if key.startswith(prefixes))


@pytest.mark.parametrize("stage", list(FREEZE_SETS))
def test_llava_ov_trains_on_cuda_ending_steps_on_text_only_micro_batches(stage, llava_gpu_run):
    """A1: 4 bf16 steps with the distributed optimizer (overlap_grad_reduce on), 2 micro-batches
    per step of which the last is always text-only (the vision tower and projector do not run on
    it), for each stage's freeze set. Before the fix megatron's DDP asserted at step 2. Losses and
    grad norms are finite, the loss falls when the LLM trains, frozen parts keep their exact
    weights and every trainable part moves."""
    frozen = FREEZE_SETS[stage]
    run, proc = llava_gpu_run("[" + ", ".join(frozen) + "]")
    m = runs.metrics(run)
    runs.assert_finite(m, [1, 2, 3, 4])
    for step, rec in m.items():  # the data really did end every step on a text-only micro-batch
        ids = rec["sample_ids"]
        assert len(ids) == 2 and not runs.is_text_only(ids[0]) and runs.is_text_only(ids[-1]), (step, ids)
    if "llm" not in frozen:
        runs.assert_loss_falls(m)

    before, after = runs.model_tensors(runs.iter_dir(run, 2)), runs.model_tensors(runs.iter_dir(run, 4))
    assert before.keys() == after.keys()
    moved = {part: [] for part in PART_KEYS}
    for key in before:
        part = _part_of(key)
        if part in frozen:
            assert before[key].equal(after[key]), f"frozen {key} changed"
        else:
            moved[part].append(not before[key].equal(after[key]))
    for part, changed in moved.items():
        if part not in frozen:
            assert changed and any(changed), f"no {part} weight moved between steps 2 and 4"
    # the GPU configuration was in force: nccl (A7: backend=auto on a GPU host), the distributed optimizer
    assert "backend=nccl" in proc.stderr
    state = json.loads((runs.iter_dir(run, 4) / "trainer_state.json").read_text())
    assert state["optimizer"]["name"] == "megatron.DistributedOptimizer", state["optimizer"]


def test_emu3_trains_on_cuda(emu3_gpu_run):
    """A1/A7 for the other family: 4 bf16 Emu3 steps (both tasks) with the distributed optimizer
    on nccl, finite, and the loss falls."""
    run, proc = emu3_gpu_run
    m = runs.metrics(run)
    runs.assert_finite(m, [1, 2, 3, 4])
    runs.assert_loss_falls(m)
    assert "backend=nccl" in proc.stderr


def _family_data(family: str, request: pytest.FixtureRequest) -> tuple:
    """(data, tokenizer, extra overrides) of `family`'s tiny run."""
    if family == "llava-ov":
        return request.getfixturevalue("llava_shards"), request.getfixturevalue("qwen_tok"), runs.LLAVA_ORDERED
    return request.getfixturevalue("emu3_token_shards"), request.getfixturevalue("emu3_tok_dir"), ()


@pytest.mark.parametrize("family", ["llava-ov", "emu3"])
def test_builds_and_trains_with_transformer_engine_hidden(family, request, tmp_path):
    """A2: with `import transformer_engine` failing as on a host without TE, megatron binds
    MagicMocks for its TE classes; te_support must say TE is unavailable, with the real error, and
    the model must build on the SDPA / varlen-flash fallback and train 2 bf16 steps, saying once
    why TE is not used."""
    env = runs.hidden_te_env(tmp_path)
    status = runs.te_probe(env)
    assert not status["available"], status
    assert "ModuleNotFoundError" in status["reason"] and "hidden by the gpu tier" in status["reason"], status
    data, tok, extra = _family_data(family, request)
    run = tmp_path / "run"
    proc = runs.train(family, run, data, tok, "train.iters=2", "checkpoint.interval=0", *extra, *runs.GPU, env=env)
    assert runs.TE_FALLBACK in proc.stderr and "hidden by the gpu tier" in proc.stderr
    runs.assert_finite(runs.metrics(run), [1, 2])


@pytest.mark.parametrize("family", ["llava-ov", "emu3"])
def test_builds_and_trains_with_transformer_engine(family, request, tmp_path):
    """A2/C2: where TE is installed, te_support finds it usable (a real class, not megatron's
    mock), the default runs use its attention (no fallback line), and the TE decoder layer spec
    (`parallel.transformer_impl=transformer_engine`: fused norm+linear, TE's THD RoPE) builds and
    trains 2 finite bf16 steps."""
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("Transformer Engine is not installed on this GPU host (the TE-hidden variant still runs)")
    status = runs.te_probe()
    assert status["available"], f"transformer_engine is installed but unusable: {status['reason']}"
    _, default_proc = (
        request.getfixturevalue("llava_gpu_run")("[]")
        if family == "llava-ov"
        else request.getfixturevalue("emu3_gpu_run")
    )
    assert runs.TE_FALLBACK not in default_proc.stderr
    data, tok, extra = _family_data(family, request)
    run = tmp_path / "run"
    proc = runs.train(
        family,
        run,
        data,
        tok,
        "train.iters=2",
        "checkpoint.interval=0",
        "parallel.transformer_impl=transformer_engine",
        *extra,
        *runs.GPU,
    )
    assert runs.TE_FALLBACK not in proc.stderr
    runs.assert_finite(runs.metrics(run), [1, 2])
