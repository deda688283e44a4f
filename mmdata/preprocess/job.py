"""The Ray job behind `mmdata preprocess` (the driver; the stage functions are in stages.py and
curation/dedup.py).

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
import functools
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import mmdata
from mmdata import shard_format as sf
from mmdata.errors import UserError, deferred_interrupt
from mmdata.preprocess import adapters
from mmdata.preprocess.adapters.base import InputUnit
from mmdata.preprocess.adapters.llava_json import check_image_root
from mmdata.preprocess.curation import dedup as dd
from mmdata.preprocess.curation.filters import FilterError, FilterRule, parse_filters
from mmdata.preprocess.curation.mix import MixError, MixSpec, factors, group_targets, parse_mix
from mmdata.preprocess.curation.terms import unmatched
from mmdata.preprocess.energon_meta import NV_META, EnergonIndexWriter, ShardLayout
from mmdata.preprocess.lengths import LENGTHS_NAME, tokenizer_fingerprint, write_counting_tokenizer, write_length_index
from mmdata.preprocess.loss_check import DEFAULT_MAX_FRACTION, LossCheck, SystematicLoss
from mmdata.preprocess.manifest import Counts, fingerprint, write_json_atomic
from mmdata.preprocess.quarantine import concat_parts
from mmdata.preprocess.rows import ROW_FORMAT
from mmdata.preprocess.shard_writer import ShardResult
from mmdata.preprocess.shuffle_plan import ShardPlan, default_num_buckets, plan_shards
from mmdata.preprocess.stages import (JobSpec, bucket_file, merge_bucket, scan_file, scan_unit, shard_work_file,
                                      sort_bucket, subset_of, write_shard_task)
from mmdata.preprocess.validation import ValidationConfig
from mmdata.ray_job import (check_output_dir, discard, init_ray, remove, resumable, run_bounded, shard_outputs,
                             shutdown_ray)
from mmdata.units import plural

WORK_DIR_NAME = sf.WORK_DIR_NAME
TOOL = "mmdata preprocess"
DEFAULT_TARGET_SHARD_BYTES = 256 << 20
DUPLICATES_NAME = "duplicates.jsonl"
PLAN_GLOB = "pack-plan-*.parquet"  # `mmdata pack-plan` outputs: stale once the shards change
NODE_KEY = "_ray_node"  # in a task's result: the node that ran it
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
        return {"filters": [r.expr for r in self.filters],
                "dedup": None if self.dedup_distance is None else {
                    "method": "phash", "distance": self.dedup_distance, "scope": self.dedup_scope,
                    "bands": len(dd.band_masks(self.dedup_distance))},
                "mix": self.mix.to_json() if self.mix else None}


def parse_curation(cfg: PreprocessConfig) -> Curation:
    """All curation flags checked up front: a malformed one is exit 2 before any work."""
    try:
        rules = tuple(parse_filters(list(cfg.filters)))
        distance = dd.parse_dedup(cfg.dedup) if cfg.dedup else None
        if cfg.dedup_scope not in dd.SCOPES:
            raise ValueError(f"--dedup-scope must be one of {dd.SCOPES}")
        mix = parse_mix(cfg.mix) if cfg.mix else None
        tok = tokenizer_fingerprint(cfg.tokenizer) if cfg.tokenizer else None
    except (FilterError, MixError, ValueError, FileNotFoundError) as e:
        raise PreprocessError(str(e)) from None
    if cfg.tokenizer:  # loadable here, not only in the scan tasks
        from mmdata.local_tokenizer import load_local_tokenizer

        load_local_tokenizer(cfg.tokenizer, "--tokenizer")
    return Curation(rules, distance, cfg.dedup_scope, mix, tok)


# ----------------------------------------------------------------------------- driver


def _job_description(cfg: PreprocessConfig, cur: Curation, units: list[InputUnit]) -> dict:
    """Everything the output depends on: its fingerprint is the job's identity, and a refusal
    names the entries that differ (the manifest keeps it as `job`, `inputs` apart)."""
    inputs = [{"path": u.path, "rel": u.rel, "size": u.size, "mtime_ns": u.mtime_ns} for u in units]
    return {
        "format_version": sf.FORMAT_VERSION, "dataset": cfg.dataset, "inputs": inputs, "seed": cfg.seed,
        "samples_per_shard": cfg.samples_per_shard, "target_shard_bytes": cfg.target_shard_bytes,
        "image_root": str(cfg.image_root) if cfg.image_root else None, "validation": asdict(cfg.validation),
        "curation": cur.to_json(), "tokenizer": cur.tokenizer_sha256, "length_index": cfg.length_index,
    }


def _manifest_job(manifest: dict) -> dict | None:
    return {**manifest["job"], "inputs": manifest.get("inputs")} if isinstance(manifest.get("job"), dict) else None


def _our_outputs(out: Path) -> list[Path]:
    extra = [out / n for n in (DUPLICATES_NAME, LENGTHS_NAME) if (out / n).exists()]
    return shard_outputs(out) + extra + sorted(out.glob(PLAN_GLOB))


def _prepare_work_dir(out: Path, fp: str, num_buckets: int, job: dict) -> Path:
    work = out / WORK_DIR_NAME
    wj = work / "work.json"
    state = {"fingerprint": fp, "num_buckets": num_buckets, "row_format": ROW_FORMAT, "tool": TOOL, "job": job}
    if wj.exists() and any(json.loads(wj.read_text()).get(k) != state[k] for k in ("num_buckets", "row_format")):
        # Shards do not depend on the bucket count or the row encoding; only the intermediate runs do.
        remove([work / "scan", work / "sorted", work / "dedup"])
    for d in ("scan", "sorted", "dedup", "shards"):
        (work / d).mkdir(parents=True, exist_ok=True)
    stale = list(work.rglob(".*.tmp-*")) + list(out.glob(PARTIAL_SHARD_GLOB)) + list(out.glob("shard-*.tar.idx.tmp"))
    remove(stale + list(out.glob(f"{NV_META}.tmp-*")))
    write_json_atomic(wj, state)
    return work


def _index_shard(index: EnergonIndexWriter, work: Path, name: str) -> None:
    index.add(name, ShardLayout.from_json(shard_work_file(work, name, "layout.json").read_text()))


def _finish_outputs(out: Path, work: Path, units: list[InputUnit], shards: list[ShardResult], num_buckets: int,
                    dedup: bool, text_tokens: str | None, index: EnergonIndexWriter, indexed: list[Future]) -> str | None:
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
            out, [(int(f), shard_work_file(work, n, "lengths")) for f, n in zip(firsts, names)], text_tokens)
    index.finish()
    return lengths_sha


def _nothing_to_write(counts: Counts, files: int) -> str:
    """Why a job that would write 0 samples stops (nothing is written)."""
    c = counts.to_json()
    if c["read"] == 0:
        return f"no record to write: 0 records read from {plural(files, 'input file')}"
    why = [f"{c['quarantined']:,} quarantined ("
           + ", ".join(f"{r} {n:,}" for r, n in sorted(c["by_reason"].items(), key=lambda kv: -kv[1])[:3]) + ")"
           ] if c["quarantined"] else []
    why += [f"{c[k]:,} {k.replace('_', ' ')}" for k in ("filtered", "duplicates", "mixed_out") if c.get(k)]
    return (f"no sample to write: of {plural(c['read'], 'record')} read, {', '.join(why)}; nothing was written. "
            "Check --dataset, --image-root and the curation flags")


def auto_samples_per_shard(valid_bytes: int, records: int, target_bytes: int) -> int:
    """Samples per shard for ~target_bytes shards, from the kept records' average size."""
    if records == 0:
        return 1
    per_sample = valid_bytes / records + 2048  # tar headers + padding
    return int(max(1, min(1_000_000, round(target_bytes / per_sample))))


