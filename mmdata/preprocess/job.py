"""The Ray job behind `mmdata preprocess`: its stages, declared for the resumable stage runner
(mmdata/stage_runner.py: output checks, folder lock, resume, progress, Ctrl-C, publishing), which
runs the stage functions of stages.py and curation/dedup.py as Ray tasks.

Stages (each resumable through marker files under `DIR/.mmdata-work/`):
1. scan    - one task per input file: read records, validate them (full image decode), apply the
             filters, give each kept one its seeded shuffle key and spill its compact index row
             into the file's bucket-grouped run (with --dedup also its LSH entries); quarantine
             lines go to a per-file part.
2. dedup   - (--dedup) one task per LSH partition finds near-duplicates, then one task per sort
             bucket keeps each dropped record's best neighbour.
3. sort    - one task per bucket (a contiguous key range): gather that bucket's rows from every
             run, drop duplicates, apply the mix, sort them by key. With an up-sampling --mix,
             a merge task per bucket then adds the repeated copies other buckets sent it.
4. write   - one task per output shard: take its global-rank range out of the sorted buckets,
             fetch the original media bytes by (file, offset, size) and write the tar atomically;
             count its samples' tokens for the length index.
5. finish  - quarantine.jsonl, duplicates.jsonl, lengths.parquet, then energon's .nv-meta
             (published atomically) and manifest.json last: a folder holding the work folder
             and no manifest is unfinished, and readers refuse it (mmdata/readiness.py).

The driver only holds ObjectRefs, per-bucket counts, per-group counts and per-shard results;
rows, hashes and media never pass through it, so its memory does not grow with the number of
records.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import mmdata
from mmdata import shard_format as sf
from mmdata.errors import UserError
from mmdata.local_tokenizer import load_local_tokenizer
from mmdata.preprocess import adapters
from mmdata.preprocess.adapters.base import InputUnit
from mmdata.preprocess.adapters.llava_json import check_image_root
from mmdata.preprocess.curation import dedup
from mmdata.preprocess.curation.filters import FilterError, FilterRule, parse_filters
from mmdata.preprocess.curation.mix import MixError, MixSpec, factors, group_targets, parse_mix
from mmdata.preprocess.curation.terms import unmatched
from mmdata.shard_job.energon_meta import EnergonIndexWriter, ShardLayout
from mmdata.preprocess.length_index import write_length_index
from mmdata.preprocess.lengths import write_counting_tokenizer
from mmdata.shard_job.lengths import LENGTHS_NAME, tokenizer_fingerprint
from mmdata.preprocess.loss_check import DEFAULT_MAX_FRACTION, LossCheck
from mmdata.shard_job.manifest import Counts, fingerprint
from mmdata.shard_job.quarantine import concat_parts
from mmdata.preprocess.rows import ROW_FORMAT
from mmdata.shard_job.shard_writer import ShardResult, shard_work_file
from mmdata.preprocess.shuffle_plan import ShardPlan, default_num_buckets, plan_shards
from mmdata.preprocess.stages import (
    JobSpec,
    bucket_file,
    merge_bucket,
    scan_file,
    scan_unit,
    sort_bucket,
    subset_of,
    write_shard_task,
)
from mmdata.preprocess.summary import summary_table
from mmdata.preprocess.validation import ValidationConfig
from mmdata.ray_job import remove, shard_outputs
from mmdata.stage_runner import Identity, JobRun, RayCluster, ResumableJob, Stage, json_marker, run_job
from mmdata.units import plural

TOOL = "mmdata preprocess"
DEFAULT_TARGET_SHARD_BYTES = 256 << 20
DUPLICATES_NAME = "duplicates.jsonl"
PLAN_GLOB = "pack-plan-*.parquet"  # `mmdata pack-plan` outputs: stale once the shards change
PARTIAL_SHARD_GLOB = ".shard-*.tar.tmp-*"  # a shard writer's temp file (shard_writer.write_shard)


class PreprocessError(UserError):
    """A problem with the job's inputs/outputs that the user must fix (printed, exit 2)."""


