"""The resumable stage runner (mmdata/stage_runner.py) on a toy job of two stages, in process and
without Ray (its stages run their units through `Stage.execute`): resume after a failed unit and
after Ctrl-C, the output-folder rules, a refused job leaving nothing behind, the work settings.
The real jobs on Ray: test_preprocess*.py, test_tokenize_images.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mmdata import shard_format as sf
from mmdata.errors import EXIT_INTERRUPTED, Interrupted, UserError
from mmdata.readiness import unfinished_job
from mmdata.stage_runner import Identity, JobRun, RayCluster, ResumableJob, Stage, json_marker, run_job


class ToyError(UserError):
    pass


@dataclass
class ToyOptions:
    output: Path
    numbers: int = 6
    address: str | None = None
    num_cpus: int | None = None
    overwrite: bool = False
    progress: bool = False
    keep_work_dir: bool = False
    group: int = 2  # a work setting: how stage 2 groups the squares (never changes the output)
    fail_at: set = field(default_factory=set)  # units ("square", 3) that raise this run
    interrupt_at: set = field(default_factory=set)  # units that raise KeyboardInterrupt this run
    nothing: bool = False  # the job has nothing to write


class ToyJob(ResumableJob):
    """Stage 1 squares 0..n-1 (a JSON marker per number); stage 2 sums the squares in groups of
    `group` (its units exist once stage 1 is done); the finish step writes sum.txt."""

    tool = "toy job"
    error = ToyError
    work_dirs = ("squares", "sums")
    settings_dirs = ("sums",)

    def __init__(self, opts: ToyOptions):
        self.options = opts
        self.ran: dict[str, list] = {"square": [], "sum": []}  # units run (not taken from markers)
        self.squares: dict[int, int] = {}
        self.sums: dict[int, int] = {}

    def positive_flags(self) -> dict[str, float | None]:
        return {"--numbers": self.options.numbers}

    def identity(self, ray: RayCluster) -> Identity:
        return Identity({"numbers": self.options.numbers}, {"group": self.options.group})

    def _unit(self, stage: str, unit: int, marker: Path, result: dict) -> dict:
        if (stage, unit) in self.options.interrupt_at:
            raise KeyboardInterrupt
        if (stage, unit) in self.options.fail_at:
            raise RuntimeError(f"{stage} {unit} failed")
        self.ran[stage].append(unit)
        marker.write_text(json.dumps(result))
        return result

    def stages(self, run: JobRun) -> Iterator[Stage]:
        square_marker = lambda i: run.work / "squares" / f"{i}.json"  # noqa: E731
        sum_marker = lambda g: run.work / "sums" / f"{g}.json"  # noqa: E731

        def squares(todo, done):
            for i in todo:
                done(i, self._unit("square", i, square_marker(i), {"square": i * i}))

        yield Stage(
            "square",
            "squares",
            "square_s",
            range(self.options.numbers),
            execute=squares,
            recorded=json_marker(square_marker),
            on_result=lambda i, r: self.squares.__setitem__(i, r["square"]),
            noun="number",
            records=lambda: len(self.squares),
            record_noun="numbers",
        )
        if self.options.nothing:
            run.refuse("nothing to write")
        g = self.options.group
        groups = list(range(0, self.options.numbers, g))

        def sums(todo, done):
            for k in todo:
                total = sum(self.squares[i] for i in range(k, min(k + g, self.options.numbers)))
                done(k, self._unit("sum", k, sum_marker(k), {"sum": total}))

        yield Stage(
            "sum",
            "sums",
            "sum_s",
            groups,
            execute=sums,
            recorded=json_marker(sum_marker),
            on_result=lambda k, r: self.sums.__setitem__(k, r["sum"]),
        )

    def finish(self, run: JobRun) -> None:
        (run.out / "sum.txt").write_text(f"{sum(self.sums.values())}\n")

    def manifest(self, run: JobRun) -> dict:
        return {
            "tool": self.tool,
            "fingerprint": Identity({"numbers": self.options.numbers}, {}).fingerprint,
            "job": {"numbers": self.options.numbers},
            "squares": [self.squares[i] for i in sorted(self.squares)],
            "run": {"resumed": run.resumed, "phases": run.phases},
        }


def _run(out: Path, **kw) -> tuple[ToyJob, dict]:
    job = ToyJob(ToyOptions(out, **kw))
    return job, run_job(job)


@pytest.mark.unit
def test_a_toy_job_runs_its_stages_and_publishes(tmp_path):
    out = tmp_path / "out"
    job, manifest = _run(out)
    assert job.ran == {"square": [0, 1, 2, 3, 4, 5], "sum": [0, 2, 4]}
    assert (out / "sum.txt").read_text() == f"{sum(i * i for i in range(6))}\n"
    assert json.loads((out / sf.MANIFEST_NAME).read_text()) == manifest
    assert manifest["run"]["resumed"] == {"squares": 0, "sums": 0}
    assert set(manifest["run"]["phases"]) == {"square_s", "sum_s", "finish_s"}  # no stage needed Ray
    assert not (out / sf.WORK_DIR_NAME).exists() and not (tmp_path / ".out.lock").exists()
    assert sorted(p.name for p in out.iterdir()) == [sf.MANIFEST_NAME, "sum.txt"]


@pytest.mark.unit
def test_a_failed_unit_then_a_rerun_does_only_the_rest(tmp_path, capsys):
    ref = _run(tmp_path / "ref")[1]
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="sum 2 failed"):
        _run(out, fail_at={("sum", 2)})
    assert not (out / sf.MANIFEST_NAME).exists()
    assert "unfinished `toy job` job" in unfinished_job(out)  # readers refuse the folder
    job, manifest = _run(out, progress=True)
    assert job.ran == {"square": [], "sum": [2, 4]}  # finished units come from their markers
    assert manifest["run"]["resumed"] == {"squares": 6, "sums": 1}
    assert {k: v for k, v in manifest.items() if k != "run"} == {k: v for k, v in ref.items() if k != "run"}
    assert (out / "sum.txt").read_bytes() == (tmp_path / "ref" / "sum.txt").read_bytes()
    err = capsys.readouterr().err
    assert "square: resumed, 6/6 numbers already done" in err and "sum: resumed, 1/3 tasks already done" in err


@pytest.mark.unit
def test_ctrl_c_is_interrupted_with_how_to_resume(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Interrupted) as e:
        _run(out, interrupt_at={("square", 4)})
    assert str(e.value) == "interrupted: rerun the same command to resume"
    assert e.value.exit_code == EXIT_INTERRUPTED
    assert (out / sf.WORK_DIR_NAME).is_dir() and not (out / sf.MANIFEST_NAME).exists()
    assert not (tmp_path / ".out.lock").exists()  # the lock goes with the run
    job, manifest = _run(out)
    assert job.ran == {"square": [4, 5], "sum": [0, 2, 4]}
    assert manifest["run"]["resumed"] == {"squares": 4, "sums": 0}


@pytest.mark.unit
def test_output_folder_rules(tmp_path, capsys):
    out = tmp_path / "out"
    first = _run(out)[1]
    job, again = _run(out)  # the same job, finished: nothing to do
    assert again == first and job.ran == {"square": [], "sum": []}
    assert "already complete" in capsys.readouterr().err
    with pytest.raises(ToyError, match=r"other inputs or options \(changed: numbers 6 → 4\).*--overwrite"):
        _run(out, numbers=4)
    job, manifest = _run(out, numbers=4, overwrite=True)
    assert manifest["squares"] == [0, 1, 4, 9] and job.ran["square"] == [0, 1, 2, 3]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(ToyError, match="notes.txt"):
        _run(tmp_path / "foreign")
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ToyError, match="is a file"):
        _run(tmp_path / "afile")
    with pytest.raises(ToyError, match="--numbers must be a positive number, got 0"):
        _run(tmp_path / "new", numbers=0)
    with pytest.raises(ToyError, match="--num-cpus must be a positive number"):
        _run(tmp_path / "new", num_cpus=0)
    assert not (tmp_path / "new").exists()


@pytest.mark.unit
def test_a_refused_job_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ToyError, match="nothing to write"):
        _run(out, nothing=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.unit
def test_changed_work_settings_redo_only_their_stage(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        _run(out, fail_at={("sum", 4)})
    job, manifest = _run(out, group=3)  # other groups: the sums' markers are gone, the squares' kept
    assert job.ran == {"square": [], "sum": [0, 3]}
    assert (out / "sum.txt").read_text() == f"{sum(i * i for i in range(6))}\n"


@pytest.mark.unit
def test_a_stage_runs_its_units_one_way():
    with pytest.raises(ValueError, match="exactly one of submit and execute"):
        Stage("s", "s", "s_s", [1])
    with pytest.raises(ValueError, match="exactly one of submit and execute"):
        Stage("s", "s", "s_s", [1], submit=print, execute=print)


def test_a_held_output_refuses_the_job_before_it_writes(tmp_path):
    """The runner takes the output's lock for every job (tokenize-images included): another
    process holding it stops the job with exit 2 naming the holder."""
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from mmdata.folder_lock import FolderLock\n"
            f"with FolderLock({str(out)!r}, '--output'):\n print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"--output {out} is in use by another job: pid {holder.pid}"):
            _run(out)
        assert not out.exists()
    finally:
        holder.communicate("")
    _run(out)