def _reporting_node(task: Callable[..., dict]) -> Callable[..., dict]:
    """`task` as a Ray task whose result also says which node ran it (NODE_KEY; the driver
    takes it out and counts tasks per node: the manifest's `run.task_nodes`)."""

    @functools.wraps(task)
    def run(*args, **kwargs) -> dict:
        import ray

        return {**task(*args, **kwargs), NODE_KEY: ray.get_runtime_context().get_node_id()}

    return run


def _run_resumable(prog, name: str, key: str, items: list, marker: Callable[[object], Path],
                   submit: Callable[[object], object], on_result: Callable[[object, dict], None], resumed: Counter,
                   max_in_flight: int, task_nodes: Counter) -> None:
    """One stage of tasks that each leave a JSON done-marker (equal to their return value):
    finished items are taken from their markers (counted in resumed[key]), the rest run on Ray."""
    prog.stage(name, len(items))
    todo = []
    for item in items:
        path = marker(item)
        if path.exists():
            on_result(item, json.loads(path.read_text()))
            resumed[key] += 1
            prog.advance(name)
        else:
            todo.append(item)

    def done(item, result: dict) -> None:
        task_nodes[result.pop(NODE_KEY)] += 1
        on_result(item, result)
        prog.advance(name)

    prog.resumed(name, resumed[key], len(items), "task")
    run_bounded(submit, todo, max_in_flight, done)


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