@dataclass
class PreprocessConfig:
    dataset: str
    inputs: list[Path]
    output: Path
    seed: int = 0
    samples_per_shard: int | None = None  # None: sized for ~target_shard_bytes per shard
    image_root: Path | None = None
    address: str | None = None
    num_cpus: int | None = None
    overwrite: bool = False
    num_buckets: int | None = None  # None: derived from input size (never from the worker count)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    target_shard_bytes: int = DEFAULT_TARGET_SHARD_BYTES
    progress: bool = True
    keep_work_dir: bool = False
    # Stop when one quarantine reason takes more than this share of the first records (1.0: never).
    # Not part of the fingerprint: it never changes the output, and a rerun that relaxes it
    # continues the stopped job.
    max_quarantine_fraction: float = DEFAULT_MAX_FRACTION
    # Curation (docs/preprocess.md "Curation"): --filter EXPR..., --dedup phash[:D],
    # --dedup-scope record|image, --mix FILE.yaml|source=weight,...
    filters: list[str] = field(default_factory=list)
    dedup: str | None = None
    dedup_scope: str = "record"
    mix: str | None = None
    tokenizer: Path | None = None  # exact text tokens in the length index (else an estimate)
    length_index: bool = True  # write lengths.parquet (--no-length-index: skip its token counting)


@dataclass(frozen=True)
class Curation:
    """The curation options, parsed and checked before any work starts."""

    filters: tuple[FilterRule, ...] = ()
    dedup_distance: int | None = None
    dedup_scope: str = "record"
    mix: MixSpec | None = None
    tokenizer_sha256: str | None = None

    def to_json(self) -> dict:
        return {
            "filters": [r.expr for r in self.filters],
            "dedup": None
            if self.dedup_distance is None
            else {
                "method": "phash",
                "distance": self.dedup_distance,
                "scope": self.dedup_scope,
                "bands": len(dedup.band_masks(self.dedup_distance)),
            },
            "mix": self.mix.to_json() if self.mix else None,
        }


def parse_curation(cfg: PreprocessConfig) -> Curation:
    """All curation flags checked up front: a malformed one is exit 2 before any work."""
    try:
        rules = tuple(parse_filters(list(cfg.filters)))
        distance = dedup.parse_dedup(cfg.dedup) if cfg.dedup else None
        if cfg.dedup_scope not in dedup.SCOPES:
            raise ValueError(f"--dedup-scope must be one of {dedup.SCOPES}")
        mix = parse_mix(cfg.mix) if cfg.mix else None
        tok = tokenizer_fingerprint(cfg.tokenizer) if cfg.tokenizer else None
    except (FilterError, MixError, ValueError, FileNotFoundError) as e:
        raise PreprocessError(str(e)) from None
    if cfg.tokenizer:  # loadable here, not only in the scan tasks
        load_local_tokenizer(cfg.tokenizer, "--tokenizer")
    return Curation(rules, distance, cfg.dedup_scope, mix, tok)


# ----------------------------------------------------------------------------- driver


def _job_description(cfg: PreprocessConfig, cur: Curation, units: list[InputUnit]) -> dict:
    """Everything the output depends on: its fingerprint is the job's identity, and a refusal
    names the entries that differ (the manifest keeps it as `job`, `inputs` apart)."""
    inputs = [{"path": u.path, "rel": u.rel, "size": u.size, "mtime_ns": u.mtime_ns} for u in units]
    return {
        "format_version": sf.FORMAT_VERSION,
        "dataset": cfg.dataset,
        "inputs": inputs,
        "seed": cfg.seed,
        "samples_per_shard": cfg.samples_per_shard,
        "target_shard_bytes": cfg.target_shard_bytes,
        "image_root": str(cfg.image_root) if cfg.image_root else None,
        "validation": asdict(cfg.validation),
        "curation": cur.to_json(),
        "tokenizer": cur.tokenizer_sha256,
        "length_index": cfg.length_index,
    }


def _manifest_job(manifest: dict) -> dict | None:
    return {**manifest["job"], "inputs": manifest.get("inputs")} if isinstance(manifest.get("job"), dict) else None


def _our_outputs(out: Path) -> list[Path]:
    extra = [out / n for n in (DUPLICATES_NAME, LENGTHS_NAME) if (out / n).exists()]
    return shard_outputs(out) + extra + sorted(out.glob(PLAN_GLOB))


