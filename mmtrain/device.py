"""The CPU adaptation layer for megatron-core: the ONLY place where mmtrain bends megatron to
run without CUDA.

megatron-core hard-codes CUDA in a few places that sit on our model's path
(`torch.cuda.current_device()` as a factory device, `.cuda()` in constructors, `device="cuda"`
factory calls, a CUDA-RNG-based state tracker forked inside attention/embedding dropout and
snapshotted by activation recompute, `torch.cuda.synchronize()` in the dist-checkpoint writer).
`enable_cpu_compat()` redirects exactly those to the CPU when CUDA is absent and does nothing
at all when CUDA is present, so the same model/runtime code runs on a laptop (gloo) and on GPUs
(NCCL). Megatron source is never forked or edited; every substitution is logged once.

Sections:
  1. model-side adaptations (device redirects, CPU RNG tracker). The attention backend is not
     patched: the layer specs pick `SDPACoreAttention` (mmtrain/llava_ov/attention.py).
  2. runtime-side adaptations (schedules, DDP buffers, optimizer) -- owned by the train loop
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

import torch

log = logging.getLogger("mmtrain.device")

_ENABLED = False
#: human-readable list of what was substituted (for logs, dry_run and tests)
SUBSTITUTIONS: list[str] = []


def cuda_available() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """Where model tensors live: the current CUDA device, else the CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _note(what: str) -> None:
    SUBSTITUTIONS.append(what)
    log.info("CPU compat: %s", what)


# ----------------------------------------------------------------------------- section 1: model side


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

    wrapper.__mmtrain_cpu_compat__ = True  # type: ignore[attr-defined]
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


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # `initialize_rng_tracker(force_reset=True)` (called by model_parallel_cuda_manual_seed with
    # force_reset_rng) would build a CUDA tracker; keep ours instead.
    orig_init = mrandom.initialize_rng_tracker
    if not getattr(orig_init, "__mmtrain_cpu_compat__", False):

        @functools.wraps(orig_init)
        def initialize_rng_tracker(*args: Any, force_reset: bool = False, **kwargs: Any) -> None:
            if force_reset or not mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
                mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
                mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

        initialize_rng_tracker.__mmtrain_cpu_compat__ = True  # type: ignore[attr-defined]
        mrandom.initialize_rng_tracker = initialize_rng_tracker

    # activation recompute (`tensor_parallel.checkpoint`) snapshots CPU + CUDA + tracker RNG
    # states to replay dropout; without CUDA there is no CUDA generator: an empty state.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def enable_cpu_compat() -> bool:
    """Apply the model-side CPU adaptations if (and only if) CUDA is absent.

    Idempotent. Returns True when the adaptations are active.
    """
    global _ENABLED
    if cuda_available():
        return False
    if _ENABLED:
        return True

    def _cpu_current_device() -> torch.device:
        return torch.device("cpu")

    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    _note("torch.cuda.current_device() -> cpu")

    def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = _tensor_cuda  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    _note("Tensor.cuda()/Module.cuda() -> no-op (tensors stay on cpu)")

    # torch's `with torch.device(...)` mode (used by transformers' meta-device init) recognises
    # factories by identity from a cached set: fill that cache with the ORIGINAL functions first
    try:
        from torch.utils import _device as torch_device_ctx

        torch_device_ctx._device_constructors()
    except (ImportError, AttributeError):  # older/newer torch without this private helper
        pass
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "__mmtrain_cpu_compat__", False):
            setattr(torch, name, _redirect_device(fn))
    _note(f"torch.{{{','.join(_FACTORIES)}}}(device='cuda') -> device='cpu'")

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    _note("torch.cuda.synchronize() -> no-op (dist-checkpoint writer)")

    _install_cpu_rng_tracker()
    _note("megatron CUDA RNG-states tracker -> CpuRNGStatesTracker (same fork/add semantics); "
          "recompute's CUDA-RNG snapshot -> empty (CPU and tracker states are still replayed)")
    _ENABLED = True
    return True


def is_cpu_compat_enabled() -> bool:
    return _ENABLED


# ----------------------------------------------------------------------------- section 2: runtime side
# (schedules / DDP buffers / optimizer adaptations are added here by the shared train runtime)
# [runtime section, maintained with mmtrain/train_loop.py]
# With section 1 active, megatron's schedules (`total_num_tokens = torch.zeros(..., device="cuda")`)
# and DDP grad buffers (`device=torch.cuda.current_device()`) already land on the CPU. What is
# left for the runtime is configuration, applied by the train loop and listed here so every
# CPU deviation is in one place:
#   - DDP: overlap_grad_reduce / overlap_param_gather off and no distributed optimizer (they
#     need CUDA streams and reduce-scatter, which gloo lacks) -> plain bucketed all-reduce.
#   - optimizer: megatron's wrappers check for torch.cuda tensors -> torch AdamW on main_grad
#     (`mmtrain.optimizer.MainGradAdamW`).
#   - precision: bf16/fp16 requests run in fp32 on CPU.
# None of these apply when CUDA is present.

_RUNTIME_NOTED: set[str] = set()


def note_runtime_substitution(what: str) -> None:
    """Log a runtime-side CPU substitution once per process (and list it in SUBSTITUTIONS)."""
    if cuda_available() or what in _RUNTIME_NOTED:
        return
    _RUNTIME_NOTED.add(what)
    _note(what)


def enable_runtime_cpu_compat() -> bool:
    """Runtime-side CPU adaptations on top of `enable_cpu_compat`; no-op with CUDA. Idempotent.

    Section 1 already covers what the schedules, DDP and activation recompute touch:
    `total_num_tokens` and the p2p shape buffers (`device="cuda"` factories), DDP grad buffers
    (`torch.cuda.current_device()`), the pipeline's shape exchange (`torch.cuda.synchronize()`,
    a no-op: gloo ops are complete when they return) and recompute's CUDA-RNG snapshot. The rest
    is configuration chosen by the train loop (see the list above), logged through
    `note_runtime_substitution`.
    """
    return enable_cpu_compat()
