"""Every CPU adaptation of megatron-core in one module: the ONLY place where mmtrain bends megatron
to run without CUDA. With CUDA present each function here does nothing, so the same model and
runtime code runs on a laptop (gloo) and on GPUs (NCCL). Megatron source is never forked or
edited; every substitution is logged once and listed in `SUBSTITUTIONS`.

1. Process-wide patches (`apply`, undone by `revert`), applied by the runtime's process set-up
   (`runtime.distributed`) and nowhere else. megatron-core hard-codes CUDA in a few places on our
   model's path: `torch.cuda.current_device()` as a factory device, `.cuda()` in constructors,
   `device="cuda"` factory calls (schedules' token counts, p2p shape buffers, DDP grad buffers),
   a CUDA-RNG-based state tracker forked inside attention/embedding dropout and snapshotted by
   activation recompute, `torch.cuda.synchronize()` in the dist-checkpoint writer and the
   pipeline's shape exchange. `apply()` redirects exactly those to the CPU.
   The attention backend is not patched: the layer specs pick `SDPACoreAttention`.
2. Run settings, chosen by the runtime through the functions below:
   - precision: bf16/fp16 requests run in fp32 (`run_precision`);
   - DDP: no overlapped grad reduce and no distributed optimizer (they need CUDA streams and
     reduce-scatter, which gloo lacks) -> plain bucketed all-reduce (`adapt_ddp_config`,
     `distributed_optimizer`);
   - optimizer: megatron's wrappers refuse CPU tensors -> `MainGradAdamW`, torch AdamW on the
     fp32 `param.main_grad` buffers megatron DDP fills, with megatron's TP/PP-aware clipping.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: human-readable list of what was substituted (for logs, dry_run and tests)
SUBSTITUTIONS: list[str] = []
_NOTED: set[str] = set()

#: (object, attribute, original value) of every active patch, in the order applied
_PATCHES: list[tuple[Any, str, Any]] = []
#: the CPU RNG tracker, kept across revert/apply so its named streams survive a re-apply
_TRACKER: "CpuRNGStatesTracker | None" = None


def cuda_available() -> bool:
    return torch.cuda.is_available()


def note(what: str, level: int = logging.INFO) -> None:
    """Log a CPU substitution once per process (and list it in SUBSTITUTIONS)."""
    if what in _NOTED:
        return
    _NOTED.add(what)
    SUBSTITUTIONS.append(what)
    log.log(level, "CPU compat: %s", what)


# ----------------------------------------------------------------------------- 1. patches


def _patch(obj: Any, name: str, value: Any) -> None:
    _PATCHES.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # a bare int device means "cuda:<int>" to torch factories
    return isinstance(device, int) and not isinstance(device, bool)


def _redirect_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


#: torch factories megatron calls with device="cuda" / device=torch.cuda.current_device()
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor", "randperm",
)  # fmt: skip


class CpuRNGStatesTracker:
    """megatron's RNG-states tracker on the CPU generator.

    Same contract as `megatron.core.tensor_parallel.random.CudaRNGStatesTracker` (named states
    seeded by `add`, swapped in by `fork`) so `model_parallel_cuda_manual_seed` keeps its
    meaning: dropout inside TP regions draws from a per-TP-rank stream, outside from the default.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _patch_rng_tracker() -> None:
    global _TRACKER
    from megatron.core.tensor_parallel import random as mrandom

    if _TRACKER is None:
        _TRACKER = CpuRNGStatesTracker()

    def initialize_rng_tracker(*args: Any, force_reset: bool = False, **kwargs: Any) -> None:
        # `model_parallel_cuda_manual_seed(force_reset_rng=True)` would build a CUDA tracker
        global _TRACKER
        if force_reset:
            _TRACKER = CpuRNGStatesTracker()
            mrandom._CUDA_RNG_STATE_TRACKER = _TRACKER

    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER", _TRACKER)
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    _patch(mrandom, "initialize_rng_tracker", initialize_rng_tracker)
    # activation recompute (`tensor_parallel.checkpoint`) snapshots CPU + CUDA + tracker RNG
    # states to replay dropout; without CUDA there is no CUDA generator: an empty state.
    _patch(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8))
    _patch(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)


def apply() -> bool:
    """Apply the process-wide patches if (and only if) CUDA is absent. Idempotent; returns True
    when the patches are active. Called by `runtime.distributed` when it brings megatron up."""
    if cuda_available():
        return False
    if _PATCHES:
        return True
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    note("torch.cuda.current_device() -> cpu")
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _patch(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    note("Tensor.cuda()/Module.cuda() -> no-op (tensors stay on cpu)")
    # torch's `with torch.device(...)` mode (used by transformers' meta-device init) recognises
    # factories by identity from a cached set: fill that cache with the ORIGINAL functions first
    try:
        from torch.utils import _device as torch_device_ctx

        torch_device_ctx._device_constructors()
    except (ImportError, AttributeError):  # older/newer torch without this private helper
        pass
    for name in _FACTORIES:
        _patch(torch, name, _redirect_device(getattr(torch, name)))
    note(f"torch.{{{','.join(_FACTORIES)}}}(device='cuda') -> device='cpu'")
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)
    note("torch.cuda.synchronize() -> no-op (gloo ops are complete when they return)")
    _patch_rng_tracker()
    note("megatron CUDA RNG-states tracker -> CpuRNGStatesTracker (same fork/add semantics); "
         "recompute's CUDA-RNG snapshot -> empty (CPU and tracker states are still replayed)")
    return True