def _index_shard(index: EnergonIndexWriter, work: Path, name: str) -> None:
    index.add(name, ShardLayout.from_json(shard_work_file(work, name, "layout.json").read_text()))


def _finish_outputs(
    out: Path,
    work: Path,
    units: list[InputUnit],
    shards: list[ShardResult],
    num_buckets: int,
    dedup: bool,
    text_tokens: str | None,
    index: EnergonIndexWriter,
    indexed: list[Future],
) -> str | None:
    """quarantine.jsonl, duplicates.jsonl, the length index (returns its sha256; None:
    `text_tokens` None, no index), then energon's index, whose shards were added as they were
    written (`indexed`), published atomically: with the manifest after it, it is what says
    "finished"."""
    for f in indexed:
        f.result()  # (done: the same single thread ran them first) re-raises an indexing error
    names = [s.name for s in shards]
    # every shard is in place: a partial file of a killed (and retried) writer is now garbage
    remove(list(out.glob(PARTIAL_SHARD_GLOB)))
    concat_parts([scan_file(work, u.index, "quarantine.jsonl") for u in units], out / sf.QUARANTINE_NAME)
    if dedup:
        concat_parts([bucket_file(work, b, "duplicates.jsonl") for b in range(num_buckets)], out / DUPLICATES_NAME)
    lengths_sha = None
    if text_tokens is not None:
        firsts = np.cumsum([0] + [s.samples for s in shards])
        lengths_sha = write_length_index(
            out, [(int(f), shard_work_file(work, n, "lengths")) for f, n in zip(firsts, names)], text_tokens
        )
    index.finish()
    return lengths_sha


def _nothing_to_write(counts: Counts, files: int) -> str:
    """Why a job that would write 0 samples stops (nothing is written)."""
    c = counts.to_json()
    if c["read"] == 0:
        return f"no record to write: 0 records read from {plural(files, 'input file')}"
    why = (
        [
            f"{c['quarantined']:,} quarantined ("
            + ", ".join(f"{r} {n:,}" for r, n in sorted(c["by_reason"].items(), key=lambda kv: -kv[1])[:3])
            + ")"
        ]
        if c["quarantined"]
        else []
    )
    why += [f"{c[k]:,} {k.replace('_', ' ')}" for k in ("filtered", "duplicates", "mixed_out") if c.get(k)]
    return (
        f"no sample to write: of {plural(c['read'], 'record')} read, {', '.join(why)}; nothing was written. "
        "Check --dataset, --image-root and the curation flags"
    )


def auto_samples_per_shard(valid_bytes: int, records: int, target_bytes: int) -> int:
    """Samples per shard for ~target_bytes shards, from the kept records' average size."""
    if records == 0:
        return 1
    per_sample = valid_bytes / records + 2048  # tar headers + padding
    return int(max(1, min(1_000_000, round(target_bytes / per_sample))))


def _mix_plan(spec: MixSpec, available: dict[str, int]) -> tuple[dict[str, int], dict[str, float]]:
    """(targets, factors) per mix group; listed groups absent from the data count as 0."""
    groups = {**{g: 0 for g, _ in spec.weights if g != "*"}, **available}
    targets = group_targets(spec, groups)
    return targets, factors(targets, groups)


def unmatched_terms(cfg: PreprocessConfig, cur: Curation, kind: str, known: set[str]) -> str | None:
    """The error for --mix weights and --filter values on `kind` (source or subset) that name
    nothing in the input (they would drop its records silently); None when all match."""
    problems = []
    if cur.mix is not None and cur.mix.by == kind and (bad := [g for g in cur.mix.listed() if g not in known]):
        problems.append(unmatched(f"--mix {cfg.mix!r}", kind, bad, known))
    for rule in cur.filters:
        if rule.field == kind and (bad := [v for v in rule.values() if v not in known]):
            problems.append(unmatched(f"--filter {rule.expr!r}", kind, bad, known))
    return "; ".join(problems) or None


# ----------------------------------------------------------------------------- the job


