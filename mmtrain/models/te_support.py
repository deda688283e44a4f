"""Is Transformer Engine really usable here? One answer for every caller.

megatron-core 0.16 imports TE inside `megatron.core.extensions.transformer_engine` and, when that
import fails, binds `te = MagicMock()` and `HAVE_TE = False` instead of raising: importing
`TEDotProductAttention` from there *always* succeeds, and the "class" is a mock that fails only when
a model is built. So "the import worked" is not "TE is here". We ask `import transformer_engine`
ourselves (keeping the real error, e.g. a wheel built against another torch ABI) and check that
megatron agrees (`HAVE_TE`) and that its TE classes are real classes.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TEStatus:
    available: bool
    version: Optional[str]  # transformer_engine.__version__ when importable
    reason: str  # why not available ("" when it is)

    def version_tuple(self) -> tuple[int, ...]:
        """(major, minor, patch) of the TE version, () when unknown."""
        if not self.version:
            return ()
        parts = []
        for piece in self.version.split("+")[0].split(".")[:3]:
            digits = "".join(ch for ch in piece if ch.isdigit())
            if not digits:
                break
            parts.append(int(digits))
        return tuple(parts)


@functools.lru_cache(maxsize=1)
def te_status() -> TEStatus:
    """Transformer Engine as megatron will see it (cached: imports are process-wide)."""
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # ImportError, or an ABI/OSError from the compiled extension
        return TEStatus(False, None, f"import transformer_engine failed: {type(err).__name__}: {err}")
    version = str(getattr(te, "__version__", "") or "") or None
    try:
        mte = importlib.import_module("megatron.core.extensions.transformer_engine")
    except Exception as err:
        return TEStatus(False, version, f"megatron's TE extension failed to import: {type(err).__name__}: {err}")
    if not getattr(mte, "HAVE_TE", False):
        return TEStatus(False, version, "megatron.core.extensions.transformer_engine.HAVE_TE is False")
    if not isinstance(getattr(mte, "TEDotProductAttention", None), type):
        return TEStatus(False, version, "megatron's TEDotProductAttention is not a class (a mock?)")
    return TEStatus(True, version, "")


def have_te() -> bool:
    return te_status().available


#: apex's C++/CUDA extension behind megatron's local `gradient_accumulation_fusion`
APEX_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"


def apex_wgrad_fusion_available() -> bool:
    """Does apex's `fused_weight_gradient_mlp_cuda` import? megatron's *local*
    `ColumnParallelLinear` (GPTModel's output layer, whatever the layer spec) raises at build
    with `gradient_accumulation_fusion` on unless it does (mcore 0.16.1
    tensor_parallel/layers.py:44-48 import, :924-933 raise); pip cannot install apex. Asked the
    way megatron asks (import, ImportError means no), not cached: called once per model build."""
    try:
        importlib.import_module(APEX_WGRAD_MODULE)
    except ImportError:
        return False
    return True


def te_dot_product_attention() -> Optional[type]:
    """megatron's `TEDotProductAttention` class, or None without a real TE."""
    if not have_te():
        return None
    # optional dependency, asked for only once te_status() found a real TE
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention
