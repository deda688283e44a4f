"""A user's first hour (issue 20): every command's help renders and lists only what works; an
expected problem is one line naming the key or path, exit status 2, no traceback and nothing
written; training checks what it will touch before anything heavy; no local-looking path is
sent to the HF hub; figures use one unit system; `mmdata preview`; `action=print_config` with
absolute paths; the documented recipe defaults are the schema's.

SIGINT during preprocessing (three points, then a byte-identical rerun) is in
test_preprocess_resume.py (slow tier).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmdata.cli import build_parser as mmdata_parser
from mmdata.cli import main as mmdata_main
from mmtrain.cli import build_parser as mmtrain_parser
from mmtrain.cli import main as mmtrain_main
from tests.cli_runs import flags, run_module

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "llava-ov-tiny.yaml"

REPO_ROOT = Path(__file__).resolve().parents[1]


def cli(main, capsys, *argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of an in-process command (argparse's exits included)."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exit_:
        rc = exit_.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc: int, err: str, *words: str) -> str:
    """Exit 2, one line `PROG: error: ...` naming every word, no traceback."""
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection or name lookup fails and is recorded; HF_HUB_OFFLINE is off, so
    only our own path checks keep transformers from the hub."""
    attempts: list[tuple] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("networking is disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return attempts


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from mmdata.dev.tiny_tokenizer import build_tiny_qwen2_tokenizer

    return build_tiny_qwen2_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


# ----------------------------------------------------------------------------- the CLIs' help


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, path + (name,))


@pytest.mark.parametrize("which", ["mmdata", "mmtrain"])
def test_help_of_every_command_renders_and_describes_every_option(which, capsys):
    build, main = {"mmdata": (mmdata_parser, mmdata_main), "mmtrain": (mmtrain_parser, mmtrain_main)}[which]
    commands = list(_subcommands(build()))
    assert len(commands) > 4
    for path, parser in commands:
        rc, out, _ = cli(main, capsys, *path, "--help")
        assert rc == 0 and out.startswith("usage:") and out == parser.format_help(), path
        assert parser.description, f"{which} {' '.join(path)} has no description"
        undescribed = [
            a.dest for a in parser._actions if a.help in (None, "") and not isinstance(a, argparse._SubParsersAction)
        ]
        assert not undescribed, f"{which} {' '.join(path)}: options without help: {undescribed}"
        if path:  # the command's own text, laid out as written (not a module docstring squashed)
            assert parser.formatter_class is argparse.RawDescriptionHelpFormatter, path
    # convert's directions have their own options
    helps = {path: p.format_help() for path, p in commands}
    if which == "mmtrain":
        assert "--tp" in helps[("convert", "hf-to-mcore")] and "--tp" not in helps[("convert", "mcore-to-hf")]
        assert "--max-shard-gib" in helps[("convert", "mcore-to-hf")]
    rc, out, _ = cli(main, capsys, "--version")
    first, *rest = out.splitlines()
    assert rc == 0 and re.fullmatch(rf"{which} \d+\.\d+\.\d+", first)
    named = dict(line.strip().split(": ", 1) for line in rest)
    for lib in ("torch", "megatron-core", "megatron-energon", "ray", "transformers"):
        assert re.match(r"\d+\.\d+", named[lib]), (lib, named)
    head = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    )
    if head.returncode == 0:  # a git checkout (CI's clone): its revision
        assert re.fullmatch(rf"{head.stdout.strip()}(, modified)?", named["git revision"]), named
    else:
        assert named["git revision"] in ("not a git checkout", "unknown (git rev-parse failed)"), named


