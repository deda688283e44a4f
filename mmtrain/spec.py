"""What a model family gives the shared runtime: one `FamilySpec` (like torchtitan's TrainSpec).

The runtime (launch, distributed set-up, train loop, checkpoints, recipe validation, dry-run /
auto-tune, conversion) names no family; it calls what the spec provides. A family is one folder
in `mmtrain/` whose `spec.py` builds its FamilySpec, one task-encoder package in
`mmdata/energon_loaders/`, and one entry in `mmtrain/registry.py`.

Spec modules are imported by the CLI and the recipe validator, so they import only light
modules (dataclasses, configs, shapes). What lives in heavy modules (models, loaders, conversion,
generation) is named as a `Ref("module:function")`: imported on its first call and cached, the
registry's lazy-import boundary. No trampoline functions, and no import of the model code from
the registry.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch

    from mmtrain.models.shapes import ModelShapes


@functools.cache
def resolve(target: str) -> Callable[..., Any]:
    """The callable a "module:function" (or "module:Class.attr") names, imported once."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected 'module:function', got {target!r}")
    obj: Any = importlib.import_module(module)
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj


@dataclass(frozen=True)
class Ref:
    """A family callable in a heavy module, named "module:function": the spec (and so the CLI
    and the recipe validator) stays light, and the module is imported on the first call."""

    target: str

    def __post_init__(self) -> None:
        if self.target.count(":") != 1:
            raise ValueError(f"Ref: expected 'module:function', got {self.target!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return resolve(self.target)(*args, **kwargs)

    def resolve(self) -> Any:
        """What the target names: a callable, or a class (`batch_type`) or a table."""
        return resolve(self.target)


@dataclass(frozen=True)
class HFConversion:
    """How a family's weights move between HF (transformers) checkpoints and megatron ones.

    `mmtrain convert` calls `to_mcore` / `to_hf`; a recipe whose `checkpoint.load` names an HF
    directory is filled by `load_into_model` (converted on the fly, into any TP/PP layout)."""

    #: (src HF dir, dst megatron dir, *, tp, pp, dtype) -> the model config written with the
    #: weights (dtype: `--dtype`, "auto" keeps the source's)
    to_mcore: Callable[..., Any]
    #: (src megatron dir, dst HF dir, *, max_shard_bytes, dtype, **export_from dirs given) -> the
    #: HF dir (dtype: `--dtype`, "auto" keeps the stored weights')
    to_hf: Callable[..., Path]
    #: (model chunks of this rank, HF dir, the recipe's model config) -> None; refuses an HF
    #: config that does not match the recipe, naming the key
    load_into_model: Callable[[list["torch.nn.Module"], str, Any], None]
    #: initial weights assembled from separate HF checkpoints: `--<flag> DIR` -> help text
    #: (e.g. a language model and a vision tower before any multimodal training)
    assemble_from: dict[str, str] = field(default_factory=dict)
    #: ({flag: dir}, dst megatron dir, *, tp, pp, dtype) -> the model config written
    assemble: Optional[Callable[..., Any]] = None
    #: HF parts an export may take from elsewhere: `--<flag> DIR` -> help text (e.g. a VQ model
    #: that training does not touch and a checkpoint may not carry); passed to `to_hf` by flag
    export_from: dict[str, str] = field(default_factory=dict)
    #: HF checkpoint formats `to_hf` writes (`--format`, passed as `format=`), the default first;
    #: empty when the family writes one format only
    export_formats: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationSpec:
    """What `mmtrain generate <family>` needs from a family; the shared command
    (mmtrain/generate_cli.py) parses the common options (checkpoint, sampling, batch size,
    device, dtype), checks the checkpoint is this family's, runs the engine and shows progress."""

    #: one line for `mmtrain generate --help`
    help: str
    #: the family's command lines, shown first in `mmtrain generate <family> --help`
    usage: str
    #: (argparse parser) -> None: the family's own options (prompts, images, guidance, outputs)
    add_arguments: Callable[[Any], None]
    #: (args, CheckpointRef, Placement) -> GenerationJob (mmtrain.generation.engine): loads the
    #: model and its assets (refusing missing ones before the model loads), builds the requests
    prepare: Callable[..., Any]
    #: defaults of the shared sampling options, e.g. {"temperature": 1.0, "top_k": 2048}
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    #: `model_type`s of this family's HF config.json (an HF dir of another type is refused)
    hf_model_types: tuple[str, ...] = ()

    @classmethod
    def from_cli(
        cls, cli: ModuleType, *, help: str, prepare: Callable[..., Any], hf_model_types: tuple[str, ...]
    ) -> "GenerationSpec":
        """The spec of a family whose light options module `cli` (its generate_cli.py) holds
        `USAGE`, `add_arguments` and `SAMPLING_DEFAULTS`."""
        return cls(
            help=help,
            usage=cli.USAGE,
            add_arguments=cli.add_arguments,
            prepare=prepare,
            sampling_defaults=cli.SAMPLING_DEFAULTS,
            hf_model_types=hf_model_types,
        )


@dataclass(frozen=True)
class FamilySpec:
    #: CLI subcommand and the recipe's `family:` value, e.g. "llava-ov"
    name: str
    #: one line for `mmtrain --help`
    help: str

    # ---- recipe sections (validated by mmtrain.config) ------------------------------------
    #: dataclass of the recipe's `model:` section
    model_config_cls: type
    #: dataclass of the recipe's `data:` section: `config.schema.DataConfig` or a subclass
    #: adding the family's loader keys
    data_config_cls: type
    #: trainable parts -> the module paths (top-level names in a model stage) they own; every
    #: parameter belongs to exactly one part. `freeze:` and `optimizer.lr_mult:` name these.
    parts: dict[str, tuple[str, ...]]
    #: cross-checks over the family's keys, (recipe, errors) -> None, after the shared checks
    #: (a `config.schema.Recipe` and a `config.errors.RecipeErrors`: config sits above this leaf,
    #: which types its sections with the family's classes, so they are named here, not imported)
    check_recipe: Callable[[Any, Any], None]
    #: `model:` keys that fix the weights' shapes: resuming or starting from a checkpoint whose
    #: saved model config differs in one of them is refused
    architecture_keys: tuple[str, ...]

    # ---- training -------------------------------------------------------------------------
    #: (model config, *, pre_process, post_process, options: ParallelOptions, vp_stage) -> one PP
    #: stage, or one model chunk of it with virtual stages (`vp_stage`: its index; None without)
    build_model: Callable[..., "torch.nn.Module"]
    #: what `build_loader` yields and `forward_step` consumes (an energon_loaders PackedBatch
    #: subclass), named as a Ref to the class: the batch module imports torch
    batch_type: Ref
    #: (recipe, *, dp_rank, dp_size) -> savable loader of `batch_type`
    #: (mmdata.energon_loaders.loader.SavableLoader)
    build_loader: Callable[..., Any]
    #: megatron forward step: (data_iterator, model) -> (per-token loss [B, S] on the last
    #: stage / hidden states elsewhere, loss_fn -> (loss_sum, num_tokens, report))
    forward_step: Callable[..., Any]

    # ---- planning -------------------------------------------------------------------------
    #: (model config) -> the cost model's shape description (dry_run, auto_tune, MFU)
    model_shapes: Callable[[Any], "ModelShapes"]
    #: (a micro-batch of `batch_type`) -> tiles/frames its encoder runs on, read from host fields
    #: (no device read), for the train loop's MFU (`models.flops.step_flops`). None: the family
    #: encodes no media in training (e.g. pre-tokenized images)
    encoder_inputs: Optional[Callable[[Any], int]] = None
    #: the energon sample type of the shards the family trains on, as `.nv-meta/mmdata.yaml`
    #: names it ("module.Class"), and what such shards are (with the command that writes them):
    #: preflight refuses a data path of another type before anything is built or written.
    #: None: not checked
    sample_type: Optional[tuple[str, str]] = None

    #: (recipe, the loaded HF tokenizer of `tokenizer.path`) -> problems, each naming its key;
    #: run before training starts (mmtrain/runtime/preflight.py), e.g. media token ids the
    #: model and the tokenizer must agree on. None: nothing family-specific to check
    check_tokenizer: Optional[Callable[[Any, Any], list[str]]] = None
    #: (the loaded HF tokenizer) -> tokens added: what the family's loader adds to a tokenizer
    #: that lacks them (llava-ov: `<image>`/`<video>`), applied to the copy a run keeps with its
    #: checkpoints. None: the tokenizer is kept as it is
    prepare_tokenizer: Optional[Callable[[Any], list[str]]] = None

    # ---- checkpoints and inference --------------------------------------------------------
    #: HF <-> megatron conversion; None: the family has no HF counterpart
    hf: Optional[HFConversion] = None
    #: `mmtrain generate <family>`: prompts, logits processors, outputs around the shared
    #: engine (mmtrain/generation/); None: the family cannot generate
    generation: Optional["GenerationSpec"] = None
