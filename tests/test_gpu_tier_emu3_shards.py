"""The gpu tier's Emu3 token shards are written directly, without Ray (review 2, N4): energon reads
them as VQTokenSample and the tiny Emu3 recipe trains on them (here on CPU, gloo/fp32; the tier
runs the same shards on CUDA)."""

from __future__ import annotations

import subprocess
import sys

from tests.gpu import runs


def test_token_shards_without_ray_train_emu3(tmp_path):
    code = (
        "import sys; from pathlib import Path; from tests.gpu.runs import write_emu3_token_shards; "
        f"write_emu3_token_shards(Path({str(tmp_path / 'tokens')!r})); "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=runs.REPO, env=runs.run_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"  # Ray never imported
    from mmdata.dev.tiny_emu3_tokenizer import build_tiny_emu3_tokenizer
    from mmtrain.runtime.preflight import dataset_sample_type

    assert dataset_sample_type(tmp_path / "tokens").endswith("VQTokenSample")
    tok = build_tiny_emu3_tokenizer(tmp_path / "tok")
    run = tmp_path / "run"
    runs.train(
        "emu3", run, tmp_path / "tokens", tok, "train.iters=2", "checkpoint.interval=0", *runs.CPU, env=runs.CPU_ENV
    )
    runs.assert_finite(runs.metrics(run), [1, 2])
