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

from mmtrain.models.hardware import DEFAULT_DEVICE_TFLOPS

Action = Literal["run", "dry_run", "auto_tune", "print_config"]
Decay = Literal["cosine", "linear", "constant"]
Recompute = Literal["none", "full", "selective"]
Precision = Literal["fp32", "bf16"]
Backend = Literal["auto", "nccl", "gloo"]
Sharding = Literal["dp", "replicated", "global"]
CPComm = Literal["p2p", "all_gather", "a2a", "a2a+p2p"]  # megatron's names (TE attention, GPU)
LMLoss = Literal["auto", "fused", "chunked", "plain"]
TransformerImpl = Literal["local", "transformer_engine"]  # megatron's names for the decoder's layer spec

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
    # train with a plan (packing: plan) or a global order (sharding: global) made from estimated
    # text lengths (shards preprocessed without --tokenizer): rows overflow, samples are carried to
    # later rows or skipped (counted); under the global order a sample carried at a checkpoint
    # trains only in a later epoch (lost from this one). Refused otherwise
    plan_allow_estimated_lengths: bool = False
    packing_buffer_size: int = 256  # = mmdata.energon_loaders.packing.DEFAULT_PACKING_BUFFER
    shuffle_buffer_size: int = 100
    # how DP ranks split the stream:
    #   "dp": energon's own per-DP-rank sharding (scales; loader state is tied to the DP size)
    #   "replicated": every rank reads the single-process stream and keeps its share of each
    #   global batch (identical batches for any TP/PP/DP layout, resumable across DP sizes;
    #   costs dp x the decoding work - for tests, layout changes and small DP)
    #   "global": one global data order planned from the length index (mmdata.global_order):
    #   step t's rows are the same at any DP size, micro-batch and worker count, each rank reads
    #   only its own rows, and a checkpoint resumes exactly at another layout (docs/loaders.md)
    sharding: Sharding = "dp"
    # `sharding: global` only: the mixture of data.paths (named by folder basename), e.g.
    # {weights: {a: 3, b: 1}} or {schedule: [{step: 0, weights: {...}}, ...], ramp: linear,
    # unit: tokens}; null = equal weights. mmdata.global_order.blend.Blend.parse
    blend: dict[str, Any] | None = None
    # `sharding: global` only: steps planned together (their rows cut into cost tiers, one per
    # step); "auto" = ceil(64 / global_batch_size), which depends on no layout
    order_window: int | Literal["auto"] = "auto"
    # vision-aware balancing: each step's packed rows are spread over the DP ranks and the
    # micro-batches by cost, tokens + the vision tower's tiles (rows move between DP ranks; what a
    # sample contributes is unchanged). With packing: plan, the plan must be balanced for the
    # recipe's step shape (`mmtrain pack-plan RECIPE`). mmdata.packing.balance
    balance: bool = False
    # online balancing draws this many steps at once and spreads their rows over the steps as well
    # as the ranks (at one row per rank per step one step's rows cannot be evened; a window's can):
    # "auto" = 8 rows per rank (8 steps at one row per rank, 1 from 8). Rows train up to this many
    # steps from where they were drawn; exact resume holds. mmdata.packing.balance.assign_window
    balance_window: int | Literal["auto"] = "auto"
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
    # Stop early (checkpoint saved, exit 0), as Megatron's --exit-interval / --exit-duration-in-mins:
    # a rerun of the same recipe resumes. 0 = off. SIGTERM does the same (docs/reliability.md).
    exit_interval: int = 0  # stop after the step whose number is a multiple of this
    exit_duration_mins: float = 0.0  # stop after the first step that ends past this wall time
    # bit-reproducible steps at some speed cost: torch deterministic algorithms, cuBLAS workspace
    # config, megatron's deterministic_mode and TE's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
    deterministic: bool = False


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
class VisionParallelConfig:
    """The vision tower's own parallel layout (mmtrain/models/encoder_parallel.py)."""

    # null: the language model's (TP-sharded like it; under CP each rank encodes its chunk's media);
    # 1: a whole tower per rank, the micro-batch's tiles split over the TP x CP group and the
    # outputs all-gathered; parallel.tp: sharded like the language model, the tiles split over CP
    tp: int | None = None


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    # decoder layers per pipeline stage (pp numbers; or pp*vpp, per virtual stage in megatron's chunk
    # order), summing to the decoder's layers: e.g. fewer on the first stage, which also runs the
    # vision tower. Empty = megatron's even split (mmtrain/models/pipeline_split.py)
    pp_layers: list[int] = field(default_factory=list)
    vpp: int = 1  # virtual pipeline stages (model chunks) per rank: megatron's interleaved 1F1B when > 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks (megatron's 2*cp chunks)
    # how the CP ranks exchange K/V (GPU, megatron/TE names); on CPU K/V are all-gathered over gloo
    cp_comm_type: CPComm = "p2p"
    hierarchical_cp_sizes: list[int] = field(default_factory=list)  # a2a+p2p: [a2a size, p2p size]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    # with recompute full: 0 = every layer; N = only the first N layers of each pipeline stage
    # (megatron's block method: less recompute, more memory)
    recompute_num_layers: int = 0
    precision: Precision = "fp32"
    distributed_optimizer: bool = True
    backend: Backend = "auto"
    # the LM loss: auto (a fused GPU kernel when installed and tp == 1, else chunked), fused,
    # chunked (blocked output projection + cross entropy, no full logits), plain (full logits)
    lm_loss: LMLoss = "auto"
    lm_loss_block_mb: int = 256  # MiB of logits one block of the chunked loss may hold
    # the decoder's layer spec: local (torch/megatron modules, any device) or transformer_engine
    # (TE fused norm+linear, fused THD RoPE, wgrad fusion; CUDA with TE only). Off by default
    # until the gpu test tier has passed with it on a device (docs/gpu.md)
    transformer_impl: TransformerImpl = "local"
    # a collective that waits longer fails (the rank's peer died or hangs), and the job exits
    collective_timeout_mins: float = 30.0
    vision: VisionParallelConfig = field(default_factory=VisionParallelConfig)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one replica of the model and its data: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel size (only meaningful once the recipe validated)."""
        return self.world_size // self.model_parallel


@dataclass
class CheckpointConfig:
    interval: int = 1000  # save every N steps (and at the end); 0 = only at the end
    keep_last: int = 2  # 0 = keep all
    load: str | None = field(default=None, metadata=PATH)  # checkpoint dir (or HF dir) to start from
    save: bool = True  # false: write no checkpoint at all (auto-tune trials, throughput runs)
    # take only the model weights from `load` (fresh optimizer, schedule, step, data), as a new
    # training stage does; a run that has its own checkpoints in run_dir always resumes them
    weights_only: bool = False
    # resume a checkpoint whose data (paths, blend, seq_length, packing...) differs from the
    # recipe's: weights, optimizer and step resume, the loader starts fresh from its seed
    # (without it such a resume is refused: mmtrain/runtime/checkpoint/data_identity.py)
    reset_data: bool = False


@dataclass
class LoggingConfig:
    interval: int = 1
    tensorboard: bool = False  # also TensorBoard scalars (needs the `tensorboard` package)


@dataclass
class AutoTuneConfig:
    """Search space, device model and trial budget for `action: auto_tune`
    (mmtrain/planning/auto_tune.py; the dimensions: mmtrain/planning/search_space.py).

    Empty candidate lists mean "auto": every valid value for the world size and the model."""

    device_memory_gb: float = 80.0
    memory_fraction: float = 0.9  # usable share of device memory (allocator, fragmentation)
    # peak dense TFLOP/s per device in the recipe's precision (default: H100 bf16)
    device_tflops: float = DEFAULT_DEVICE_TFLOPS
    matmul_efficiency: float = 0.6  # achievable share of the peak (time model only)
    tp_bandwidth_gbps: float = 450.0  # per-device bandwidth of the TP group (NVLink), GB/s
    dp_bandwidth_gbps: float = 25.0  # per-device bandwidth for DP gradient traffic, GB/s
    tp: list[int] = field(default_factory=list)
    pp: list[int] = field(default_factory=list)
    vpp: list[int] = field(default_factory=list)  # auto: 1, 2, 4 where the layers and micro-batches allow
    cp: list[int] = field(default_factory=list)
    micro_batch_size: list[int] = field(default_factory=list)
    recompute: list[Recompute] = field(default_factory=list)
    recompute_num_layers: list[int] = field(default_factory=list)  # auto: 0 (all), 1/4 and 1/2 of the layers
    sequence_parallel: list[bool] = field(default_factory=list)  # auto: both where tp > 1
    # auto: both on CUDA where dp > 1; the recipe's value on CPU (the substitute does not shard)
    distributed_optimizer: list[bool] = field(default_factory=list)
    # the vision tower's layout (parallel.vision.tp; null = the language model's); auto: null and 1
    # where tp x cp > 1 and the family has a media encoder
    vision_tp: list[int | None] = field(default_factory=list)
    # the utilisation band's lower edge: layouts whose estimate uses less than this share of
    # device_memory_gb are pruned as wasteful (FlagScale: 0.2); 0 keeps them
    min_memory_fraction: float = 0.0
    max_trials: int = 8  # trial runs of the real job; 0 = rank with the cost model only
    max_minutes: float = 60.0  # wall-clock budget of the whole search
    trial_steps: int = 6  # optimizer steps per trial
    warmup_steps: int = 2  # first steps of a trial left out of its tokens/s
    trial_timeout_s: float = 600.0  # a trial still running after this is killed (status timeout)
    # history pruning: skip a layout when even its best case (the model scaled by the smallest
    # measured/modelled ratio so far) is this much slower than the best measured one
    slow_margin: float = 0.1
    # per-machine calibration (written by a search as <run_dir>/auto_tune/calibration.yaml):
    # scales the model's memory and step time in dry_run and auto_tune
    calibration: str | None = field(default=None, metadata=PATH)
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
