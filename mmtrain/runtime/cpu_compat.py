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
   pipeline's shape exchange. `apply()` redirects exactly those to the CPU. The lines that force
   them (megatron-core 0.16):
     distributed/param_and_grad_buffer.py:783   torch.zeros(..., device=torch.cuda.current_device(), ...)
     pipeline_parallel/schedules.py:596         total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")
     tensor_parallel/random.py:66               default_generator = torch.cuda.default_generators[idx]
     dist_checkpointing/strategies/filesystem_async.py:230   torch.cuda.synchronize()
   The attention backend is not patched: the layer specs pick `SDPACoreAttention`.
2. Run settings, chosen by the runtime through the functions below:
   - precision: bf16/fp16 requests run in fp32 (`run_precision`);
   - distributed optimizer: off on CPU (`distributed_optimizer`), because megatron's
     `DistributedOptimizer` refuses CPU parameters (see the function for the line).

What is NOT substituted (megatron's own, on CPU as on GPU): megatron DDP with its own settings,
overlapped bucketed grad reduction included (async `allreduce_coalesced` works on gloo; the only
CUDA streams in DDP are for `num_distributed_optimizer_instances > 1`), and megatron's optimizer
(`get_megatron_optimizer` -> FP32Optimizer around torch AdamW when neither TE nor apex is there,
its grad-norm, clipping and dist-checkpoint `sharded_state_dict`). One megatron function is
replaced for that: `clip_grad_by_total_norm_fp32` asserts a CUDA tensor type (see
`_patch_grad_clipping`). gloo in torch 2.13 has reduce-scatter (coalesced too), so the
distributed optimizer's stand-in is forced by megatron's type check alone.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

import torch

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


#: the megatron-core minor versions whose `clip_grad_by_total_norm_fp32` this module replaces
_CLIP_PATCH_VERSIONS = ("0.16.",)


def _clip_grad_by_total_norm_fp32_cpu(parameters: Any, max_norm: float, total_norm: float,
                                      use_decoupled_grad: bool = False) -> None:
    """megatron's `clip_grad_by_total_norm_fp32` less its CUDA type assertion: the same grads, the
    same coefficient, scaled with megatron's own multi-tensor scale (its local fallback on CPU)."""
    from megatron.core.optimizer import clip_grads

    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            assert grad.dtype in (torch.float32, torch.bfloat16), grad.dtype  # the CPU form of megatron's check
            grads.append(clip_grads.to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        overflow = torch.zeros(1, dtype=torch.int)
        clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, overflow, [grads, grads], clip_coeff)


def _patch_grad_clipping() -> None:
    """megatron's optimizer clips through `clip_grad_by_total_norm_fp32`, which asserts a CUDA type
    on every grad (megatron-core 0.16 `optimizer/clip_grads.py:167`):
        assert param.grad.type() == 'torch.cuda.FloatTensor'
    Both callers (`MegatronOptimizer.clip_grad_norm`, `ChainedOptimizer.step`) use the name bound in
    `megatron.core.optimizer.optimizer`; that binding is replaced, version-gated."""
    from megatron.core import package_info
    from megatron.core.optimizer import optimizer as moptimizer

    version = package_info.__version__
    if not version.startswith(_CLIP_PATCH_VERSIONS):
        raise RuntimeError(f"cpu_compat replaces megatron-core's clip_grad_by_total_norm_fp32 for "
                           f"{_CLIP_PATCH_VERSIONS}, found {version}: re-check clip_grads.py and this patch")
    _patch(moptimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu)


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
    _patch_grad_clipping()
    note("megatron clip_grad_by_total_norm_fp32 -> the same clipping without its torch.cuda.FloatTensor "
         "assertion (megatron's optimizer runs on CPU)")
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
    """megatron's distributed optimizer refuses CPU parameters; off on CPU.

    megatron-core 0.16 `optimizer/distrib_optimizer.py:420`, building the shard groups:
        elif model_param.type() == 'torch.cuda.FloatTensor':
        ...
        else:
            raise TypeError('Wrapped parameters must be one of torch.cuda.FloatTensor, ...')
    (gloo itself would do: torch 2.13's gloo has `reduce_scatter_tensor`, coalesced too.)"""
    if device.type == "cpu" and requested:
        note("distributed optimizer -> off (megatron's DistributedOptimizer accepts only torch.cuda "
             "parameter types); optimizer states are replicated over DP")
        return False
    return requested
