"""The recipe's shared sections (dataclasses) and their defaults: the one place each default is
written. The family-specific sections are the family's own dataclasses (`FamilySpec`):
`model:` entirely, `data:` as a subclass of `DataConfig` adding the family's loader keys.

Every key, with meaning and default: docs/recipes.md (tests/test_cli_ux.py checks that its
tables agree with the defaults here). Fields holding a local path carry `PATH` metadata: the
resolved recipe (`<run_dir>/config.yaml`) writes them absolute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mmtrain.planning.cost_model import PEAK_TFLOPS

Action = Literal["run", "dry_run", "auto_tune", "print_config"]
Decay = Literal["cosine", "linear", "constant"]
Recompute = Literal["none", "full", "selective"]
Precision = Literal["fp32", "bf16"]
Backend = Literal["auto", "nccl", "gloo"]
Sharding = Literal["dp", "replicated"]

RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
#: dataclass field metadata of a local path (or a list of them): written absolute when saved
PATH = {"path": True}


@dataclass
class DataConfig:
    """Where the shards are and how the loader streams them (mmdata.energon_loaders)."""

    paths: list[str] = field(default_factory=list, metadata=PATH)  # shard dirs, or one energon metadataset YAML
    num_workers: int = 2
    # true: online packing over a buffer; false: one sample per row; "plan": the offline plan of
    # `mmdata pack-plan` (exact and reproducible; one shard dir; mmdata.energon_loaders.plan_packing)
    packing: bool | Literal["plan"] = True
    packing_plan: str | None = field(default=None, metadata=PATH)  # null: <paths[0]>/pack-plan-<seq_length>.parquet
    packing_buffer_size: int = 256  # = mmdata.energon_loaders.packing.DEFAULT_PACKING_BUFFER
    shuffle_buffer_size: int = 100
    # how DP ranks split the stream:
    #   "dp": energon's own per-DP-rank sharding (scales; loader state is tied to the DP size)
    #   "replicated": every rank reads the single-process stream and keeps its share of each
    #   global batch (identical batches for any TP/PP/DP layout, resumable across DP sizes;
    #   costs dp x the decoding work - for tests, layout changes and small DP)
    sharding: Sharding = "dp"
    # held-out shard dirs (or one metadataset YAML) for `train.eval_interval`; read with the
    # same loader settings, the recipe's seed and no state carried between evaluations
    val_paths: list[str] = field(default_factory=list, metadata=PATH)


@dataclass
class TokenizerConfig:
    path: str | None = field(default=None, metadata=PATH)  # local HF tokenizer dir; required for action=run


@dataclass
class TrainConfig:
    iters: int = 1000
    seq_length: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int = 1
    eval_interval: int = 0  # steps between evaluations on data.val_paths; 0 = no evaluation
    eval_iters: int = 4  # global batches per evaluation


@dataclass
class OptimizerConfig:
    """AdamW + LR schedule. `lr_mult` scales the peak (and floor) LR of the family's parts."""

    lr: float = 1.0e-5
    min_lr: float = 0.0
    lr_mult: dict[str, float] = field(default_factory=dict)  # {part: multiplier}; others 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0  # 0 = no clipping
    warmup_fraction: float = 0.03
    decay: Decay = "cosine"


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    precision: Precision = "fp32"
    distributed_optimizer: bool = True
    backend: Backend = "auto"

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def dp(self) -> int:
        """Data-parallel size (only meaningful once the recipe validated)."""
        return self.world_size // (self.tp * self.pp)


@dataclass
class CheckpointConfig:
    interval: int = 1000  # save every N steps (and at the end); 0 = only at the end
    keep_last: int = 2  # 0 = keep all
    load: str | None = field(default=None, metadata=PATH)  # checkpoint dir (or HF dir) to start from
    # take only the model weights from `load` (fresh optimizer, schedule, step, data), as a new
    # training stage does; a run that has its own checkpoints in run_dir always resumes them
    weights_only: bool = False


@dataclass
class LoggingConfig:
    interval: int = 1
    tensorboard: bool = False  # also TensorBoard scalars (needs the `tensorboard` package)


@dataclass
class AutoTuneConfig:
    """Search space and device model for `action: auto_tune` (mmtrain/planning/auto_tune.py).

    Empty candidate lists mean "every valid value"."""

    device_memory_gb: float = 80.0
    memory_fraction: float = 0.9  # usable share of device memory (allocator, fragmentation)
    # peak dense TFLOP/s per device in the recipe's precision (default: H100 bf16)
    device_tflops: float = PEAK_TFLOPS["H100"]["bf16"]
    matmul_efficiency: float = 0.6  # achievable share of the peak (time model only)
    tp_bandwidth_gbps: float = 450.0  # per-device bandwidth of the TP group (NVLink), GB/s
    dp_bandwidth_gbps: float = 25.0  # per-device bandwidth for DP gradient traffic, GB/s
    tp: list[int] = field(default_factory=list)
    pp: list[int] = field(default_factory=list)
    micro_batch_size: list[int] = field(default_factory=list)
    recompute: list[Recompute] = field(default_factory=list)
    top: int = 10  # rows in the printed table
    # share of LLM positions that are media features; sizes the encoder activations in dry_run
    # and auto_tune (1.0 = worst case, every position a media feature)
    media_token_fraction: float = 1.0


@dataclass(kw_only=True)
class Recipe:
    """A whole, validated recipe. `model` and `data` are instances of the family's classes."""

    action: Action = "run"
    family: str
    run_dir: str = field(metadata=PATH)
    seed: int = 1234
    stage: str | None = None
    model: Any
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    freeze: list[str] = field(default_factory=list)  # the family's parts that do not train
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    auto_tune: AutoTuneConfig = field(default_factory=AutoTuneConfig)
