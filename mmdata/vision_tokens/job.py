"""The Ray job behind `mmdata tokenize-images`: its stages, declared for the resumable stage
runner (mmdata/stage_runner.py), which runs the stage code of stages.py on Ray.

1. tokenize - chunks (fixed runs of samples of one input shard) streamed to TokenizeWorker
              actors, each holding one VQ model for the whole job: decode, resize exactly as
              Emu3ImageProcessor, VQ-encode, spill output members + quarantine lines. One CPU
              and one torch thread per worker and one worker per CPU; with GPUs in the cluster,
              each worker also asks for `gpus_per_worker` GPUs and runs the VQ on cuda. Actors,
              not tasks: Ray runs a GPU task in a fresh process each time (`max_calls=1`), which
              would reload the model for every chunk. Chunks finished by an earlier run are
              read by the driver; a worker that dies is restarted and its chunks sent again.
              With --tokenizer, each written sample's lengths per Emu3 task are counted too.
2. write    - one task per shard (after the workers are gone): concatenate its chunks (and
              their lengths).
3. outputs  - one task: quarantine.jsonl, lengths.parquet (--tokenizer: the length index
              `mmdata pack-plan` plans Emu3 packing from), energon's index (.nv-meta naming
              VQTokenSample, merged from the rows each shard writer saved): per-record work,
              kept out of the driver (issue 47).
4. finish   - the driver publishes .nv-meta, then manifest.json.

Resumable like `mmdata preprocess`, by the same runner (markers under DIR/.mmdata-work/, the
same output-folder checks and lock, `--overwrite`, Ctrl-C handling and publish order), and
byte-deterministic whatever the number of workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from rich.table import Table

import mmdata
from mmdata import shard_format as sf
from mmdata.actor_pool import run_on_actors
from mmdata.energon_loaders.emu3 import token_format
from mmdata.energon_loaders.emu3.tasks import DEFAULT_SYSTEM_PROMPT, Emu3Tasks
from mmdata.errors import UserError
from mmdata.local_tokenizer import load_local_tokenizer
from mmdata.packing.emu3_geometry import KIND as LENGTH_INDEX_KIND
from mmdata.ray_job import remove, shard_outputs
from mmdata.readiness import unfinished_job
from mmdata.shard_job.energon_meta import INDEX_PART, NV_META, build_index, publish_index
from mmdata.shard_job.lengths import LENGTHS_NAME, tokenizer_fingerprint
from mmdata.shard_job.manifest import Counts, fingerprint
from mmdata.shard_job.quarantine import concat_parts
from mmdata.shard_job.shard_samples import count_samples
from mmdata.shard_job.shard_writer import shard_work_file
from mmdata.stage_runner import Identity, JobRun, RayCluster, ResumableJob, Stage, run_job
from mmdata.units import plural
from mmdata.vision_tokens.defaults import DEFAULT_CHUNK_SAMPLES, DEFAULT_IMAGE_AREA
from mmdata.vision_tokens.lengths import write_token_length_index
from mmdata.vision_tokens.stages import (
    ChunkSpec,
    TokenizeOptions,
    TokenizeWorker,
    chunk_file,
    finished_chunk,
    write_token_shard,
)
from mmdata.vision_tokens.vq import (
    VQError,
    check_vq_dir,
    load_image_processor,
    processor_settings,
    read_vq_checkpoint,
    spatial_factor,
)

TOKEN_STATS = ("images", "visual_tokens", "text_only")
QUEUED_CHUNKS_PER_WORKER = 2  # one running, the next already shipped: a worker never waits on the driver
WORKER_MAX_RESTARTS = 2  # Ray restarts a dead worker this often; its chunks are sent again


TOOL = "mmdata tokenize-images"
PLAN_GLOB = "pack-plan-*.parquet"  # `mmdata pack-plan` outputs: stale once the shards change


class TokenizeError(UserError):
    """A problem with the job's inputs/outputs that the user must fix (printed, exit 2)."""


@dataclass
class TokenizeConfig:
    input: Path  # a preprocessed shard folder (mmdata preprocess output)
    vision_tokenizer: Path  # VQ dir (see vq.py)
    output: Path
    image_area: int | None = DEFAULT_IMAGE_AREA  # None: the VQ dir's processor min/max pixels
    address: str | None = None
    num_cpus: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    gpus_per_worker: float = 1.0  # on cuda; 0.25 = 4 workers (4 VQ models) share a GPU
    workers: int | None = None  # None: one per CPU (cpu) or per gpus_per_worker GPUs (cuda)
    batch_size: int | None = None  # None: 1 on CPU, 8 on GPU
    chunk_samples: int = DEFAULT_CHUNK_SAMPLES
    overwrite: bool = False
    progress: bool = True
    keep_work_dir: bool = False
    tokenizer: Path | None = None  # Emu3 text tokenizer: write the length index (vision_tokens/lengths.py)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # ... counted with this system prompt (the recipe's data.system_prompt)