def test_mmtrain_lists_only_families_that_work(tmp_path, capsys):
    """Every family `mmtrain --help` offers is a registry entry that resolves a recipe and plans
    it (its model and data classes, shapes and checks import)."""
    from mmtrain import registry

    listed = [path[0] for path, _ in _subcommands(mmtrain_parser()) if len(path) == 1]
    families = [name for name in listed if name not in ("train", "convert", "generate", "worst-samples", "pack-plan")]
    assert families == registry.family_names()
    for name in families:
        recipes = [
            p
            for p in sorted((REPO / "recipes").glob("*.yaml"))
            if (yaml.safe_load(p.read_text()) or {}).get("family") == name
        ]
        assert recipes, f"family {name} has no recipe in recipes/"
        recipe = min(recipes, key=lambda p: ("tiny" not in p.name, p.name))
        rc, out, err = cli(mmtrain_main, capsys, name, recipe, f"run_dir={tmp_path / name}", "--print-config")
        assert rc == 0 and yaml.safe_load(out)["family"] == name, err
        rc, out, err = cli(mmtrain_main, capsys, name, recipe, f"run_dir={tmp_path / name}", "action=dry_run")
        assert rc == 0 and "memory per rank" in out, err


@pytest.mark.unit
def test_train_reads_the_family_from_the_recipe_and_aliases_check_it(tmp_path, capsys):
    """`mmtrain train RECIPE` takes the family from `family:`; `mmtrain FAMILY RECIPE` is the
    same command and refuses a recipe of another family, naming the key."""
    emu3 = REPO / "recipes" / "emu3-tiny.yaml"
    for recipe, family in ((TINY, "llava-ov"), (emu3, "emu3")):
        rc, out, err = cli(mmtrain_main, capsys, "train", recipe, f"run_dir={tmp_path}", "--print-config")
        assert rc == 0 and yaml.safe_load(out)["family"] == family, err
        rc, alias_out, err = cli(mmtrain_main, capsys, family, recipe, f"run_dir={tmp_path}", "--print-config")
        assert rc == 0 and alias_out == out, err
    rc, _, err = cli(mmtrain_main, capsys, "emu3", TINY, "--print-config")
    assert rc == 2 and "Traceback" not in err, err
    assert "  - family: recipe is for 'llava-ov' but was run as `mmtrain emu3`" in err.splitlines(), err


@pytest.mark.unit
def test_every_family_callable_named_by_a_ref_resolves():
    """The specs name their heavy callables "module:function" (mmtrain/spec.py `Ref`): each one
    imports and is callable, so a typo fails here rather than in a run."""
    import dataclasses

    from mmtrain import registry
    from mmtrain.spec import Ref

    refs = []
    for spec in registry.FAMILIES.values():
        for part in (spec, spec.hf, spec.generation):
            if part is not None:
                refs += [v for f in dataclasses.fields(part) if isinstance(v := getattr(part, f.name), Ref)]
    assert len(refs) >= 15
    for ref in refs:
        assert callable(ref.resolve()), ref.target
    with pytest.raises(ValueError, match="module:function"):
        Ref("mmtrain.emu3.model.Emu3Model")


@pytest.mark.unit
def test_overrides_written_with_dashes_get_a_hint(capsys):
    rc, _, err = cli(mmtrain_main, capsys, "llava-ov", TINY, "--train.iters=2")
    assert rc == 2 and "Traceback" not in err
    assert "recipe overrides are written without dashes: train.iters=2" in err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- one error policy


def test_usage_errors_are_one_line_and_write_nothing(tmp_path, capsys, synth_raw_dir):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    pre = ["preprocess", "--no-progress", "--dataset", "infinity-mm", "--input", synth_raw_dir]
    before = listing(tmp_path)
    assert_user_error(*cli(mmdata_main, capsys, *pre, "--output", afile)[::2], f"--output {afile} is a file")
    assert_user_error(
        *cli(mmdata_main, capsys, *pre, "--output", tmp_path / "o", "--num-cpus", "0")[::2],
        "--num-cpus must be a positive number",
    )
    assert_user_error(
        *cli(mmdata_main, capsys, *pre, "--output", foreign)[::2], str(foreign), "notes.txt", "--overwrite"
    )
    assert_user_error(
        *cli(mmdata_main, capsys, "synth", "--output", afile, "--num-samples", "4")[::2], f"--output {afile} is a file"
    )
    assert_user_error(
        *cli(mmdata_main, capsys, "synth", "--output", foreign, "--num-samples", "4")[::2],
        f"--output {foreign} is not empty",
        "--overwrite",
    )
    assert_user_error(*cli(mmdata_main, capsys, "inspect", foreign)[::2], f"{foreign} is not a shards directory")
    assert_user_error(
        *cli(
            mmdata_main,
            capsys,
            "tokenize-images",
            tmp_path,
            "--vision-tokenizer",
            tmp_path,
            "--output",
            tmp_path / "t",
            "--num-cpus",
            "0",
        )[::2],
        "--num-cpus",
    )
    assert_user_error(
        *cli(
            mmtrain_main,
            capsys,
            "convert",
            "hf-to-mcore",
            "--model",
            "llava-ov",
            "--src",
            tmp_path / "missing",
            "--dst",
            tmp_path / "ckpt",
        )[::2],
        "--src",
        "does not exist",
    )
    assert listing(tmp_path) == before and afile.read_text() == "mine"
    # --overwrite: synth replaces only what it writes
    rc, _, err = cli(mmdata_main, capsys, "synth", "--output", foreign, "--num-samples", "4", "--overwrite")
    assert rc == 0 and (foreign / "notes.txt").read_text() == "mine" and any(foreign.glob("stage*/*/*.tar")), err


