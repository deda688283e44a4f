"""The gpu tier (`make test-gpu`): the real CLIs on one CUDA device, in bf16 with the distributed
optimizer, checking the GPU path's findings item by item (docs/gpu.md, "The review, item by item").

Every test here carries the `gpu` marker. Without a usable GPU each one is skipped with one reason
and costs nothing: the CPU tiers (`make test`, `-m slow`) collect this folder too, and the skip is
decided before any fixture (data, models) is built. Two ways to be skipped:
- MMTRAIN_GPU_TESTS is not 1: tests/conftest.py hides CUDA from every test then, so the CPU tiers
  stay on the CPU of a GPU host;
- no CUDA device visible (this CPU-only host).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HOW = "the gpu tier runs on a GPU host with `make test-gpu`"


def gpu_skip_reason() -> str | None:
    """Why the gpu tier cannot run in this process, or None when it can."""
    if os.environ.get("MMTRAIN_GPU_TESTS") != "1":
        return f"MMTRAIN_GPU_TESTS is not set (tests/conftest.py hides CUDA): {HOW}"
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device: {HOW}"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every item of the tier is `gpu`
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    if not mine:
        return
    reason = gpu_skip_reason()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


# ----------------------------------------------------------------------------- shared assets
# (session-scoped, read-only; built only when a test that runs asks for them)

from tests.emu3_tiny import emu3_tok_dir, tiny_vq_dir  # noqa: E402,F401


def _written_once(name: str, folder: str, write: str, doc: str):
    """The session fixture `name`: `tests.gpu.runs.<write>(a fresh temp folder / "shards")`, built
    when a test first asks for it (runs.py is imported then, not at collection)."""

    def build(tmp_path_factory) -> Path:
        from tests.gpu import runs

        return getattr(runs, write)(tmp_path_factory.mktemp(folder) / "shards")

    build.__doc__ = doc
    return pytest.fixture(scope="session", name=name)(build)


emu3_token_shards = _written_once(
    "emu3_token_shards", "gpu_emu3_tokens", "write_emu3_token_shards", "Emu3 token shards written directly, no Ray."
)
llava_shards = _written_once(
    "llava_shards", "gpu_llava_data", "write_llava_mixed_shards", "Image and text-only samples alternating by key."
)
llava_halves_shards = _written_once(
    "llava_halves_shards",
    "gpu_llava_halves",
    "write_llava_halves_shards",
    "The same samples, images first, then text-only.",
)


@pytest.fixture(scope="session")
def qwen_tok(tmp_path_factory) -> Path:
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("gpu_tok") / "tokenizer")


@pytest.fixture(scope="session")
def llava_gpu_run(tmp_path_factory, llava_shards, qwen_tok):
    """freeze list (recipe syntax) -> (run dir, process) of a 4-step bf16 LLaVA-OV run on CUDA with
    checkpoints at steps 2 and 4; each freeze set trains once per session."""
    from tests.gpu import runs

    done: dict[str, tuple[Path, object]] = {}

    def get(freeze: str) -> tuple[Path, object]:
        if freeze not in done:
            run_dir = tmp_path_factory.mktemp("gpu_llava_run") / "run"
            proc = runs.train("llava-ov", run_dir, llava_shards, qwen_tok, *runs.llava_4_steps(freeze), *runs.GPU)
            done[freeze] = (run_dir, proc)
        return done[freeze]

    return get


@pytest.fixture(scope="session")
def emu3_gpu_run(tmp_path_factory, emu3_token_shards, emu3_tok_dir):
    """(run dir, process) of a 4-step bf16 Emu3 run on CUDA."""
    from tests.gpu import runs

    run_dir = tmp_path_factory.mktemp("gpu_emu3_run") / "run"
    proc = runs.train("emu3", run_dir, emu3_token_shards, emu3_tok_dir, *runs.FOUR_STEPS, *runs.GPU)
    return run_dir, proc


@pytest.fixture(scope="session")
def llava_hf_start(tmp_path_factory) -> Path:
    """A tiny HF LLaVA-OV made on the CPU: the common starting point of the CPU/GPU comparisons."""
    from tests.gpu.runs import write_llava_hf

    return write_llava_hf(tmp_path_factory.mktemp("gpu_llava_hf") / "hf")