def revert() -> None:
    """Undo every patch (test isolation; a process that trained keeps them until it exits)."""
    while _PATCHES:
        obj, name, original = _PATCHES.pop()
        setattr(obj, name, original)


def active() -> bool:
    return bool(_PATCHES)


# ----------------------------------------------------------------------------- 2. run settings


def run_precision(requested: str, device: torch.device) -> str:
    """The precision a run uses: as requested on GPU, fp32 on CPU."""
    if device.type == "cpu" and requested != "fp32":
        note(f"precision {requested} requested on CPU -> training runs in fp32", logging.WARNING)
        return "fp32"
    return requested


def distributed_optimizer(requested: bool, device: torch.device) -> bool:
    """megatron's distributed optimizer needs CUDA (reduce-scatter over NCCL)."""
    if device.type == "cpu" and requested:
        note("distributed optimizer -> off (CUDA-only); optimizer states are replicated over DP")
        return False
    return requested


def adapt_ddp_config(ddp_kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """megatron DDP's settings on CPU: no overlapped grad reduce (CUDA streams)."""
    if device.type == "cpu":
        ddp_kwargs = dict(ddp_kwargs, overlap_grad_reduce=False)
        note("DDP: overlap_grad_reduce off (CUDA streams) -> bucketed all-reduce of fp32 main_grad over gloo")
    return ddp_kwargs


class MainGradAdamW:
    """CPU substitute for megatron's optimizer wrapper (same calls the train loop makes:
    `step() -> (ok, grad_norm, num_zeros)`, `zero_grad`, `param_groups`, `sharded_state_dict`,
    `load_sharded`).

    `torch.optim.AdamW` stepping on the fp32 `param.main_grad` buffers that megatron DDP fills,
    with global-norm clipping across TP/PP (TP-duplicated and shared params counted once, like
    megatron). Its state is saved through dist-checkpointing with the same sharding as the
    parameters, so it re-shards to another TP/PP layout like the model does."""

    def __init__(self, param_groups: list[dict[str, Any]], optimizer_cfg: Any) -> None:
        note("optimizer: megatron get_megatron_optimizer (CUDA-only) -> torch.optim.AdamW on "
             "param.main_grad with TP/PP-aware global-norm clipping (MainGradAdamW)")
        self.clip_grad = optimizer_cfg.clip_grad
        self.optimizer = torch.optim.AdamW(
            param_groups,
            lr=optimizer_cfg.lr,
            betas=(optimizer_cfg.adam_beta1, optimizer_cfg.adam_beta2),
            eps=optimizer_cfg.adam_eps,
            weight_decay=optimizer_cfg.weight_decay,
            foreach=False,
        )
        self._init_state()

    # -- the megatron-optimizer surface the loop uses -------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            p.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        params = list(self.parameters())
        grad_norm = self.grad_norm(params)
        if not math.isfinite(grad_norm):
            log.warning("non-finite grad norm %s: skipping the update", grad_norm)
            return False, grad_norm, None
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            coeff = self.clip_grad / (grad_norm + 1.0e-6)
            for p in params:
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.mul_(coeff)
        for p in params:
            main_grad = getattr(p, "main_grad", None)
            p.grad = None if main_grad is None else main_grad.to(p.dtype)
        self.optimizer.step()
        for p in params:
            p.grad = None
        return True, grad_norm, None

    @torch.no_grad()
    def grad_norm(self, params: list[torch.nn.Parameter]) -> float:
        """L2 norm of the full (unsharded) gradient: local squares of params that are neither
        TP duplicates nor the second copy of a shared (tied) weight, summed over TP x PP."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        total = torch.zeros((), dtype=torch.float64)
        for p in params:
            grad = getattr(p, "main_grad", None)
            if grad is None:
                continue
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                total += grad.detach().double().pow(2).sum()
        group = parallel_state.get_model_parallel_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        return float(total.sqrt())

    # -- state ---------------------------------------------------------------------------
    def _init_state(self) -> None:
        """Materialise AdamW's state (zeros, step 0) so that a fresh optimizer and a loaded one
        have the same structure (dist-checkpointing loads into existing tensors)."""
        for p in self.parameters():
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def sharded_state_dict(
        self, model_sharded_state_dict: dict[str, Any], is_loading: bool = False
    ) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        state_dict = self.optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.parameters())
        steps = {float(s["step"]) for s in state_dict["state"].values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"optimizer steps differ across params: {sorted(steps)}")
        optim_state_to_sharding_state(state_dict, id_map, exclude_keys=("step",))
        # param groups are rebuilt from the recipe (the schedule re-sets lr/wd per step), so only
        # the per-parameter moments and the shared step count are persisted.
        return {"state": state_dict["state"], "common_step": steps.pop() if steps else 0.0}

    def load_sharded(self, loaded: dict[str, Any]) -> None:
        step = torch.tensor(float(loaded.get("common_step", 0.0)))
        current = self.optimizer.state_dict()
        new_state = {}
        for pid, tensors in loaded["state"].items():
            entry = dict(tensors)
            entry["step"] = step.clone()
            new_state[int(pid)] = entry
        current["state"] = new_state
        self.optimizer.load_state_dict(current)
