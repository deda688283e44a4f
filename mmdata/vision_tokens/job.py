"""The Ray job behind `mmdata tokenize-images` (the driver; the stages are in stages.py).

1. tokenize - chunks (fixed runs of samples of one input shard) streamed to TokenizeWorker
              actors, each holding one VQ model for the whole job: decode, resize exactly as
              Emu3ImageProcessor, VQ-encode, spill output members + quarantine lines. One CPU
              and one torch thread per worker and one worker per CPU; with GPUs in the cluster,
              each worker also asks for `gpus_per_worker` GPUs and runs the VQ on cuda. Actors,
              not tasks: Ray runs a GPU task in a fresh process each time (`max_calls=1`), which
              would reload the model for every chunk. Chunks finished by an earlier run are
              read by the driver; a worker that dies is restarted and its chunks sent again.
2. write    - one task per shard (after the workers are gone): concatenate its chunks.
3. finish   - energon index (.nv-meta naming VQTokenSample), quarantine.jsonl, manifest.json.

Resumable like `mmdata preprocess` (markers under DIR/.mmdata-work/, the same output-folder
checks, `--overwrite`, Ctrl-C handling and publish order: mmdata/ray_job.py), and
byte-deterministic whatever the number of workers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import mmdata
from mmdata import shard_format as sf
from mmdata.errors import UserError, deferred_interrupt
from mmdata.preprocess.energon_meta import ShardLayout, write_energon_index
from mmdata.preprocess.manifest import Counts, fingerprint, write_json_atomic
from mmdata.preprocess.quarantine import concat_parts
from mmdata.preprocess.stages import shard_work_file
from mmdata.ray_job import (check_output_dir, discard, init_ray, remove, resumable, run_bounded, shard_outputs,
                             shutdown_ray)
from mmdata.readiness import unfinished_job
from mmdata.units import plural
from mmdata.vision_tokens import token_format as tf
from mmdata.actor_pool import run_on_actors
from mmdata.vision_tokens.stages import (ChunkSpec, TokenizeOptions, TokenizeWorker, chunk_file, count_samples,
                                         finished_chunk, write_token_shard)
from mmdata.vision_tokens.vq import (VQError, check_vq_dir, load_image_processor, processor_settings,
                                     read_vq_checkpoint, spatial_factor)

DEFAULT_IMAGE_AREA = 512 * 512  # Emu3-Chat's image_area
DEFAULT_CHUNK_SAMPLES = 64
TOKEN_STATS = ("images", "visual_tokens", "text_only")
QUEUED_CHUNKS_PER_WORKER = 2  # one running, the next already shipped: a worker never waits on the driver
WORKER_MAX_RESTARTS = 2  # Ray restarts a dead worker this often; its chunks are sent again


TOOL = "mmdata tokenize-images"
WORK_DIR_NAME = sf.WORK_DIR_NAME


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
    return {name: [ChunkSpec(name, i, start, min(n, start + chunk_samples))
                   for i, start in enumerate(range(0, n, chunk_samples))] for name, n in shards}


def _prepare_work_dir(out: Path, fp: str, chunk_samples: int, job: dict) -> Path:
    work = out / WORK_DIR_NAME
    wj = work / "work.json"
    state = {"fingerprint": fp, "chunk_samples": chunk_samples, "tool": TOOL, "job": job}
    if wj.exists() and json.loads(wj.read_text()).get("chunk_samples") != chunk_samples:
        remove([work / "chunks", work / "shards"])  # other chunk boundaries: redo (the output is the same)
    remove([work / "workers"])  # the load records of an earlier run's workers (counted per run)
    for d in ("chunks", "shards", "workers"):
        (work / d).mkdir(parents=True, exist_ok=True)
    stale = list(work.rglob(".*.tmp-*")) + list(out.glob(".shard-*.tar.tmp-*")) + list(out.glob("shard-*.tar.idx.tmp"))
    remove(stale + list(out.glob(f"{sf.ENERGON_META}.tmp-*")))
    write_json_atomic(wj, state)
    return work


def _read_vq(cfg: TokenizeConfig) -> dict:
    """Validate the VQ dir and fingerprint its weights (in the driver, before any task runs)."""
    try:
        ckpt = read_vq_checkpoint(cfg.vision_tokenizer)
        proc = load_image_processor(cfg.vision_tokenizer, cfg.image_area)
    except VQError as e:
        raise TokenizeError(str(e)) from None
    if proc.spatial_factor != spatial_factor(ckpt.config):
        raise TokenizeError(f"{cfg.vision_tokenizer}: processor spatial_factor {proc.spatial_factor} != the VQ's "
                            f"{spatial_factor(ckpt.config)}")
    return {"path": str(Path(cfg.vision_tokenizer).resolve()), "layout": ckpt.layout, "fingerprint": ckpt.fingerprint(),
            "config": ckpt.config, "processor": processor_settings(proc)}


def _resolve_device(cfg: TokenizeConfig) -> str:
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if cfg.device == "auto":
        return "cuda" if gpus > 0 else "cpu"
    if cfg.device == "cuda" and gpus <= 0:
        raise TokenizeError("--device cuda: the Ray cluster has no GPUs")
    return cfg.device


def _finish_outputs(out: Path, work: Path, plan: dict[str, list[ChunkSpec]], written: list[str]) -> None:
    """quarantine.jsonl, then energon's index (published atomically): `mmdata.yaml` names the token
    sample type, `dataset.yaml` energon's InterleavedSample (energon_meta.py)."""
    parts = [chunk_file(work, c.shard, c.index, "quarantine.jsonl") for chunks in plan.values() for c in chunks]
    concat_parts(parts, out / sf.QUARANTINE_NAME)
    layouts = (ShardLayout.from_json(shard_work_file(work, n, "layout.json").read_text()) for n in written)
    write_energon_index(out, written, layouts, sample_type=tf.SAMPLE_TYPE)


