"""Every private name of another library that mmtrain uses, each behind a gate that fails loudly
(naming the installed version) and a test (tests/test_private_api.py); nothing else in mmtrain
reaches a private name (tests/test_private_names.py). Not yet here: the CPU adaptations'
(runtime/cpu_compat.py, pinned in that test with their own megatron version check).

- megatron-core's torch_dist checkpoint writer collects its workers' results through a queue it
  keeps in `megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue`
  (created at the first save by `_get_write_results_queue()`, from a `spawn` multiprocessing
  manager that megatron never stops). `runtime/child_processes.install_writer_results_queue` puts
  its own queue there, from a manager that dies with the training process, so a SIGKILLed
  trainer leaves nothing behind. megatron has no public way to pass that queue, so the name is
  used only for the minor version pyproject.toml pins (megatron-core>=0.16,<0.17):
  `require_tested_megatron()` refuses any other, naming it.
- torch's CPU flash-attention kernels, `aten::_scaled_dot_product_flash_attention_for_cpu` and
  its backward (models/cp_attention.py): the only CPU kernels that return the log-sum-exp that
  context parallelism merges chunks by. Gated by their schemas (the signature cp_attention calls
  them with), which is what a torch release would change: `cpu_flash_attention()` refuses any
  other, naming the torch version.
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async

TESTED_MEGATRON = "0.16"  # the minor version pyproject.toml pins and CI runs
RESULTS_QUEUE = "_results_queue"  # filesystem_async's module-level queue (see the module docstring)

#: aten's CPU flash-attention forward and backward, with the schemas cp_attention calls (torch 2.13)
CPU_FLASH_ATTENTION_SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, "
        "float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) "
        "-> (Tensor output, Tensor logsumexp)"
    ),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key, "
        "Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, "
        "float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)"
    ),
}


def require_tested_megatron(installed: str | None = None) -> None:
    """Raise RuntimeError, naming the installed version, unless megatron-core is the tested minor
    version. `installed`: the version to judge (default: the installed distribution's)."""
    version = installed if installed is not None else metadata.version("megatron-core")
    if version.split(".")[:2] != TESTED_MEGATRON.split("."):
        major, minor = TESTED_MEGATRON.split(".")
        raise RuntimeError(
            f"megatron-core {version} is installed, but mmtrain sets megatron's private "
            f"filesystem_async.{RESULTS_QUEUE} as megatron-core {TESTED_MEGATRON}.x keeps it: "
            f"install 'megatron-core>={TESTED_MEGATRON},<{major}.{int(minor) + 1}'"
        )


def filesystem_async_module() -> Any:
    """megatron's filesystem_async module, once the version and the name are checked."""
    require_tested_megatron()
    if not hasattr(filesystem_async, RESULTS_QUEUE):
        raise RuntimeError(
            f"megatron-core {metadata.version('megatron-core')}: filesystem_async has no "
            f"{RESULTS_QUEUE} (mmtrain/private_api.py needs updating)"
        )
    return filesystem_async


def writer_results_queue() -> Any:
    """The queue megatron's torch_dist writer will use (None until its first save)."""
    return getattr(filesystem_async_module(), RESULTS_QUEUE)


def set_writer_results_queue(queue: Any) -> None:
    """Make `queue` the one megatron's torch_dist writer uses from its next save on."""
    setattr(filesystem_async_module(), RESULTS_QUEUE, queue)


@functools.cache
def cpu_flash_attention() -> tuple[Any, Any]:
    """(forward, backward): aten's CPU flash-attention ops, once their schemas are checked."""
    ops = []
    for name, schema in CPU_FLASH_ATTENTION_SCHEMAS.items():
        try:
            op = getattr(torch.ops.aten, name)
            found = str(op.default._schema)
        except AttributeError:
            op, found = None, "missing"
        if found != schema:
            raise RuntimeError(
                f"torch {torch.__version__}: aten::{name} is {found}, but context parallelism on "
                f"CPU calls it as {schema} (mmtrain/private_api.py needs updating)"
            )
        ops.append(op)
    return ops[0], ops[1]