@dataclass
class _Input:
    shards: list[tuple[str, int]]  # (name, samples)
    fingerprint: str
    manifest: dict | None


def _read_input(folder: Path) -> _Input:
    """The input shards in order, with sample counts and a fingerprint of their content."""
    if not folder.is_dir():
        raise TokenizeError(f"{folder}: no such shard folder")
    if (why := unfinished_job(folder)) is not None:
        raise TokenizeError(why)
    manifest_path = folder / sf.MANIFEST_NAME
    if manifest_path.is_file():
        m = json.loads(manifest_path.read_text())
        if m.get("tool") == "mmdata tokenize-images":
            raise TokenizeError(f"{folder} already holds token shards; give the preprocessed shards as input")
        shards = [(s["name"], int(s["samples"])) for s in m.get("shards", [])]
        fp = fingerprint({"manifest": m.get("fingerprint"), "shards": m.get("shards")})
        missing = [n for n, _ in shards if not (folder / n).is_file()]
        if missing:
            raise TokenizeError(f"{folder}: {len(missing)} shard(s) of its manifest are missing, e.g. {missing[0]}")
        return _Input(shards, fp, m)
    names = sorted(p.name for p in folder.glob("shard-*.tar"))
    if not names:
        raise TokenizeError(f"{folder}: no shard-*.tar files (expected `mmdata preprocess` output)")
    stats = [(n, (folder / n).stat()) for n in names]
    fp = fingerprint({"files": [(n, s.st_size, s.st_mtime_ns) for n, s in stats]})
    return _Input([(n, count_samples(folder / n)) for n in names], fp, None)


def _plan_chunks(shards: list[tuple[str, int]], chunk_samples: int) -> dict[str, list[ChunkSpec]]:
    return {
        name: [
            ChunkSpec(name, i, start, min(n, start + chunk_samples))
            for i, start in enumerate(range(0, n, chunk_samples))
        ]
        for name, n in shards
    }


def _read_vq(cfg: TokenizeConfig) -> dict:
    """Validate the VQ dir and fingerprint its weights (in the driver, before any task runs)."""
    try:
        ckpt = read_vq_checkpoint(cfg.vision_tokenizer)
        proc = load_image_processor(cfg.vision_tokenizer, cfg.image_area)
    except VQError as e:
        raise TokenizeError(str(e)) from None
    if proc.spatial_factor != spatial_factor(ckpt.config):
        raise TokenizeError(
            f"{cfg.vision_tokenizer}: processor spatial_factor {proc.spatial_factor} != the VQ's "
            f"{spatial_factor(ckpt.config)}"
        )
    return {
        "path": str(Path(cfg.vision_tokenizer).resolve()),
        "layout": ckpt.layout,
        "fingerprint": ckpt.fingerprint(),
        "config": ckpt.config,
        "processor": processor_settings(proc),
    }


def _resolve_device(cfg: TokenizeConfig, resources: dict) -> str:
    gpus = resources.get("GPU", 0)
    if cfg.device == "auto":
        return "cuda" if gpus > 0 else "cpu"
    if cfg.device == "cuda" and gpus <= 0:
        raise TokenizeError("--device cuda: the Ray cluster has no GPUs")
    return cfg.device


def write_token_outputs(
    out: str, work: str, quarantine: list[str], written: list[tuple[str, int]], length_index: dict | None
) -> dict:
    """(a Ray task) quarantine.jsonl from the chunks' parts, the length index (with --tokenizer),
    then energon's index of the `written` shards [(name, samples)] in a temporary folder:
    {"lengths_sha256", "energon_meta"} (`mmdata.yaml` names the token sample type, `dataset.yaml`
    energon's InterleavedSample: energon_meta.py)."""
    o, w = Path(out), Path(work)
    concat_parts([Path(p) for p in quarantine], o / sf.QUARANTINE_NAME)
    lengths_sha = None
    if length_index is not None:
        lengths_sha = write_token_length_index(
            o,
            [shard_work_file(w, n, "lengths.json") for n, _ in written],
            length_index["tokenizer"],
            length_index["system_prompt"],
        )
    parts = [(n, samples, shard_work_file(w, n, INDEX_PART)) for n, samples in written]
    return {"lengths_sha256": lengths_sha, "energon_meta": str(build_index(o, parts, token_format.SAMPLE_TYPE))}


def _length_index_settings(cfg: TokenizeConfig) -> dict | None:
    """What the length index is counted with (part of the job's identity), the tokenizer checked
    here: None without --tokenizer."""
    if cfg.tokenizer is None:
        return None
    try:
        Emu3Tasks(load_local_tokenizer(cfg.tokenizer, "--tokenizer"), cfg.system_prompt)
        sha = tokenizer_fingerprint(cfg.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise TokenizeError(f"--tokenizer {cfg.tokenizer}: {e}") from None
    return {"tokenizer": sha, "system_prompt": cfg.system_prompt}


def _worker_count(cfg: TokenizeConfig, res: dict, gpus: float, n_chunks: int) -> int:
    """--workers, or as many as the cluster holds (one per CPU, or per `gpus` GPUs), at most
    one per chunk; refused when the cluster cannot hold them all (the rest would wait forever)."""
    cpus_have, gpus_have = res.get("CPU", 0), res.get("GPU", 0)
    fits = int(gpus_have / gpus + 1e-9) if gpus else int(cpus_have)
    if cfg.workers is None:
        return max(1, min(fits, n_chunks))
    if cfg.workers > fits:
        need = f"{cfg.workers * gpus:g} GPUs" if gpus else f"{cfg.workers} CPUs"
        raise TokenizeError(
            f"--workers {cfg.workers}: needs {need}, the Ray cluster has {gpus_have:g} GPUs and {cpus_have:g} CPUs"
        )
    return min(cfg.workers, n_chunks)


def _tokenize_on_workers(
    chunks: list[ChunkSpec], opts: TokenizeOptions, n_workers: int, gpus: float, on_done
) -> list[dict]:
    """Stream `chunks` to `n_workers` TokenizeWorker actors (each loads the VQ once), then kill
    them, so that their CPUs and GPUs are free for the write stage. Returns per-worker stats:
    chunks done, VQ loads (over all its processes) and restarts (processes after the first that
    loaded the VQ: a process killed while still loading leaves no record)."""
    import ray  # (2 s to import, and `mmdata --help` imports this module)

    actor_cls = ray.remote(
        num_cpus=1, num_gpus=gpus, max_restarts=WORKER_MAX_RESTARTS, max_task_retries=WORKER_MAX_RESTARTS
    )(TokenizeWorker)
    actors = [actor_cls.remote(opts, i) for i in range(n_workers)]
    loads: list[dict[tuple[str, int], int]] = [{} for _ in range(n_workers)]  # worker -> {(host, pid): loads}

    def done(chunk: ChunkSpec, r: dict) -> None:
        seen = loads[r["worker"]]
        seen[(r["host"], r["pid"])] = max(seen.get((r["host"], r["pid"]), 0), r["vq_loads"])
        on_done(chunk, r)

    try:
        finished = run_on_actors(
            actors, chunks, lambda a, c: a.tokenize.remote(c), done, queue_per_actor=QUEUED_CHUNKS_PER_WORKER
        )
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
    for path in (Path(opts.work) / "workers").glob("w*.json"):  # processes that died before a result
        p = json.loads(path.read_text())
        loads[p["worker"]].setdefault((p["host"], p["pid"]), 1)
    return [
        {"chunks": finished[i], "vq_loads": sum(loads[i].values()), "restarts": max(0, len(loads[i]) - 1)}
        for i in range(n_workers)
    ]


def run_tokenize(cfg: TokenizeConfig) -> dict:
    """Run the whole job (mmdata/stage_runner.py); returns the manifest. Raises TokenizeError on user
    errors, and Interrupted (after shutting Ray down) on Ctrl-C: a rerun of the same job resumes it."""
    return run_job(TokenizeJob(cfg))


class TokenizeJob(ResumableJob):
    """`mmdata tokenize-images` as the runner's stages: tokenize (chunks on actors), write shards;
    then the finish step and the manifest."""

    tool = TOOL
    error = TokenizeError
    work_dirs = ("chunks", "shards", "workers")
    settings_dirs = ("chunks", "shards")  # other chunk boundaries: redo (the output is the same)
    per_run_dirs = ("workers",)  # the load records of an earlier run's workers (counted per run)

    def __init__(self, cfg: TokenizeConfig):
        self.options = self.cfg = cfg
        self.counts, self.stats = Counts(), dict.fromkeys(TOKEN_STATS, 0)
        self.workers: list[dict] = []  # per worker: chunks, VQ loads, restarts
        self.results: dict[str, dict] = {}  # per output shard
        self.lengths_sha: str | None = None

    def positive_flags(self) -> dict[str, float | None]:
        cfg = self.cfg
        return {
            "--chunk-samples": cfg.chunk_samples,
            "--batch-size": cfg.batch_size,
            "--workers": cfg.workers,
            "--gpus-per-worker": cfg.gpus_per_worker,
        }

    def check(self) -> None:
        cfg = self.cfg
        if cfg.device not in ("auto", "cpu", "cuda"):
            raise TokenizeError(f"--device must be auto, cpu or cuda, got {cfg.device!r}")
        self.inp_dir = Path(cfg.input).resolve()
        if Path(cfg.output).resolve() == self.inp_dir:
            raise TokenizeError("--output must differ from the input shard folder")
        self.inp = _read_input(self.inp_dir)
        try:
            check_vq_dir(cfg.vision_tokenizer)
        except VQError as e:
            raise TokenizeError(str(e)) from None
        self.length_index = _length_index_settings(cfg)

    def identity(self, ray: RayCluster) -> Identity:
        """The VQ checkpoint is read and fingerprinted while Ray starts (both take seconds); the
        device (part of the identity: codes can differ at near-ties) depends on the cluster."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="mmdata-vq")
        vq_future = pool.submit(_read_vq, self.cfg)
        pool.shutdown(wait=False)
        ray.start()
        self.vq = vq = vq_future.result()
        self.device = _resolve_device(self.cfg, ray.resources())
        self.batch_size = self.cfg.batch_size or (8 if self.device == "cuda" else 1)
        self.job = {
            "format_version": token_format.TOKEN_FORMAT_VERSION,
            "input": self.inp.fingerprint,
            "vq": vq["fingerprint"],
            "processor": vq["processor"],
            "device": self.device,
            "batch_size": self.batch_size,
            "transformers": version("transformers"),
            "torch": version("torch"),
            **({"length_index": self.length_index} if self.length_index else {}),
        }
        return Identity(self.job, {"chunk_samples": self.cfg.chunk_samples})

    def own_outputs(self, out: Path) -> list[Path]:
        return shard_outputs(out) + [p for p in (out / LENGTHS_NAME,) if p.exists()] + sorted(out.glob(PLAN_GLOB))

    def stages(self, run: JobRun) -> Iterator[Stage]:
        cfg, work = self.cfg, run.work
        opts = TokenizeOptions(
            str(self.inp_dir),
            str(work),
            self.vq["path"],
            self.vq["fingerprint"],
            cfg.image_area,
            self.device,
            self.batch_size,
            threads=1,
            text_tokenizer=str(Path(cfg.tokenizer).resolve()) if self.length_index else None,
            system_prompt=cfg.system_prompt,
        )
        self.plan = _plan_chunks(self.inp.shards, cfg.chunk_samples)
        self.chunks = [c for cs in self.plan.values() for c in cs]
        self.gpus = cfg.gpus_per_worker if self.device == "cuda" else 0

        def on_workers(todo: list[ChunkSpec], done) -> None:
            n_workers = _worker_count(cfg, run.ray.resources(), self.gpus, len(todo))
            self.workers = _tokenize_on_workers(todo, opts, n_workers, self.gpus, done)

        # chunks an earlier run finished are read by the driver: no worker (and no VQ) for them
        yield Stage(
            "tokenize images",
            "chunks",
            "tokenize_s",
            self.chunks,
            execute=on_workers,
            recorded=lambda c: finished_chunk(c, work),
            on_result=self._tokenized,
            noun="chunk",
            records=lambda: self.stats["images"],
            record_noun="images",
        )
        if self.counts.written == 0:  # leave nothing behind
            c = self.counts
            run.refuse(
                f"no sample to write: all {plural(c.read, 'sample')} were quarantined "
                f"({', '.join(f'{r} {n:,}' for r, n in c.to_json()['by_reason'].items())})"
            )
        write = run.remote(write_token_shard)
        yield Stage(
            "write shards",
            "shards",
            "write_s",
            list(self.plan),
            submit=lambda n: write.remote(n, len(self.plan[n]), str(work), str(run.out), bool(self.length_index)),
            on_result=self.results.__setitem__,
            noun="shard",
        )
        self.shards = [
            {k: self.results[n][k] for k in ("name", "samples", "bytes", "sha256")}
            for n in self.plan
            if self.results[n]["samples"]
        ]
        quarantine = [str(chunk_file(work, c.shard, c.index, "quarantine.jsonl")) for c in self.chunks]
        written = [(s["name"], s["samples"]) for s in self.shards]
        outputs = run.remote(write_token_outputs)
        yield Stage(
            "index and lengths",
            "outputs",
            "outputs_s",
            ["outputs"],
            submit=lambda _: outputs.remote(str(run.out), str(work), quarantine, written, self.length_index),
            on_result=self._outputs,
        )

    def _tokenized(self, _chunk: ChunkSpec, result: dict) -> None:
        self.counts.merge(result)
        for k in TOKEN_STATS:
            self.stats[k] += result[k]

    def _outputs(self, _unit: str, result: dict) -> None:
        self.lengths_sha, self.energon_meta = result["lengths_sha256"], Path(result["energon_meta"])

    def finish(self, run: JobRun) -> None:
        """energon's index, built by the outputs task, published (a retried task's folder goes)."""
        publish_index(run.out, self.energon_meta)
        remove(list(run.out.glob(f"{NV_META}.tmp-*")))

    def manifest(self, run: JobRun) -> dict:
        cfg, vq, workers = self.cfg, self.vq, self.workers
        return {
            "tool": TOOL,
            "version": mmdata.__version__,
            "format_version": token_format.TOKEN_FORMAT_VERSION,
            "fingerprint": fingerprint(self.job),
            "job": self.job,
            "input": {
                "path": str(self.inp_dir),
                "fingerprint": self.inp.fingerprint,
                "manifest_fingerprint": (self.inp.manifest or {}).get("fingerprint"),
            },
            "vision_tokenizer": {k: vq[k] for k in ("path", "layout", "fingerprint", "config")},
            "image_area": cfg.image_area,
            "image_processor": vq["processor"],
            "device": self.device,
            "batch_size": self.batch_size,
            "versions": {
                "transformers": version("transformers"),
                "torch": version("torch"),
                "megatron-energon": version("megatron-energon"),
            },
            "counts": {**self.counts.to_json(), "tokens": self.stats},
            "shards": self.shards,
            "length_index": None
            if self.lengths_sha is None
            else {
                "file": LENGTHS_NAME,
                "sha256": self.lengths_sha,
                "kind": LENGTH_INDEX_KIND,
                "tokenizer_sha256": self.length_index["tokenizer"],
                "system_prompt": self.length_index["system_prompt"],
            },
            "energon": {"sample_type": ".".join(token_format.SAMPLE_TYPE), "split": {"train": len(self.shards)}},
            "wall_time_s": run.wall_time_s(),
            "run": {
                "output": str(run.out),
                "chunk_samples": cfg.chunk_samples,
                "chunks": len(self.chunks),
                "resumed": run.resumed,
                "phases": run.phases,
                "task_cpu_s": run.task_cpu_s,
                "driver_cpu_s": run.driver_cpu_s(),
                "task_nodes": dict(sorted(run.task_nodes.items())),
                "ray_address": cfg.address or os.environ.get("RAY_ADDRESS") or "local",
                "num_cpus": cfg.num_cpus,
                "gpus_per_worker": self.gpus,
                "workers": len(workers),
                "vq_loads": [w["vq_loads"] for w in workers],
                "worker_chunks": [w["chunks"] for w in workers],
                "worker_restarts": [w["restarts"] for w in workers],
            },
        }

    def summary(self, manifest: dict, out: Path):
        return summary_table(manifest, out)


def summary_table(manifest: dict, out: Path | None = None):
    c, tok = manifest["counts"], manifest["counts"]["tokens"]
    t = Table(title=f"mmdata tokenize-images: {out or manifest['run']['output']}")
    t.add_column("what")
    t.add_column("count", justify="right")
    for label, n in (
        ("samples read", c["read"]),
        ("samples written", c["written"]),
        ("  text-only (passed through)", tok["text_only"]),
        ("samples quarantined", c["quarantined"]),
        ("images tokenized", tok["images"]),
        ("visual tokens", tok["visual_tokens"]),
    ):
        t.add_row(label, f"{n:,}")
    for reason, n in c["by_reason"].items():
        t.add_row(f"  reason {reason}", f"{n:,}")
    wall = manifest.get("wall_time_s") or 0.0
    t.caption = (
        f"{plural(len(manifest['shards']), 'shard')} on {manifest['device']}, image area {manifest['image_area']}, "
        f"VQ {manifest['vision_tokenizer']['fingerprint'][:12]}, {wall:.1f} s "
        f"({tok['images'] / max(wall, 1e-9):,.1f} images/s)"
    )
    return t