def test_a_job_that_would_write_no_sample_stops_and_writes_nothing(tmp_path):
    """Every record filtered out: exit 2 with the reasons, no output folder left behind."""
    from mmdata.dev.synth import generate_records, write_infinity_mm

    raw = tmp_path / "raw"
    write_infinity_mm(generate_records(12, seed=3, broken_fraction=0.25, synthetic=True), raw, samples_per_tar=12)
    out = tmp_path / "out"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    options = flags(input=raw, output=out, num_cpus=1, filter="turns>100", max_quarantine_fraction="1.0")
    proc = run_module("mmdata.cli", "preprocess", "--no-progress", "--dataset", "infinity-mm", *options, env=env)
    line = assert_user_error(
        proc.returncode, proc.stderr, "no sample to write", "of 12 records read", "quarantined", "9 filtered"
    )
    assert "nothing was written" in line and not out.exists()


@pytest.mark.unit
def test_unexpected_errors_name_a_log_and_verbose_prints_the_traceback(tmp_path, capsys, monkeypatch):
    from mmdata.errors import run_main

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def boom(args):
        raise RuntimeError("disk on fire")

    assert run_main("mmdata x", argparse.Namespace(verbose=False), boom) == 1
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    (log,) = tmp_path.glob("mmdata-x-error-*.log")
    assert "internal error: RuntimeError: disk on fire" in line and str(log) in line and "--verbose" in line
    assert "Traceback" in log.read_text() and "disk on fire" in log.read_text()
    assert run_main("mmdata x", argparse.Namespace(verbose=True), boom) == 1
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.unit
def test_deferred_interrupt_holds_sigint_until_the_block_ends():
    from mmdata.errors import deferred_interrupt

    reached = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever a library installed
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupt():
                os.kill(os.getpid(), signal.SIGINT)
                reached.append("after the signal")  # still running: the interrupt waits
        assert reached == ["after the signal"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, before)


# ----------------------------------------------------------------------------- no hub access


def test_no_hub_access_for_local_looking_paths(no_network, tmp_path, capsys, shards_dir):
    from mmdata.errors import UserError
    from mmdata.local_tokenizer import load_local_tokenizer

    empty = tmp_path / "empty"
    empty.mkdir()
    for path, words in (
        ("missing", "does not exist"),
        (str(tmp_path / "nope"), "does not exist"),
        ("./missing", "does not exist"),
        ("org/name", "does not exist"),
        (str(empty), "holds no loadable HF tokenizer"),
    ):
        with pytest.raises(UserError, match=words):
            load_local_tokenizer(path, "--tokenizer")
    assert_user_error(
        *cli(mmdata_main, capsys, "inspect", shards_dir, "--tokenizer", "missing")[::2],
        "--tokenizer missing does not exist",
    )
    rc, _, err = cli(
        mmtrain_main,
        capsys,
        "llava-ov",
        TINY,
        f"run_dir={tmp_path / 'run'}",
        f"data.paths=[{shards_dir}]",
        "tokenizer.path=missing",
    )
    assert rc == 2 and f"tokenizer.path: {os.path.abspath('missing')} does not exist" in err and "Traceback" not in err
    assert no_network == []