def _manifest_job(manifest: dict) -> dict | None:
    return manifest.get("job") if isinstance(manifest.get("job"), dict) else None


def _worker_count(cfg: TokenizeConfig, res: dict, gpus: float, n_chunks: int) -> int:
    """--workers, or as many as the cluster holds (one per CPU, or per `gpus` GPUs), at most
    one per chunk; refused when the cluster cannot hold them all (the rest would wait forever)."""
    cpus_have, gpus_have = res.get("CPU", 0), res.get("GPU", 0)
    fits = int(gpus_have / gpus + 1e-9) if gpus else int(cpus_have)
    if cfg.workers is None:
        return max(1, min(fits, n_chunks))
    if cfg.workers > fits:
        need = f"{cfg.workers * gpus:g} GPUs" if gpus else f"{cfg.workers} CPUs"
        raise TokenizeError(f"--workers {cfg.workers}: needs {need}, the Ray cluster has "
                            f"{gpus_have:g} GPUs and {cpus_have:g} CPUs")
    return min(cfg.workers, n_chunks)


def _tokenize_on_workers(chunks: list[ChunkSpec], opts: TokenizeOptions, n_workers: int, gpus: float,
                         on_done) -> list[dict]:
    """Stream `chunks` to `n_workers` TokenizeWorker actors (each loads the VQ once), then kill
    them, so that their CPUs and GPUs are free for the write stage. Returns per-worker stats:
    chunks done, VQ loads (over all its processes) and restarts (processes after the first that
    loaded the VQ: a process killed while still loading leaves no record)."""
    import ray

    actor_cls = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=WORKER_MAX_RESTARTS,
                           max_task_retries=WORKER_MAX_RESTARTS)(TokenizeWorker)
    actors = [actor_cls.remote(opts, i) for i in range(n_workers)]
    loads: list[dict[tuple[str, int], int]] = [{} for _ in range(n_workers)]  # worker -> {(host, pid): loads}

    def done(chunk: ChunkSpec, r: dict) -> None:
        seen = loads[r["worker"]]
        seen[(r["host"], r["pid"])] = max(seen.get((r["host"], r["pid"]), 0), r["vq_loads"])
        on_done(chunk, r)

    try:
        finished = run_on_actors(actors, chunks, lambda a, c: a.tokenize.remote(c), done,
                                 queue_per_actor=QUEUED_CHUNKS_PER_WORKER)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
    for path in (Path(opts.work) / "workers").glob("w*.json"):  # processes that died before a result
        p = json.loads(path.read_text())
        loads[p["worker"]].setdefault((p["host"], p["pid"]), 1)
    return [{"chunks": finished[i], "vq_loads": sum(loads[i].values()), "restarts": max(0, len(loads[i]) - 1)}
            for i in range(n_workers)]


