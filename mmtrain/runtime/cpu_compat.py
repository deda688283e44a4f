"""Every CPU adaptation of megatron-core in one module; with CUDA present each function does nothing.
Design notes: docs/gpu.md, "cpu_compat: megatron-core without CUDA"."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable

import torch
from megatron.core import package_info
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as moptimizer
from megatron.core.tensor_parallel import random as mrandom

try:  # torch's private helper behind `with torch.device(...)`; older/newer torch may lack it
    from torch.utils import _device as torch_device_ctx
except ImportError:
    torch_device_ctx = None  # type: ignore[assignment]  # (a torch without it: nothing to fill)

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


def _clip_grad_by_total_norm_fp32_cpu(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """megatron's `clip_grad_by_total_norm_fp32` less its CUDA type assertion: the same grads, the
    same coefficient, scaled with megatron's own multi-tensor scale (its local fallback on CPU)."""
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
    version = package_info.__version__
    if not version.startswith(_CLIP_PATCH_VERSIONS):
        raise RuntimeError(
            f"cpu_compat replaces megatron-core's clip_grad_by_total_norm_fp32 for "
            f"{_CLIP_PATCH_VERSIONS}, found {version}: re-check clip_grads.py and this patch"
        )
    _patch(moptimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu)


#: the megatron-core minor versions whose optimizer constructors `optimizer_type_checks` answers
_TYPE_CHECK_VERSIONS = ("0.16.",)
#: what `param.type()` says for a CUDA parameter of each dtype the CPU trains in (fp32, bf16)
_CUDA_TYPE_STRINGS = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor"}


def _check_type_check_version() -> None:
    version = package_info.__version__
    if not version.startswith(_TYPE_CHECK_VERSIONS):
        raise RuntimeError(
            f"cpu_compat answers megatron-core's optimizer type checks for {_TYPE_CHECK_VERSIONS}, "
            f"found {version}: re-check optimizer.py and distrib_optimizer.py and this answer"
        )


@contextlib.contextmanager
def optimizer_type_checks(device: torch.device):
    """While megatron's mixed-precision and distributed optimizers are built on a CPU run, a CPU
    fp32 or bf16 *parameter* answers `param.type()` with its CUDA type string; nothing else
    changes (no argument, no other tensor, no other dtype, no other time, not on CUDA).

    Those constructors sort the parameters by type string and raise on anything else
    (megatron-core 0.16):
        optimizer/optimizer.py:671          if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:
        optimizer/optimizer.py:690          elif param.type() == 'torch.cuda.FloatTensor':
        optimizer/optimizer.py:695          raise TypeError('Wrapped parameters must be one of
        torch.cuda.FloatTensor, ...')
        optimizer/distrib_optimizer.py:582  if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:
        optimizer/distrib_optimizer.py:361  if model_param.type() in ['torch.cuda.HalfTensor',
        'torch.cuda.BFloat16Tensor']:
        optimizer/distrib_optimizer.py:420  elif model_param.type() == 'torch.cuda.FloatTensor':
        optimizer/distrib_optimizer.py:431  raise TypeError('Wrapped parameters must be one of
        torch.cuda.FloatTensor, ...')
    `Float16OptimizerWithFloat16Params` (bf16 params, fp32 main copies) and `DistributedOptimizer`
    (sharded fp32 main params) then run their own code on CPU tensors; gloo has the
    reduce-scatter and all-gather they need. The step's one other check, the grad clipping's
    type assertion, is `_patch_grad_clipping`'s."""
    if device.type != "cpu":
        yield
        return
    _check_type_check_version()
    cpu_type = torch._C.TensorBase.type
    assert "type" not in torch.Tensor.__dict__, "torch.Tensor.type is already replaced"

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and isinstance(self, torch.nn.Parameter) and self.device.type == "cpu":
            answer = _CUDA_TYPE_STRINGS.get(self.dtype)
            if answer is not None:
                return answer
        return cpu_type(self, dtype, non_blocking, **kwargs) if dtype is not None else cpu_type(self, **kwargs)

    note(
        "megatron optimizer construction: a CPU fp32/bf16 parameter's type() -> its torch.cuda type string "
        "(Float16OptimizerWithFloat16Params and DistributedOptimizer sort parameters by that string)"
    )
    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del torch.Tensor.type


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
    if torch_device_ctx is not None and hasattr(torch_device_ctx, "_device_constructors"):
        torch_device_ctx._device_constructors()
    for name in _FACTORIES:
        _patch(torch, name, _redirect_device(getattr(torch, name)))
    note(f"torch.{{{','.join(_FACTORIES)}}}(device='cuda') -> device='cpu'")
    _patch(torch.cuda, "synchronize", lambda *a, **k: None)
    note("torch.cuda.synchronize() -> no-op (gloo ops are complete when they return)")
    _patch_grad_clipping()
    note(
        "megatron clip_grad_by_total_norm_fp32 -> the same clipping without its torch.cuda.FloatTensor "
        "assertion (megatron's optimizer runs on CPU)"
    )
    _patch_rng_tracker()
    note(
        "megatron CUDA RNG-states tracker -> CpuRNGStatesTracker (same fork/add semantics); "
        "recompute's CUDA-RNG snapshot -> empty (CPU and tracker states are still replayed)"
    )
    return True


def revert() -> None:
    """Undo every patch (test isolation; a process that trained keeps them until it exits)."""
    while _PATCHES:
        obj, name, original = _PATCHES.pop()
        setattr(obj, name, original)


def active() -> bool:
    return bool(_PATCHES)