def test_both_task_encoders_load_their_tokenizer_locally_with_one_error(no_network, tmp_path):
    """The shared encoder constructor loads the tokenizer through `load_local_tokenizer` for
    every family (Emu3's once called transformers directly, which may try the hub)."""
    from mmdata.energon_loaders.emu3.task_encoder import Emu3EncoderConfig, Emu3TaskEncoder
    from mmdata.energon_loaders.llava_ov.task_encoder import LlavaOVEncoderConfig, LlavaOVTaskEncoder
    from mmdata.errors import UserError

    for encoder, config in (
        (LlavaOVTaskEncoder, LlavaOVEncoderConfig(seq_length=64)),
        (Emu3TaskEncoder, Emu3EncoderConfig(seq_length=64)),
    ):
        for path in ("org/name", str(tmp_path / "nope")):
            with pytest.raises(UserError, match=f"tokenizer {path} does not exist"):
                encoder(path, config)
    assert no_network == []


# ----------------------------------------------------------------------------- checks before training


def _fake_checkpoint(run_dir: Path, model_config) -> None:
    """What check_architecture and latest_checkpoint read of a training checkpoint."""
    from mmtrain.config.typed import to_plain

    it = run_dir / "checkpoints" / "iter_0000002"
    it.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("2")
    (it / "trainer_state.json").write_text('{"format": 2, "step": 2}')
    (it / "model_config.yaml").write_text(yaml.safe_dump(to_plain(model_config)))


def test_training_checks_what_it_touches_before_anything_is_written(
    tmp_path, capsys, shards_dir, tokenizer_dir, monkeypatch
):
    from mmtrain.config import load_recipe

    run_dir = tmp_path / "run"
    _fake_checkpoint(run_dir, load_recipe(TINY).model)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(shards_dir, unfinished)
    (unfinished / "manifest.json").unlink()
    (unfinished / ".mmdata-work").mkdir()
    no_meta = tmp_path / "no_meta"
    no_meta.mkdir()
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed
    before = listing(tmp_path)
    rc, out, err = cli(
        mmtrain_main,
        capsys,
        "llava-ov",
        TINY,
        f"run_dir={run_dir}",
        "logging.tensorboard=true",
        f"data.paths=[{shards_dir}, {unfinished}, {no_meta}, {tmp_path / 'missing'}]",
        f"tokenizer.path={tokenizer_dir}",
        "model.llm.hidden_size=128",
        "model.video_token_id=5",
    )
    assert rc == 2 and "Traceback" not in err, err
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    expected = [
        f"data.paths[1]: {unfinished} holds an unfinished `mmdata preprocess` job",
        f"data.paths[2]: {no_meta} is not an energon dataset",
        f"data.paths[3]: {tmp_path / 'missing'} does not exist",
        "model.video_token_id: 5, but the tokenizer",
        "run_dir: ",
        "logging.tensorboard: true, but the `tensorboard` package is not installed",
    ]
    assert len(problems) == len(expected)
    for want, got in zip(expected, problems):
        assert got.startswith(f"  - {want}"), (want, got)
    assert "model.llm.hidden_size is 128 in the recipe but 64 in the checkpoint" in problems[4]
    assert listing(tmp_path) == before  # no config.yaml, metrics or checkpoint written


def test_shuffle_buffer_larger_than_a_workers_share_warns(shards_dir, tokenizer_dir, tmp_path, caplog):
    from mmtrain import registry
    from mmtrain.config import load_recipe
    from mmtrain.runtime.preflight import preflight

    common = [
        f"run_dir={tmp_path}",
        f"data.paths=[{shards_dir}]",
        f"tokenizer.path={tokenizer_dir}",
        "data.num_workers=2",
    ]
    warnings = {}
    for size in (100, 60):
        caplog.clear()
        preflight(load_recipe(TINY, [*common, f"data.shuffle_buffer_size={size}"]), registry.get_family("llava-ov"))
        warnings[size] = [r.getMessage() for r in caplog.records if "shuffle_buffer_size" in r.getMessage()]
    assert warnings[60] == []  # 120 samples / 2 workers: a share of 60 fits
    (message,) = warnings[100]
    assert "data.shuffle_buffer_size 100 exceeds the 60 samples each of the 2 loader workers" in message