@resumable
def run_preprocess(cfg: PreprocessConfig) -> dict:
    """Run the whole job; returns the manifest. Raises PreprocessError on user errors, and
    Interrupted (after shutting Ray down) on Ctrl-C: a rerun of the same job resumes it."""
    from mmdata.preprocess.progress import JobProgress, summary_table

    t_start = time.perf_counter()
    if cfg.dataset not in adapters.DATASETS:
        raise PreprocessError(f"unknown --dataset {cfg.dataset!r}; expected one of {adapters.DATASETS}")
    for flag, value in (("--samples-per-shard", cfg.samples_per_shard), ("--num-cpus", cfg.num_cpus),
                        ("--num-buckets", cfg.num_buckets)):
        if value is not None and value <= 0:
            raise PreprocessError(f"{flag} must be a positive number, got {value}")
    cur = parse_curation(cfg)
    try:
        units = adapters.list_units(cfg.dataset, [Path(p) for p in cfg.inputs], cfg.image_root)
    except FileNotFoundError as e:
        raise PreprocessError(str(e)) from None
    if not units:
        raise PreprocessError(f"no {cfg.dataset} input files found under {', '.join(map(str, cfg.inputs))}")
    out = Path(cfg.output).resolve()
    # Never read our own output back as input (e.g. --output inside an --input folder).
    kept = [u for u in units if not Path(u.path).is_relative_to(out)]
    units = [dataclasses.replace(u, index=i) for i, u in enumerate(kept)]
    if not units:
        raise PreprocessError(f"no {cfg.dataset} input files found outside the output folder {out}")
    if cfg.dataset == "llava-json" and (problem := check_image_root(units)):
        raise PreprocessError(problem)
    if problem := unmatched_terms(cfg, cur, "subset", {subset_of(u) for u in units}):
        raise PreprocessError(problem)  # subsets are the input folders: known before any work
    job = _job_description(cfg, cur, units)
    fp, inputs = fingerprint(job), job["inputs"]
    done_manifest = check_output_dir(out, fp, job, cfg.overwrite, _our_outputs, PreprocessError, _manifest_job)
    if done_manifest is not None:
        print(f"{out}: already complete for these inputs and options; nothing to do", file=sys.stderr)
        if not cfg.keep_work_dir:  # killed between writing the manifest and cleaning up
            shutil.rmtree(out / WORK_DIR_NAME, ignore_errors=True)
        return done_manifest
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    num_buckets = cfg.num_buckets or default_num_buckets(sum(u.size for u in units))
    work = _prepare_work_dir(out, fp, num_buckets, job)
    spec = JobSpec(cfg.dataset, cfg.seed, num_buckets, cfg.validation, str(work), cur.filters, cur.dedup_distance,
                   cur.dedup_scope, cur.mix.by if cur.mix else None,
                   write_counting_tokenizer(cfg.tokenizer, work) if cfg.tokenizer else None, cfg.length_index)
    phases: dict[str, float] = {}
    t_phase = time.perf_counter()

    def phase_done(name: str) -> None:
        nonlocal t_phase
        now = time.perf_counter()
        phases[name] = round(now - t_phase, 3)
        t_phase = now

    resumed: Counter[str] = Counter(scan=0, sort=0, shards=0)
    task_nodes: Counter[str] = Counter()  # Ray tasks run per node id
    counts = Counts()
    groups: Counter[str] = Counter()  # kept records per mix group, after the filters
    phash: Counter[str] = Counter()
    loss = LossCheck(len(units), cfg.max_quarantine_fraction, lambda i: scan_file(work, i, "quarantine.jsonl"))

    def add_scan(unit: InputUnit, result: dict) -> None:
        counts.merge(result)
        groups.update(result.get("groups", {}))
        phash.update(result.get("phash", {}))
        loss.add(unit.index, result)

    todo = []
    try:
        for u in units:
            marker = scan_file(work, u.index, "done.json")
            if marker.exists():
                add_scan(u, json.loads(marker.read_text()))
                resumed["scan"] += 1
            else:
                todo.append(u)
    except SystematicLoss as e:
        raise PreprocessError(str(e)) from None
    resumed_records = counts.read
    import ray

    own_ray = init_ray(cfg.address, cfg.num_cpus)
    phase_done("ray_init_s")
    mix_report: dict | None = None
    # One thread indexes the written shards for energon (in shard order, as they finish), then
    # runs the finish step while Ray shuts down.
    finishing = ThreadPoolExecutor(1, thread_name_prefix="mmdata-finish")
    index, indexed = EnergonIndexWriter(out), []
    finish_submitted = False
    try:
        # SPREAD: tasks go round the nodes (each reads and writes the shared file system), rather
        # than filling the driver's node first; on one node it changes nothing.
        remote = {f.__name__: ray.remote(num_cpus=1, scheduling_strategy="SPREAD")(_reporting_node(f))
                  for f in (scan_unit, dd.dedup_partition, dd.resolve_bucket, sort_bucket, merge_bucket,
                            write_shard_task)}
        max_in_flight = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        with JobProgress(cfg.progress) as prog:
            # 1. scan + validate
            prog.stage("scan+validate", len(units), base_records=resumed_records)
            prog.resumed("scan+validate", resumed["scan"], len(units), "input file")
            prog.advance("scan+validate", resumed["scan"], records=counts.read)

            def scanned(unit: InputUnit, result: dict) -> None:
                add_scan(unit, result)
                prog.advance("scan+validate", records=counts.read)

            def scanned_by_ray(unit: InputUnit, result: dict) -> None:
                task_nodes[result.pop(NODE_KEY)] += 1
                scanned(unit, result)

            run_bounded(lambda u: remote["scan_unit"].remote(u, spec), todo, max_in_flight, scanned_by_ray)
            candidates, candidate_bytes = counts.written, counts.valid_bytes
            phase_done("scan_s")
            # sources are the records' own field: known once every file is scanned, before any output
            if problem := unmatched_terms(cfg, cur, "source", set(counts.by_source)):
                discard(out, work, created)
                raise PreprocessError(problem)
            # 2. near-duplicates: candidates per LSH partition, then each dropped record's best neighbour
            dropped_by_group: Counter[str] = Counter()
            if spec.dedup:
                _run_resumable(prog, "dedup: find", "dedup_find", list(range(num_buckets)), lambda p: dd.partition_marker(work, p),
                               lambda p: remote["dedup_partition"].remote(p, len(units), num_buckets,
                                                                          spec.dedup_distance, str(work)),
                               lambda p, r: None, resumed, max_in_flight, task_nodes)
                _run_resumable(prog, "dedup: resolve", "dedup_resolve", list(range(num_buckets)), lambda b: dd.resolve_marker(work, b),
                               lambda b: remote["resolve_bucket"].remote(b, num_buckets, str(work)),
                               lambda b, r: dropped_by_group.update(r["by_group"]), resumed, max_in_flight, task_nodes)
                phase_done("dedup_s")
            # 3. sort buckets (dedup applied, mix factors from the groups' counts after dedup)
            mix_factors, spill = None, False
            if cur.mix is not None:
                by_key = {f"{dd.key64(g):016x}": g for g in groups}
                available = {g: n - dropped_by_group.get(f"{dd.key64(g):016x}", 0) for g, n in groups.items()}
                if set(dropped_by_group) - set(by_key):
                    raise RuntimeError("internal: duplicates counted for a mix group no scan saw")
                targets, mix_factors = _mix_plan(cur.mix, available)
                spill = any(f > 1 for f in mix_factors.values())
                mix_report = {"available": {g: available.get(g, 0) for g in targets}, "target": targets,
                              "factor": {g: round(f, 6) for g, f in mix_factors.items()}}
            bucket_counts = [0] * num_buckets
            realised: dict[str, Counter] = {}

            def sorted_(b: int, r: dict) -> None:
                bucket_counts[b] = r["count"]
                counts.add_curation(r["curation"])
                for g, c in r["mix"].items():
                    realised.setdefault(g, Counter()).update(c)

            _run_resumable(prog, "sort buckets", "sort", list(range(num_buckets)), lambda b: bucket_file(work, b, "done.json"),
                           lambda b: remote["sort_bucket"].remote(b, len(units), spec, mix_factors, spill),
                           sorted_, resumed, max_in_flight, task_nodes)
            if spill:  # repeated copies landed in other buckets: add them there

                def merged(b: int, r: dict) -> None:
                    bucket_counts[b] = r["count"]

                _run_resumable(prog, "merge repeats", "merge", list(range(num_buckets)),
                               lambda b: bucket_file(work, b, "merged.json"),
                               lambda b: remote["merge_bucket"].remote(b, spec), merged, resumed, max_in_flight, task_nodes)
            if sum(bucket_counts) != counts.written or not counts.reconciles():
                raise RuntimeError(f"internal: buckets hold {sum(bucket_counts)} rows, counts say {counts.to_json()}")
            if sum(bucket_counts) == 0:  # leave nothing behind
                discard(out, work, created)
                raise PreprocessError(_nothing_to_write(counts, len(units)))
            if mix_report is not None:
                mix_report["realised"] = {g: realised.get(g, Counter())["kept"] + realised.get(g, Counter())["repeated"]
                                          for g in mix_report["target"]}
            phase_done("sort_s")
            # 4. write shards; each is indexed once it and all before it are written
            sps = cfg.samples_per_shard or auto_samples_per_shard(candidate_bytes, candidates, cfg.target_shard_bytes)
            plans = plan_shards(bucket_counts, sps)
            results: list[dict | None] = [None] * len(plans)
            prog.stage("write shards", len(plans))
            written = [0]

            def wrote(plan: ShardPlan, res: dict) -> None:
                task_nodes[res.pop(NODE_KEY)] += 1
                results[plan.index] = res
                while len(indexed) < len(plans) and (done := results[len(indexed)]) is not None:
                    indexed.append(finishing.submit(_index_shard, index, work, done["name"]))
                resumed["shards"] += int(res["resumed"])
                written[0] += res["samples"]
                prog.advance("write shards", records=written[0], unit="samples")

            run_bounded(lambda p: remote["write_shard_task"].remote(p, spec, str(out), spill), plans,
                        max_in_flight, wrote)
            prog.resumed("write shards", resumed["shards"], len(plans), "shard", after=True)
            phase_done("write_s")
        # 5. finish: quarantine, duplicates, length index, energon index published, while Ray shuts down
        shards = [ShardResult(r["name"], r["samples"], r["bytes"], r["sha256"]) for r in results]  # type: ignore[index]
        text_tokens = None if not spec.lengths else "tokenizer" if spec.tokenizer else "estimate"
        finished = finishing.submit(_finish_outputs, out, work, units, shards, num_buckets, spec.dedup, text_tokens,
                                    index, indexed)
        finish_submitted = True
    except SystematicLoss as e:
        raise PreprocessError(str(e)) from None
    finally:
        finishing.shutdown(wait=False, cancel_futures=not finish_submitted)
        shutdown_ray(own_ray)
    lengths_sha = finished.result()  # re-raises an error of the finishing step
    phase_done("finish_s")
    curation = cur.to_json()
    if curation["dedup"] is not None:
        curation["dedup"]["phash_images"] = {"from_field": phash["from_field"], "computed": phash["computed"]}
    if mix_report is not None:
        curation["mix"] = {**curation["mix"], **mix_report}
    manifest = {
        "tool": TOOL,
        "version": mmdata.__version__,
        "format_version": sf.FORMAT_VERSION,
        "fingerprint": fp,
        "dataset": cfg.dataset,
        "seed": cfg.seed,
        "samples_per_shard": sps,
        "options": {"image_root": str(cfg.image_root) if cfg.image_root else None,
                    "validation": asdict(cfg.validation), "target_shard_bytes": cfg.target_shard_bytes},
        "inputs": inputs,
        "job": {k: v for k, v in job.items() if k != "inputs"},
        "counts": counts.to_json(),
        "curation": curation,
        "shards": [asdict(s) for s in shards],
        "length_index": None if lengths_sha is None else {
            "file": LENGTHS_NAME, "sha256": lengths_sha, "text_tokens": text_tokens,
            "tokenizer_sha256": cur.tokenizer_sha256},
        "energon": {"sample_type": "mmdata.energon_loaders.sample.ConversationSample", "split": {"train": len(shards)}},
        "wall_time_s": round(time.perf_counter() - t_start, 3),
        "run": {"output": str(out), "num_buckets": num_buckets, "resumed": dict(resumed), "phases": phases,
                "task_nodes": dict(sorted(task_nodes.items())),
                "tokenizer": str(Path(cfg.tokenizer).resolve()) if cfg.tokenizer else None,
                "ray_address": cfg.address or os.environ.get("RAY_ADDRESS") or "local"},
    }
    with deferred_interrupt():  # the manifest says "finished": then the work folder goes
        write_json_atomic(out / sf.MANIFEST_NAME, manifest)
        if not cfg.keep_work_dir:
            shutil.rmtree(work, ignore_errors=True)
    if cfg.progress:
        from rich.console import Console

        Console(stderr=True).print(summary_table(manifest, out))
    return manifest