def run_preprocess(cfg: PreprocessConfig) -> dict:
    """Run the whole job (mmdata/stage_runner.py); returns the manifest. Raises PreprocessError on
    user errors, and Interrupted (after shutting Ray down) on Ctrl-C: a rerun of the same job resumes it."""
    return run_job(PreprocessJob(cfg))


class PreprocessJob(ResumableJob):
    """`mmdata preprocess` as the runner's stages: scan, (dedup find, dedup resolve), sort,
    (merge repeats), write shards; then the finish step and the manifest."""

    tool = TOOL
    error = PreprocessError
    work_dirs = ("scan", "sorted", "dedup", "shards")
    settings_dirs = ("scan", "sorted", "dedup")  # (shards depend on neither bucket count nor row encoding)

    def __init__(self, cfg: PreprocessConfig):
        self.options = self.cfg = cfg
        self.counts = Counts()
        self.groups: Counter[str] = Counter()  # kept records per mix group, after the filters
        self.phash: Counter[str] = Counter()
        self.dropped_by_group: Counter[str] = Counter()
        self.realised: dict[str, Counter] = {}  # per mix group: kept / repeated / mixed_out
        self.mix_report: dict | None = None
        self.written = 0  # samples in the shards written so far
        self.indexed: list[Future] = []  # shards handed to the energon index, in shard order
        self.lengths_sha: str | None = None

    def positive_flags(self) -> dict[str, float | None]:
        return {"--samples-per-shard": self.cfg.samples_per_shard, "--num-buckets": self.cfg.num_buckets}

    def check(self) -> None:
        cfg = self.cfg
        if cfg.dataset not in adapters.DATASETS:
            raise PreprocessError(f"unknown --dataset {cfg.dataset!r}; expected one of {adapters.DATASETS}")
        self.cur = parse_curation(cfg)
        try:
            units = adapters.list_units(cfg.dataset, [Path(p) for p in cfg.inputs], cfg.image_root)
        except FileNotFoundError as e:
            raise PreprocessError(str(e)) from None
        if not units:
            raise PreprocessError(f"no {cfg.dataset} input files found under {', '.join(map(str, cfg.inputs))}")
        out = Path(cfg.output).resolve()
        # Never read our own output back as input (e.g. --output inside an --input folder).
        kept = [u for u in units if not Path(u.path).is_relative_to(out)]
        self.units = [dataclasses.replace(u, index=i) for i, u in enumerate(kept)]
        if not self.units:
            raise PreprocessError(f"no {cfg.dataset} input files found outside the output folder {out}")
        if cfg.dataset == "llava-json" and (problem := check_image_root(self.units)):
            raise PreprocessError(problem)
        if problem := unmatched_terms(cfg, self.cur, "subset", {subset_of(u) for u in self.units}):
            raise PreprocessError(problem)  # subsets are the input folders: known before any work

    def identity(self, ray: RayCluster) -> Identity:
        self.num_buckets = self.cfg.num_buckets or default_num_buckets(sum(u.size for u in self.units))
        self.job = _job_description(self.cfg, self.cur, self.units)
        return Identity(self.job, {"num_buckets": self.num_buckets, "row_format": ROW_FORMAT})

    def own_outputs(self, out: Path) -> list[Path]:
        return _our_outputs(out)

    def saved_job(self, manifest: dict) -> dict | None:
        return _manifest_job(manifest)

    def stages(self, run: JobRun) -> Iterator[Stage]:
        cfg, cur, units, work, nb = self.cfg, self.cur, self.units, run.work, self.num_buckets
        spec = self.spec = JobSpec(
            cfg.dataset,
            cfg.seed,
            nb,
            cfg.validation,
            str(work),
            cur.filters,
            cur.dedup_distance,
            cur.dedup_scope,
            cur.mix.by if cur.mix else None,
            write_counting_tokenizer(cfg.tokenizer, work) if cfg.tokenizer else None,
            cfg.length_index,
        )
        self.loss = LossCheck(len(units), cfg.max_quarantine_fraction, lambda i: scan_file(work, i, "quarantine.jsonl"))
        scan, find, resolve, sort, merge, write = (
            run.remote(f)
            for f in (
                scan_unit,
                dedup.dedup_partition,
                dedup.resolve_bucket,
                sort_bucket,
                merge_bucket,
                write_shard_task,
            )
        )
        buckets = list(range(nb))
        # 1. scan + validate
        yield Stage(
            "scan+validate",
            "scan",
            "scan_s",
            units,
            submit=lambda u: scan.remote(u, spec),
            recorded=json_marker(lambda u: scan_file(work, u.index, "done.json")),
            on_result=self._scanned,
            noun="input file",
            records=lambda: self.counts.read,
        )
        self.candidates, self.candidate_bytes = self.counts.written, self.counts.valid_bytes
        # sources are the records' own field: known once every file is scanned, before any output
        if problem := unmatched_terms(cfg, cur, "source", set(self.counts.by_source)):
            run.refuse(problem)
        # 2. near-duplicates: candidates per LSH partition, then each dropped record's best neighbour
        if spec.dedup:
            yield Stage(
                "dedup: find",
                "dedup_find",
                "dedup_s",
                buckets,
                submit=lambda p: find.remote(p, len(units), nb, spec.dedup_distance, str(work)),
                recorded=json_marker(lambda p: dedup.partition_marker(work, p)),
            )
            yield Stage(
                "dedup: resolve",
                "dedup_resolve",
                "dedup_s",
                buckets,
                submit=lambda b: resolve.remote(b, nb, str(work)),
                recorded=json_marker(lambda b: dedup.resolve_marker(work, b)),
                on_result=lambda b, r: self.dropped_by_group.update(r["by_group"]),
            )
        # 3. sort buckets (dedup applied, mix factors from the groups' counts after dedup)
        mix_factors, spill = self._mix_factors()
        self.bucket_counts = [0] * nb
        yield Stage(
            "sort buckets",
            "sort",
            "sort_s",
            buckets,
            submit=lambda b: sort.remote(b, len(units), spec, mix_factors, spill),
            recorded=json_marker(lambda b: bucket_file(work, b, "done.json")),
            on_result=self._sorted,
        )
        if spill:  # repeated copies landed in other buckets: add them there
            yield Stage(
                "merge repeats",
                "merge",
                "sort_s",
                buckets,
                submit=lambda b: merge.remote(b, spec),
                recorded=json_marker(lambda b: bucket_file(work, b, "merged.json")),
                on_result=self._merged,
            )
        if sum(self.bucket_counts) != self.counts.written or not self.counts.reconciles():
            raise RuntimeError(
                f"internal: buckets hold {sum(self.bucket_counts)} rows, counts say {self.counts.to_json()}"
            )
        if sum(self.bucket_counts) == 0:  # leave nothing behind
            run.refuse(_nothing_to_write(self.counts, len(units)))
        if self.mix_report is not None:
            self.mix_report["realised"] = {
                g: self.realised.get(g, Counter())["kept"] + self.realised.get(g, Counter())["repeated"]
                for g in self.mix_report["target"]
            }
        # 4. write shards; each is indexed (on the runner's background thread) once it and all before it are written
        self.sps = cfg.samples_per_shard or auto_samples_per_shard(
            self.candidate_bytes, self.candidates, cfg.target_shard_bytes
        )
        plans = plan_shards(self.bucket_counts, self.sps)
        self.results: list[dict | None] = [None] * len(plans)
        self.index = EnergonIndexWriter(run.out)
        yield Stage(
            "write shards",
            "shards",
            "write_s",
            plans,
            submit=lambda p: write.remote(p, spec, str(run.out), spill),
            on_result=lambda p, r: self._wrote(run, p, r),
            noun="shard",
            records=lambda: self.written,
            record_noun="samples",
        )

    # ------------------------------------------------------------------ stage results

    def _scanned(self, unit: InputUnit, result: dict) -> None:
        self.counts.merge(result)
        self.groups.update(result.get("groups", {}))
        self.phash.update(result.get("phash", {}))
        self.loss.add(unit.index, result)

    def _mix_factors(self) -> tuple[dict[str, float] | None, bool]:
        """The mix factor per group (None: no --mix), and whether any repeats records."""
        if self.cur.mix is None:
            return None, False
        groups, dropped = self.groups, self.dropped_by_group
        by_key = {f"{dedup.key64(g):016x}": g for g in groups}
        available = {g: n - dropped.get(f"{dedup.key64(g):016x}", 0) for g, n in groups.items()}
        if set(dropped) - set(by_key):
            raise RuntimeError("internal: duplicates counted for a mix group no scan saw")
        targets, mix_factors = _mix_plan(self.cur.mix, available)
        self.mix_report = {
            "available": {g: available.get(g, 0) for g in targets},
            "target": targets,
            "factor": {g: round(f, 6) for g, f in mix_factors.items()},
        }
        return mix_factors, any(f > 1 for f in mix_factors.values())

    def _sorted(self, bucket: int, result: dict) -> None:
        self.bucket_counts[bucket] = result["count"]
        self.counts.add_curation(result["curation"])
        for g, c in result["mix"].items():
            self.realised.setdefault(g, Counter()).update(c)

    def _merged(self, bucket: int, result: dict) -> None:
        self.bucket_counts[bucket] = result["count"]

    def _wrote(self, run: JobRun, plan: ShardPlan, result: dict) -> None:
        self.results[plan.index] = result
        while len(self.indexed) < len(self.results) and (done := self.results[len(self.indexed)]) is not None:
            self.indexed.append(run.background.submit(_index_shard, self.index, run.work, done["name"]))
        self.written += result["samples"]

    # ------------------------------------------------------------------ finish and manifest

    def finish(self, run: JobRun) -> None:
        self.shards = [ShardResult(r["name"], r["samples"], r["bytes"], r["sha256"]) for r in self.results]  # type: ignore[index]
        self.text_tokens = None if not self.spec.lengths else "tokenizer" if self.spec.tokenizer else "estimate"
        self.lengths_sha = _finish_outputs(
            run.out,
            run.work,
            self.units,
            self.shards,
            self.num_buckets,
            self.spec.dedup,
            self.text_tokens,
            self.index,
            self.indexed,
        )

    def manifest(self, run: JobRun) -> dict:
        cfg, cur, job = self.cfg, self.cur, self.job
        curation = cur.to_json()
        if curation["dedup"] is not None:
            curation["dedup"]["phash_images"] = {
                "from_field": self.phash["from_field"],
                "computed": self.phash["computed"],
            }
        if self.mix_report is not None:
            curation["mix"] = {**curation["mix"], **self.mix_report}
        return {
            "tool": TOOL,
            "version": mmdata.__version__,
            "format_version": sf.FORMAT_VERSION,
            "fingerprint": fingerprint(job),
            "dataset": cfg.dataset,
            "seed": cfg.seed,
            "samples_per_shard": self.sps,
            "options": {
                "image_root": str(cfg.image_root) if cfg.image_root else None,
                "validation": asdict(cfg.validation),
                "target_shard_bytes": cfg.target_shard_bytes,
            },
            "inputs": job["inputs"],
            "job": {k: v for k, v in job.items() if k != "inputs"},
            "counts": self.counts.to_json(),
            "curation": curation,
            "shards": [asdict(s) for s in self.shards],
            "length_index": None
            if self.lengths_sha is None
            else {
                "file": LENGTHS_NAME,
                "sha256": self.lengths_sha,
                "text_tokens": self.text_tokens,
                "tokenizer_sha256": cur.tokenizer_sha256,
            },
            "energon": {
                "sample_type": "mmdata.energon_loaders.sample.ConversationSample",
                "split": {"train": len(self.shards)},
            },
            "wall_time_s": run.wall_time_s(),
            "run": {
                "output": str(run.out),
                "num_buckets": self.num_buckets,
                "resumed": run.resumed,
                "phases": run.phases,
                "task_cpu_s": run.task_cpu_s,
                "task_nodes": dict(sorted(run.task_nodes.items())),
                "tokenizer": str(Path(cfg.tokenizer).resolve()) if cfg.tokenizer else None,
                "ray_address": cfg.address or os.environ.get("RAY_ADDRESS") or "local",
            },
        }

    def summary(self, manifest: dict, out: Path):
        return summary_table(manifest, out)