def test_an_unfinished_job_folder_is_refused_by_every_reader(shards_dir, tmp_path, capsys):
    from mmdata.readiness import DatasetNotReady

    out = tmp_path / "half"
    shutil.copytree(shards_dir, out)
    (out / "manifest.json").unlink()
    (out / ".mmdata-work").mkdir()
    assert_user_error(*cli(mmdata_main, capsys, "inspect", out)[::2], "unfinished", "rerun the same command")
    assert_user_error(*cli(mmdata_main, capsys, "preview", out)[::2], "unfinished")
    from mmdata.energon_loaders.loader import build_loader

    with pytest.raises(DatasetNotReady, match="unfinished"):
        build_loader(out, task_encoder=None, micro_batch_size=1)


# ----------------------------------------------------------------------------- print_config, paths


def test_print_config_prints_the_resolved_recipe_with_absolute_paths(tmp_path, capsys, monkeypatch):
    from mmtrain.config import load_recipe

    monkeypatch.chdir(tmp_path)
    args = ["llava-ov", TINY, "run_dir=runs/a", "data.paths=[shards]", "tokenizer.path=~/tok", "train.iters=7"]
    rc, out, err = cli(mmtrain_main, capsys, *args, "--print-config")
    assert rc == 0, err
    rc2, out2, _ = cli(mmtrain_main, capsys, *args, "action=print_config")
    assert rc2 == 0 and out2 == out and not (tmp_path / "runs").exists()  # nothing run or written
    printed = yaml.safe_load(out)
    assert printed["action"] == "run" and printed["train"]["iters"] == 7
    assert printed["run_dir"] == str(tmp_path / "runs" / "a") and printed["data"]["paths"] == [str(tmp_path / "shards")]
    assert printed["tokenizer"]["path"] == os.path.expanduser("~/tok")
    saved = tmp_path / "saved.yaml"
    saved.write_text(out)
    expected = load_recipe(TINY, args[2:], family="llava-ov")
    monkeypatch.chdir(REPO)  # from another folder, the same recipe
    assert load_recipe(saved) == expected


# ----------------------------------------------------------------------------- docs agree with code


def _doc_tables(text: str):
    """(section heading, key cell, default cell) of every row of docs/recipes.md's key tables."""
    section = None
    for line in text.splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
        elif section and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            yield section, cells[0], cells[1]


def _doc_value(cell: str):
    cell = cell.strip().strip("`")
    try:
        return float(cell) if re.fullmatch(r"-?\d+(\.\d+)?e-?\d+", cell) else yaml.safe_load(cell)
    except yaml.YAMLError:
        return cell


