"""benchmarks/gpu_smoke.py on a CPU, run as a user runs it (a subprocess; tests do not import from
benchmarks/): without CUDA every GPU check says SKIP and the run exits 0; `--allow-cpu` runs the
CPU-runnable checks for real (so the script cannot rot); `--report DIR` writes report.md/json;
`--show` prints the table and the generation figures of known figures. CUDA is hidden by tests/conftest.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# issue 43's order (env, device, build, the gpu tier's core, the throughput table), then section E's rest
CHECKS = ("env", "device", "build", "tier", "throughput", "trainer", "checkpoint", "correctness", "sync", "generation")
REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_smoke.py"
LINE = re.compile(r"^(PASS|FAIL|SKIP) ([a-z]+): (.*) \[\d+\.\d s\]$")


def smoke(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def check_lines(out: str) -> dict[str, tuple[str, str]]:
    """{check name: (status, detail)} from the one line each check prints."""
    found = [LINE.match(x) for x in out.splitlines()]
    return {m.group(2): (m.group(1), m.group(3)) for m in found if m}


def test_without_cuda_every_gpu_check_skips_and_the_run_exits_0(tmp_path):
    proc = smoke("--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = check_lines(proc.stdout)
    assert list(lines) == list(CHECKS)  # every check, in the review's order
    assert lines["env"][0] == "PASS" and "no CUDA" in lines["env"][1]
    assert "megatron-core 0.16" in lines["env"][1] and "transformer_engine not installed" in lines["env"][1]
    for name, (status, detail) in lines.items():
        if name != "env":
            assert (status, detail) == ("SKIP", "no CUDA device"), name
    assert "peak within 10% of dry run: not run" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] == f"GPU_SMOKE: 1 passed, 0 failed, {len(CHECKS) - 1} skipped"
    assert json.loads((tmp_path / "figures.json").read_text()) == {}  # nothing timed: --show can re-read it


def test_the_report_and_a_spent_budget(tmp_path):
    """`--report DIR` writes report.json and report.md; a check with less than half its budget left
    is not started, and says so."""
    proc = smoke("--only", "env,device", "--budget", "1", "--report", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = check_lines(proc.stdout)
    assert lines["env"][0] == "SKIP" and lines["env"][1].startswith("not started: ")
    assert "of the 1 s budget, it needs about" in lines["env"][1]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("env", "SKIP"), ("device", "SKIP")]
    assert report["summary"] == "GPU_SMOKE: 0 passed, 0 failed, 2 skipped" and (tmp_path / "r" / "work").is_dir()
    md = (tmp_path / "r" / "report.md").read_text()
    assert md.startswith("# gpu_smoke report: CPU") and "| env | SKIP |" in md and "GPU_SMOKE: 0 passed" in md


def test_help_describes_every_option_and_check():
    proc = smoke("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage:")
    options = proc.stdout[proc.stdout.index("options:") :]
    flags = re.findall(r"^  (-[-\w]+(?:, --[-\w]+)?)(?: [A-Z_]+)?(.*)$", options, re.M)
    assert len(flags) >= 7
    for flag, rest in flags:  # help text on the flag's line or the next one
        nxt = options.split(flag, 1)[1].splitlines()[1] if not rest.strip() else rest
        assert rest.strip() or nxt.startswith(" " * 8), flag
    for name in CHECKS:
        assert re.search(rf"^  {name}\s", proc.stdout, re.M), name


def test_children_keep_the_callers_pythonpath_and_env_fails_without_megatron(tmp_path):
    """Review 2, N2: the children prepend the repo to PYTHONPATH instead of replacing it (packages
    installed with `pip install --target DIR` reach Python only through it), and `env` FAILs when
    megatron-core does not import. A PYTHONPATH entry whose `megatron` raises stands for a missing
    megatron-core: before the fix the children never saw it and both checks passed."""
    shadow = tmp_path / "shadow" / "megatron"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("megatron shadowed by the N2 test")\n')
    path = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH", "")) if p)
    proc = smoke(
        "--allow-cpu", "--quick", "--only", "env,build", "--work-dir", str(tmp_path / "work"), env={"PYTHONPATH": path}
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = check_lines(proc.stdout)
    assert lines["env"][0] == "FAIL", lines
    assert "megatron.core does not import: ImportError: megatron shadowed by the N2 test" in lines["env"][1]
    assert lines["build"][0] == "FAIL" and "TE hidden:" in lines["build"][1], lines  # the TE-hidden child too
    assert "megatron shadowed by the N2 test" in (tmp_path / "work" / "logs" / "build-te-hidden.log").read_text()


def test_unknown_check_is_refused():
    proc = smoke("--only", "env,nonsense")
    assert proc.returncode == 2 and "nonsense" in proc.stderr


def test_allow_cpu_runs_the_cheap_checks(tmp_path):
    """`env` is left out: --allow-cpu runs it as the test above does (its child ignores the flag)."""
    only = ["device", "build", "correctness"]
    proc = smoke("--allow-cpu", "--quick", "--only", ",".join(only), "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = check_lines(proc.stdout)
    assert list(lines) == only
    assert all(status == "PASS" for status, _ in lines.values()), lines
    assert "SDPACoreAttention" in lines["build"][1] and "TE hidden" in lines["build"][1]
    if importlib.util.find_spec("transformer_engine") is None:  # one build: with TE it would be the same run
        assert "with TE: transformer_engine not installed" in lines["build"][1]
        assert not (tmp_path / "logs" / "build-te.log").exists()
    assert re.search(r"(\d+)/\1 sub-checks passed", lines["correctness"][1])
    assert proc.stdout.rstrip().splitlines()[-1] == "GPU_SMOKE: 3 passed, 0 failed, 0 skipped"


@pytest.mark.slow
def test_allow_cpu_trains_resumes_and_keeps_weights_at_lr_0(tmp_path):
    proc = smoke("--allow-cpu", "--quick", "--only", "trainer,checkpoint", "--work-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = check_lines(proc.stdout)
    assert lines["trainer"][0] == "PASS" and "last micro-batch text-only in 2/2 steps" in lines["trainer"][1]
    assert lines["checkpoint"][0] == "PASS" and "resume 1->2" in lines["checkpoint"][1]
    assert re.search(r"(\d+)/\1 tensors unchanged", lines["checkpoint"][1])


def _report(work: Path, figures: dict, generation_log: str | None = None) -> tuple[str, list[str]]:
    """`gpu_smoke.py --show WORK`: (the generation figures line, the table's lines)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "figures.json").write_text(json.dumps(figures))
    if generation_log is not None:
        (work / "logs").mkdir(exist_ok=True)
        (work / "logs" / "generation.log").write_text(generation_log)
    proc = smoke("--show", str(work))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, *lines = proc.stdout.rstrip().splitlines()
    return first, lines


def test_table_and_targets_from_figures(tmp_path):
    gib = 2**30
    fig = dict(
        seq_length=8192,
        micro_batch=2,
        tokens_per_s_per_gpu=30000.0,
        mfu=0.47,
        peak_bytes=50 * gib,
        estimate_bytes=48 * gib,
    )
    _, lines = _report(tmp_path / "a", {"aquila-8k": fig, "generation": {"ms_ours": 20.0, "peak_gib": 17.0}})
    row = next(x for x in lines if x.startswith("Aquila-VL-2B 8K"))
    assert row.split()[-5:] == ["30,000", "47.0", "50.0", "48.0", "1.04"]
    assert next(x for x in lines if x.startswith("Aquila-VL-2B 12K")).split()[2] == "not"
    assert next(x for x in lines if x.startswith("generation")).split()[-5] == "50.0"  # tokens/s
    assert len({len(x) for x in lines[:6]}) == 1  # aligned columns
    assert lines[-1].endswith("Aquila 8K: met (47.0%); peak within 10% of dry run: met (worst 4%)")
    slow = {**fig, "mfu": 0.30, "peak_bytes": 60 * gib}
    line = _report(tmp_path / "b", {"aquila-8k": slow})[1][-1]
    assert "not met (30.0%)" in line and "not met (worst 25%)" in line


def test_generation_output_is_parsed(tmp_path):
    out = (
        "prefill logits: max |ours - transformers| = 0.0312 (logits scale 4.10)\n"
        '{"transformers": {"s_per_image": 90.1, "ms_per_token": 21.5}, "ours": {"s_per_image": 40.2, '
        '"ms_per_token": 9.6}}\n'
        "tokens: 144 vs 144, identical for the first 37\npeak GPU memory 17.3 GiB\n"
    )
    first, _ = _report(tmp_path, {}, generation_log=out)
    got = json.loads(first.removeprefix("generation: "))
    assert (got["ms_ours"], got["ms_hf"], got["peak_gib"]) == (9.6, 21.5, 17.3)
    assert got["tokens"].endswith("first 37") and got["prefill"].startswith("prefill logits")


def test_report_without_figures_is_refused(tmp_path):
    proc = smoke("--show", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "figures.json" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