@resumable
def run_tokenize(cfg: TokenizeConfig) -> dict:
    """Run the whole job; returns the manifest. Raises TokenizeError on user errors, and
    Interrupted (after shutting Ray down) on Ctrl-C: a rerun of the same job resumes it."""
    import ray

    from mmdata.preprocess.progress import JobProgress

    t_start = time.perf_counter()
    if cfg.chunk_samples <= 0:
        raise TokenizeError("--chunk-samples must be positive")
    if cfg.batch_size is not None and cfg.batch_size <= 0:
        raise TokenizeError("--batch-size must be positive")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise TokenizeError(f"--device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.workers is not None and cfg.workers <= 0:
        raise TokenizeError(f"--workers must be a positive number, got {cfg.workers}")
    if cfg.gpus_per_worker <= 0:
        raise TokenizeError(f"--gpus-per-worker must be positive, got {cfg.gpus_per_worker}")
    if cfg.num_cpus is not None and cfg.num_cpus <= 0:
        raise TokenizeError(f"--num-cpus must be a positive number, got {cfg.num_cpus}")
    inp_dir, out = Path(cfg.input).resolve(), Path(cfg.output).resolve()
    if out == inp_dir:
        raise TokenizeError("--output must differ from the input shard folder")
    if out.exists() and not out.is_dir():
        raise TokenizeError(f"--output {out} is a file; give a folder (a new one, or one this tool wrote)")
    inp = _read_input(inp_dir)
    try:
        check_vq_dir(cfg.vision_tokenizer)
    except VQError as e:
        raise TokenizeError(str(e)) from None
    # The VQ checkpoint is read and fingerprinted while Ray starts (both take seconds).
    pool = ThreadPoolExecutor(1, thread_name_prefix="mmdata-vq")
    vq_future = pool.submit(_read_vq, cfg)
    pool.shutdown(wait=False)
    own_ray = init_ray(cfg.address, cfg.num_cpus)
    try:
        vq = vq_future.result()
        device = _resolve_device(cfg)
        batch_size = cfg.batch_size or (8 if device == "cuda" else 1)
        import torch
        import transformers

        job = {"format_version": tf.TOKEN_FORMAT_VERSION, "input": inp.fingerprint, "vq": vq["fingerprint"],
               "processor": vq["processor"], "device": device, "batch_size": batch_size,
               "transformers": transformers.__version__, "torch": torch.__version__}
        fp = fingerprint(job)
        done_manifest = check_output_dir(out, fp, job, cfg.overwrite, shard_outputs, TokenizeError, _manifest_job)
        if done_manifest is not None:
            print(f"{out}: already complete for these shards and VQ model; nothing to do", file=sys.stderr)
            if not cfg.keep_work_dir:
                shutil.rmtree(out / WORK_DIR_NAME, ignore_errors=True)
            return done_manifest
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        work = _prepare_work_dir(out, fp, cfg.chunk_samples, job)
        opts = TokenizeOptions(str(inp_dir), str(work), vq["path"], vq["fingerprint"], cfg.image_area, device,
                               batch_size, threads=1)
        plan = _plan_chunks(inp.shards, cfg.chunk_samples)
        chunks = [c for cs in plan.values() for c in cs]
        gpus = cfg.gpus_per_worker if device == "cuda" else 0
        write_r = ray.remote(num_cpus=1)(write_token_shard)
        res = ray.cluster_resources()
        max_in_flight = max(2, 2 * int(res.get("CPU", 1)))
        counts, stats = Counts(), dict.fromkeys(TOKEN_STATS, 0)
        resumed = {"chunks": 0, "shards": 0}
        phases: dict[str, float] = {"ray_init_s": round(time.perf_counter() - t_start, 3)}
        workers: list[dict] = []
        with JobProgress(cfg.progress) as prog:
            t0 = time.perf_counter()
            prog.stage("tokenize images", len(chunks))

            def tokenized(_chunk, r: dict) -> None:
                counts.merge(r)
                for k in TOKEN_STATS:
                    stats[k] += r[k]
                resumed["chunks"] += int(r["resumed"])
                prog.advance("tokenize images", records=stats["images"], unit="images")

            todo = []
            for c in chunks:  # chunks an earlier run finished: read here, no worker (and no VQ) for them
                done = finished_chunk(c, work)
                if done is None:
                    todo.append(c)
                else:
                    tokenized(c, done)
            if todo:
                workers = _tokenize_on_workers(todo, opts, _worker_count(cfg, res, gpus, len(todo)), gpus, tokenized)
            prog.resumed("tokenize images", resumed["chunks"], len(chunks), "chunk", after=True)
            if counts.written == 0:  # leave nothing behind
                discard(out, work, created)
                raise TokenizeError(f"no sample to write: all {plural(counts.read, 'sample')} were quarantined "
                                    f"({', '.join(f'{r} {n:,}' for r, n in counts.to_json()['by_reason'].items())})")
            phases["tokenize_s"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            prog.stage("write shards", len(plan))
            results: dict[str, dict] = {}

            def wrote(name, r: dict) -> None:
                results[name] = r
                resumed["shards"] += int(r["resumed"])
                prog.advance("write shards")

            run_bounded(lambda n: write_r.remote(n, len(plan[n]), str(work), str(out)), list(plan), max_in_flight,
                        wrote)
            prog.resumed("write shards", resumed["shards"], len(plan), "shard", after=True)
            phases["write_s"] = round(time.perf_counter() - t0, 3)
    finally:
        shutdown_ray(own_ray)
    t0 = time.perf_counter()
    shards = [{k: results[n][k] for k in ("name", "samples", "bytes", "sha256")} for n in plan if results[n]["samples"]]
    _finish_outputs(out, work, plan, [s["name"] for s in shards])
    phases["finish_s"] = round(time.perf_counter() - t0, 3)
    manifest = {
        "tool": "mmdata tokenize-images",
        "version": mmdata.__version__,
        "format_version": tf.TOKEN_FORMAT_VERSION,
        "fingerprint": fp,
        "job": job,
        "input": {"path": str(inp_dir), "fingerprint": inp.fingerprint,
                  "manifest_fingerprint": (inp.manifest or {}).get("fingerprint")},
        "vision_tokenizer": {k: vq[k] for k in ("path", "layout", "fingerprint", "config")},
        "image_area": cfg.image_area,
        "image_processor": vq["processor"],
        "device": device,
        "batch_size": batch_size,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "megatron-energon": version("megatron-energon")},
        "counts": {**counts.to_json(), "tokens": stats},
        "shards": shards,
        "energon": {"sample_type": ".".join(tf.SAMPLE_TYPE), "split": {"train": len(shards)}},
        "wall_time_s": round(time.perf_counter() - t_start, 3),
        "run": {"output": str(out), "chunk_samples": cfg.chunk_samples, "chunks": len(chunks), "resumed": resumed,
                "phases": phases, "ray_address": cfg.address or os.environ.get("RAY_ADDRESS") or "local",
                "num_cpus": cfg.num_cpus, "gpus_per_worker": gpus, "workers": len(workers),
                "vq_loads": [w["vq_loads"] for w in workers], "worker_chunks": [w["chunks"] for w in workers],
                "worker_restarts": [w["restarts"] for w in workers]},
    }
    with deferred_interrupt():  # the manifest says "finished": then the work folder goes
        write_json_atomic(out / sf.MANIFEST_NAME, manifest)
        if not cfg.keep_work_dir:
            shutil.rmtree(work, ignore_errors=True)
    if cfg.progress:
        from rich.console import Console

        Console(stderr=True).print(summary_table(manifest, out))
    return manifest


def summary_table(manifest: dict, out: Path | None = None):
    from rich.table import Table

    c, tok = manifest["counts"], manifest["counts"]["tokens"]
    t = Table(title=f"mmdata tokenize-images: {out or manifest['run']['output']}")
    t.add_column("what")
    t.add_column("count", justify="right")
    for label, n in (("samples read", c["read"]), ("samples written", c["written"]),
                     ("  text-only (passed through)", tok["text_only"]), ("samples quarantined", c["quarantined"]),
                     ("images tokenized", tok["images"]), ("visual tokens", tok["visual_tokens"])):
        t.add_row(label, f"{n:,}")
    for reason, n in c["by_reason"].items():
        t.add_row(f"  reason {reason}", f"{n:,}")
    wall = manifest.get("wall_time_s") or 0.0
    t.caption = (f"{plural(len(manifest['shards']), 'shard')} on {manifest['device']}, image area {manifest['image_area']}, "
                 f"VQ {manifest['vision_tokenizer']['fingerprint'][:12]}, {wall:.1f} s "
                 f"({tok['images'] / max(wall, 1e-9):,.1f} images/s)")
    return t

