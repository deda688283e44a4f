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
5. outputs - one task: quarantine.jsonl, duplicates.jsonl, lengths.parquet and energon's index
             (merged from the rows each shard writer saved; outputs.py).
6. finish  - the driver publishes .nv-meta atomically, then manifest.json last: a folder holding
             the work folder and no manifest is unfinished, and readers refuse it
             (mmdata/readiness.py).

The driver only holds ObjectRefs, per-bucket counts, per-group counts and per-shard results, and
does work per file, bucket and shard only: rows, hashes, media, index and length rows never pass
through it, so neither its memory nor its CPU grows with the number of records within a shard
(issue 47: its serial share is what caps a cluster's speed-up; benchmarks/bench_preprocess_scale.py).
Options, curation flags and the job description: job_config.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import mmdata
from mmdata import shard_format as sf
from mmdata.preprocess import adapters
from mmdata.preprocess.adapters.base import InputUnit
from mmdata.preprocess.adapters.llava_json import check_image_root
from mmdata.preprocess.curation import dedup
from mmdata.preprocess.job_config import (
    TOOL,
    PreprocessConfig,
    PreprocessError,
    auto_samples_per_shard,
    job_description,
    manifest_job,
    mix_plan,
    nothing_to_write,
    parse_curation,
    unmatched_terms,
)
from mmdata.preprocess.lengths import write_counting_tokenizer
from mmdata.preprocess.loss_check import LossCheck
from mmdata.preprocess.outputs import our_outputs, write_outputs
from mmdata.preprocess.rows import ROW_FORMAT
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
from mmdata.ray_job import remove
from mmdata.shard_job.energon_meta import NV_META, publish_index
from mmdata.shard_job.lengths import LENGTHS_NAME
from mmdata.shard_job.manifest import Counts, fingerprint
from mmdata.shard_job.shard_writer import ShardResult
from mmdata.stage_runner import Identity, JobRun, RayCluster, ResumableJob, Stage, json_marker, run_job

__all__ = ["PreprocessConfig", "PreprocessError", "run_preprocess"]


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
        self.job = job_description(self.cfg, self.cur, self.units)
        return Identity(self.job, {"num_buckets": self.num_buckets, "row_format": ROW_FORMAT})

    def own_outputs(self, out: Path) -> list[Path]:
        return our_outputs(out)

    def saved_job(self, manifest: dict) -> dict | None:
        return manifest_job(manifest)

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
            run.refuse(nothing_to_write(self.counts, len(units)))
        if self.mix_report is not None:
            self.mix_report["realised"] = {
                g: self.realised.get(g, Counter())["kept"] + self.realised.get(g, Counter())["repeated"]
                for g in self.mix_report["target"]
            }
        # 4. write shards (each with its rows of energon's index and of the length index)
        self.sps = cfg.samples_per_shard or auto_samples_per_shard(
            self.candidate_bytes, self.candidates, cfg.target_shard_bytes
        )
        plans = plan_shards(self.bucket_counts, self.sps)
        self.results: list[dict | None] = [None] * len(plans)
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
        # 5. the outputs beside the shards: per-record work, so a task's, never the driver's
        self.shards = [ShardResult(r["name"], r["samples"], r["bytes"], r["sha256"]) for r in self.results]  # type: ignore[index]
        self.text_tokens = None if not spec.lengths else "tokenizer" if spec.tokenizer else "estimate"
        outputs, shards = run.remote(write_outputs), [(s.name, s.samples) for s in self.shards]
        yield Stage(
            "index and lengths",
            "outputs",
            "outputs_s",
            ["outputs"],
            submit=lambda _: outputs.remote(
                str(run.out), str(work), len(units), shards, nb, spec.dedup, self.text_tokens
            ),
            on_result=self._outputs,
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
        targets, mix_factors = mix_plan(self.cur.mix, available)
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
        self.written += result["samples"]

    def _outputs(self, _unit: str, result: dict) -> None:
        self.lengths_sha, self.energon_meta = result["lengths_sha256"], Path(result["energon_meta"])

    # ------------------------------------------------------------------ finish and manifest

    def finish(self, run: JobRun) -> None:
        """energon's index, built by the outputs task, published: with the manifest after it, it
        is what says "finished". A retried outputs task's earlier folder goes."""
        publish_index(run.out, self.energon_meta)
        remove(list(run.out.glob(f"{NV_META}.tmp-*")))

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
                "driver_cpu_s": run.driver_cpu_s(),
                "task_nodes": dict(sorted(run.task_nodes.items())),
                "tokenizer": str(Path(cfg.tokenizer).resolve()) if cfg.tokenizer else None,
                "ray_address": cfg.address or os.environ.get("RAY_ADDRESS") or "local",
            },
        }

    def summary(self, manifest: dict, out: Path):
        return summary_table(manifest, out)