def _defaults(cls) -> dict:
    """Dotted key -> default of a config dataclass (nested dataclasses flattened)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            out[f.name] = "required"
            continue
        if dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{k}": v for k, v in _defaults(type(value)).items()})
        else:
            out[f.name] = value
    return out


@pytest.mark.unit
def test_documented_recipe_defaults_are_the_schemas():
    from mmtrain import registry
    from mmtrain.config import schema

    sections = {
        "top level": schema.Recipe,
        "`tokenizer`": schema.TokenizerConfig,
        "`train`": schema.TrainConfig,
        "`optimizer`": schema.OptimizerConfig,
        "`parallel`": schema.ParallelConfig,
        "`checkpoint`": schema.CheckpointConfig,
        "`logging`": schema.LoggingConfig,
        "`auto_tune`": schema.AutoTuneConfig,
        "`data`": schema.DataConfig,
    }
    checked = 0
    for heading, key_cell, default_cell in _doc_tables((REPO / "docs" / "recipes.md").read_text()):
        family = next((f for f in registry.family_names() if f"({f}" in heading or f"({f})" in key_cell), None)
        if heading.startswith("`model`"):
            if family is None:
                continue
            cls = registry.get_family(family).model_config_cls
        else:
            name = next((s for s in sections if heading.startswith(s)), None)
            if name is None:
                continue
            cls = registry.get_family(family).data_config_cls if name == "`data`" and family else sections[name]
        defaults = _defaults(cls)
        keys = re.findall(r"`([\w.]+)`", re.sub(r"\(.*?\)", "", key_cell))
        if not keys:  # a row documenting a group of keys in prose, e.g. emu3's `llm.*`
            continue
        prefix = keys[0].rsplit(".", 1)[0] + "." if "." in keys[0] else ""
        keys = [keys[0]] + [k if "." in k or not prefix else prefix + k for k in keys[1:]]
        values = (
            [_doc_value(v) for v in default_cell.split(" / ")]
            if " / " in default_cell
            else [_doc_value(default_cell)] * len(keys)
        )
        for key, doc in zip(keys, values):
            if doc in ("required", "none"):
                continue
            assert key in defaults, f"docs/recipes.md {heading}: `{key}` is not a key of {cls.__name__}"
            want = defaults[key]
            assert doc == want or (isinstance(want, float) and doc == pytest.approx(want)), (
                f"docs/recipes.md {heading}: `{key}` default {default_cell!r}, but {cls.__name__} says {want!r}"
            )
            checked += 1
    assert checked > 60
    from mmdata.energon_loaders.packing import DEFAULT_PACKING_BUFFER

    assert schema.DataConfig.packing_buffer_size == DEFAULT_PACKING_BUFFER  # the loader's own default


# ----------------------------------------------------------------------------- figures and labels


@pytest.mark.unit
def test_one_unit_system_and_plurals():
    from mmdata.preprocess.summary import shards_line
    from mmdata.units import format_bytes, format_duration, plural

    assert format_bytes(3.89e9) == "3.62 GiB" and format_bytes(1536) == "1.5 KiB" and format_bytes(12) == "12 B"
    assert format_bytes(1.3e6) == "1.24 MiB"
    assert plural(1, "shard") == "1 shard" and plural(2, "entry", "entries") == "2 entries"
    assert plural(12000, "sample") == "12,000 samples"
    assert format_duration(42) == "42s" and format_duration(125) == "2:05" and format_duration(3725) == "1:02:05"
    assert shards_line([{"samples": 60}] * 3 + [{"samples": 14}]) == "4 shards of 60 samples (the last 14)"
    assert shards_line([{"samples": 1}]) == "1 shard of 1 sample"


def test_byte_figures_agree_across_commands(shards_dir, capsys):
    """The preprocess summary and inspect print the same bytes the same way; dry_run in GiB."""
    from rich.console import Console

    from mmdata.preprocess.summary import summary_table
    from mmdata.units import format_bytes

    manifest = json.loads((shards_dir / "manifest.json").read_text())
    size = format_bytes(sum(s["bytes"] for s in manifest["shards"]))
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(summary_table(manifest, shards_dir))
    assert size in console.export_text() and " MB" not in console.export_text()
    rc, out, _ = cli(mmdata_main, capsys, "inspect", shards_dir, "--sample", "4")
    assert rc == 0 and size in out
    rc, out, _ = cli(mmtrain_main, capsys, "llava-ov", REPO / "recipes" / "aquila-vl-2b.yaml", "action=dry_run")
    assert rc == 0 and "GiB" in out and not re.search(r"\d (GB|MB)\b", out)


@pytest.mark.unit
def test_progress_rates_count_this_runs_records_since_the_work_began(capsys):
    import time

    from mmdata.shard_job.progress import JobProgress

    prog = JobProgress(enabled=True)
    prog.stage("scan", 10, started=time.perf_counter() - 10.0, base_records=1000)  # 1000 found done
    prog.advance("scan", 2, records=1200)
    info = prog.progress.tasks[0].fields["info"]
    rate = int(re.search(r"\(([\d,]+)/s\)", info).group(1).replace(",", ""))
    assert info.startswith("1,200 records") and 18 <= rate <= 20  # 200 new records in ~10 s, not 1200
    prog.resumed("scan", 6, 8, "input file")
    assert "scan: resumed, 6/8 input files already done" in capsys.readouterr().err


# ----------------------------------------------------------------------------- mmdata preview


def test_preview_shows_a_sample_as_the_model_sees_it(shards_dir, tokenizer_dir, tmp_path, capsys):
    from PIL import Image

    from mmdata.inspect.dataset import open_dataset, read_shard
    from mmdata.inspect.render import draw_anyres_grid
    from mmdata.inspect.stats import load_chat_tokenizer, measure_sample

    ds = open_dataset(shards_dir)
    single = None  # the first single-image sample
    for g in range(ds.total_samples):
        shard, pos = ds.locate(g)
        sample = next(read_shard(shard, [pos]))
        if len(sample.image_names) == 1:
            single = (g, sample)
            break
    g, sample = single
    stats = measure_sample(sample, load_chat_tokenizer(tokenizer_dir))
    png = tmp_path / "tiles.png"
    rc, out, err = cli(
        mmdata_main, capsys, "preview", shards_dir, "--index", g, "--tokenizer", tokenizer_dir, "--tiles-png", png
    )
    assert rc == 0, err
    assert f"sample {sample.key} · id {sample.id}" in out and f"global index {g}" in out
    assert (
        f"tokens: text {stats.text_tokens:,} + image {stats.image_tokens:,} = {stats.total_tokens:,} "
        f"(loss on {stats.loss_tokens:,})"
    ) in out
    im = stats.images[0]
    assert f"{im.width}x{im.height}" in out and f"{im.tiles} tiles, {im.tokens:,} tokens" in out
    answers = [t["value"] for t in sample.conversations if t["from"] == "gpt"]
    loss_text = "".join(re.findall(r"⟦(.*?)⟧", out, flags=re.S))
    assert all(a.strip() in loss_text for a in answers) and f"[image: {im.tokens:,} tokens]" in out
    assert Image.open(png).size == draw_anyres_grid(sample.open_image(0)).size
    rc, out2, _ = cli(mmdata_main, capsys, "preview", shards_dir, "--key", sample.id)  # by original id
    assert rc == 0 and f"sample {sample.key}" in out2 and "pass --tokenizer" in out2
    assert_user_error(
        *cli(mmdata_main, capsys, "preview", shards_dir, "--index", ds.total_samples)[::2],
        f"--index {ds.total_samples} is out of range",
    )


def test_a_private_ray_start_does_not_print_rays_token_auth_notice(tmp_path):
    """Ray turns token authentication on for a new local instance and logs a notice on every start
    when RAY_AUTH_MODE is unset (the other tests set it): mmdata's private instance keeps the
    default without printing the notice, and the job runs (HOME is the test's: Ray writes its token
    under ~/.ray)."""
    from mmdata.dev.synth import generate_records, write_infinity_mm
    from mmdata.ray_job import RAY_AUTH_ENABLED_NOTICE

    raw = tmp_path / "raw"
    write_infinity_mm(generate_records(8, seed=5, synthetic=True), raw, samples_per_tar=8)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["HOME"] = str(tmp_path / "home")
    options = flags(dataset="infinity-mm", input=raw, output=tmp_path / "out", num_cpus=1)
    proc = run_module("mmdata.cli", "preprocess", "--no-progress", *options, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert RAY_AUTH_ENABLED_NOTICE not in proc.stderr and "Token authentication" not in proc.stderr, proc.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    "which,argv,meant",
    [
        ("mmdata", ["inspect", "DIR", "--jsn"], "--json"),
        (
            "mmtrain",
            ["convert", "mcore-to-hf", "--model", "llava-ov", "--src", "a", "--dst", "b", "--overwite"],
            "--overwrite",
        ),
    ],
)
def test_a_flag_typo_gets_a_did_you_mean(which, argv, meant, capsys):
    main = mmdata_main if which == "mmdata" else mmtrain_main
    rc, _, err = cli(main, capsys, *argv)
    assert rc == 2 and f"unrecognized arguments: {argv[-1]} (did you mean {meant}?)" in err, err


@pytest.mark.unit
def test_generate_help_speaks_of_guidance_only_where_there_is_guidance(capsys):
    helps = {family: cli(mmtrain_main, capsys, "generate", family, "--help")[1] for family in ("llava-ov", "emu3")}
    assert "guid" not in helps["llava-ov"].lower() and "cfg" not in helps["llava-ov"].lower()
    assert "--cfg-scale" in helps["emu3"] and "negative row" in " ".join(helps["emu3"].split())
