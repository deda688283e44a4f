"""GPU check of the long-context path (one GPU is enough; a few minutes).

Correctness (each prints PASS/FAIL with the error it measured):
  varlen    packed (THD) attention of our core attention on this GPU - varlen flash attention
            (flash-attn, else PyTorch's varlen_attn) in bf16, the grouped SDPA path in fp32 - and
            TE's attention when installed, against per-sample attention: outputs and gradients;
  loss      the chunked LM loss (fp32: within 1e-5 of full logits; bf16), and which fused kernel
            (cut-cross-entropy / liger-kernel) passed its self-check, if any;
  decoder   the decoder with the chunked loss against megatron's full-logits output layer (same
            weights, bf16): per-token losses, and the peak memory of each at vocab 151,936;
  cp        our context-parallel token layout against TE's `thd_get_partitioned_indices` (TE
            only); with `torchrun --nproc_per_node=N` (N GPUs, TE): TE's context-parallel
            attention on each rank's share against whole-sequence attention.
Throughput (`--families`), megatron DDP + megatron's optimizer, bf16, random weights, for each
`--recompute` mode: tokens/s, MFU (decoder model FLOPs, as the train loop logs it, and with the
vision tower), peak memory next to the dry-run estimate of the same layout:
  aquila-vl-2b  recipes/aquila-vl-2b.yaml's model (Qwen2.5-1.5B + SigLIP) on synthetic packed
                batches of anyres images + text at seq 12,288 x micro-batch 2. Without pillow
                the vision tower is left out (decoder only) and the script says so.
  emu3-8b       recipes/emu3-8b.yaml's shapes (hidden 4096, the real 184,622-word vocabulary)
                with `--emu3-layers` (4) of its 32 layers, `Emu3Model` as `mmtrain emu3` trains
                it, on packed prompt + 4,160-visual-token samples at `--emu3-seq-length`
                (32,768) x micro-batch 1; under torchrun each GPU holds 1/N of the sequence.
Each (family, recompute mode) builds its model and runs `--warmup` + `--steps` steps (not timed
on a GPU yet); `--families` and `--recompute` trim the run.

Needs only: torch (CUDA), megatron-core 0.16 (no extras), pyyaml and psutil; optional:
pillow (vision tower), transformer-engine, flash-attn, cut-cross-entropy / liger-kernel.
No energon, Ray, data or network.

  python benchmarks/gpu_check.py [--steps 4] [--recompute full,none] [--seq-length 12288]
                                 [--families aquila-vl-2b,emu3-8b] [--emu3-seq-length 32768]
  torchrun --nproc_per_node=2 benchmarks/gpu_check.py      (multi-GPU: the TE CP check and CP=2
                                                           throughput instead of the 1-GPU checks)
  python benchmarks/gpu_check.py --allow-cpu --tiny        (exercise the script on a CPU)

Ends with `GPU_CHECK ok` when every check passed (exit 0), else `GPU_CHECK FAILED` (exit 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.reference_ops import per_sample_attention  # noqa: E402
from benchmarks.tiny_models import small_llm  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []
MAIN = int(os.environ.get("RANK", "0")) == 0  # prints come from rank 0 only


def say(*args: Any) -> None:
    if MAIN:
        print(*args, flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    say(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def environment(device: torch.device) -> dict[str, Any]:
    from mmtrain.models.attention import gpu_varlen_backend
    from mmtrain.models.te_support import te_status

    te = te_status()
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "megatron-core": _version("megatron-core"),
        # te_support, not a successful import: megatron binds a MagicMock TEDotProductAttention
        # without TE (review A2); the reason says why TE is unusable (e.g. a torch ABI mismatch)
        "transformer-engine": te.version if te.available else f"unusable ({te.reason})",
        "flash-attn": _version("flash-attn") if installed("flash_attn") else None,
        "varlen kernel (no TE)": gpu_varlen_backend(torch.bfloat16) or "grouped SDPA",
        "pillow": installed("PIL"),
    }
    say("environment:")
    for k, v in env.items():
        say(f"  {k:<22} {v if v not in (None, False) else 'not installed'}")
    return env


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cu(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- correctness


def check_varlen(device: torch.device, tiny: bool) -> None:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mmtrain.models.attention import SDPACoreAttention, gpu_varlen_backend
    from mmtrain.models.context_parallel import cp_layout
    from mmtrain.models.te_support import te_dot_product_attention

    heads, groups, dim = (4, 2, 16) if tiny else (12, 2, 128)
    lens = [37, 512, 5, 1300, 64, 64, 900] if not tiny else [37, 100, 5, 64]
    total = sum(lens)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    params = cp_layout(_cu(lens, device), 1, 0, 1).packed_seq_params(device)
    g = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(total, h, dim, device=device, generator=g) for h in (heads, groups, groups)]
    grad = torch.randn(total, heads * dim, device=device, generator=g)
    ref_in = [x.double().requires_grad_() for x in base]
    ref = per_sample_attention(*ref_in, lens)
    ref.backward(grad.double())
    modules = [("ours", SDPACoreAttention)]
    te = te_dot_product_attention() if device.type == "cuda" else None  # None without a real TE (A2)
    if te is not None:
        modules.append(("TE", te))
    for dtype in (torch.bfloat16, torch.float32):
        for name, cls in modules:
            if name == "TE" and dtype == torch.float32:
                continue
            cfg.params_dtype, cfg.bf16 = dtype, dtype == torch.bfloat16
            attn = cls(cfg, 1, AttnMaskType.causal, attention_type="self").to(device)
            x = [t.detach().to(dtype).clone().requires_grad_() for t in base]
            out = attn(*x, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
            out = out.reshape(total, -1)
            out.backward(grad.to(dtype))
            errs = [rel(out.detach(), ref.detach())] + [rel(a.grad, b.grad) for a, b in zip(x, ref_in)]
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            used = (
                name
                if name == "TE"
                else (gpu_varlen_backend(dtype) or "grouped SDPA")
                if device.type == "cuda"
                else "grouped SDPA"
            )
            check(
                f"varlen attention {name} ({used}, {str(dtype)[6:]})",
                max(errs) <= tol,
                f"max rel error out/dq/dk/dv {max(errs):.1e} (tolerance {tol:g}), {len(lens)} packed sequences",
            )


def check_loss(device: torch.device, tiny: bool) -> None:
    from mmtrain.models.lm_loss import fused_kernel, linear_cross_entropy

    n, h, vocab, true_vocab = (512, 64, 4096, 4000) if tiny else (4096, 1536, 151936, 151936)
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(n, h, device=device, generator=g)
    weight = torch.randn(vocab, h, device=device, generator=g) * h**-0.5
    labels = torch.randint(0, true_vocab, (n,), device=device, generator=g)
    labels[::6] = -100
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        logits = (
            (ref_h @ ref_w.t()).float().masked_fill(torch.arange(vocab, device=device) >= true_vocab, float("-inf"))
        )
        ref = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
        ref.sum().backward()
        x_h, x_w = (t.detach().to(dtype).clone().requires_grad_() for t in (hidden, weight))
        out = linear_cross_entropy(x_h, x_w, labels, true_vocab=true_vocab)
        out.sum().backward()
        errs = [rel(out.detach(), ref.detach()), rel(x_h.grad, ref_h.grad), rel(x_w.grad, ref_w.grad)]
        check(
            f"chunked loss ({str(dtype)[6:]})",
            max(errs) <= tol,
            f"max rel error loss/d_hidden/d_weight {max(errs):.1e} vs full logits (tolerance {tol:g})",
        )
    fused = fused_kernel(torch.bfloat16) if device.type == "cuda" else None
    say(f"  fused loss kernel: {fused[0] if fused else 'none installed / none passed its self-check -> chunked'}")


def check_decoder(device: torch.device, tiny: bool) -> None:
    from mmtrain.models.context_parallel import cp_layout
    from mmtrain.models.language_model import build_language_model
    from mmtrain.models.lm_config import padded_vocab_size
    from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config

    vocab = 8192 if tiny else 151936
    llm = small_llm(vocab, max_position_embeddings=16384)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = language_transformer_config(llm, dtype, ParallelOptions(on_cuda=device.type == "cuda"))
    lens = [3000, 1000, 4192] if not tiny else [300, 100, 112]
    total = sum(lens)
    ids = torch.randint(0, vocab, (1, total), generator=torch.Generator().manual_seed(2)).to(device)
    labels = torch.randint(0, vocab, (1, total), generator=torch.Generator().manual_seed(3)).to(device)
    params = cp_layout(_cu(lens, device), 1, 0, 1).packed_seq_params(device)
    results = {}
    for impl in ("plain", "chunked"):
        torch.manual_seed(0)
        model = build_language_model(llm, cfg, vocab_size=padded_vocab_size(vocab, 64), loss_impl=impl).to(device)
        _reset_peak(device)
        before = _allocated(device)
        loss = model(input_ids=ids, position_ids=None, attention_mask=None, labels=labels, packed_seq_params=params)
        loss.sum().backward()
        results[impl] = (
            loss.detach().float(),
            _peak(device) - before,
            model.embedding.word_embeddings.weight.grad.float(),
        )
        del model, loss
        gc.collect()
    (ref, ref_mem, ref_g), (out, mem, g) = results["plain"], results["chunked"]
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    errs = [rel(out, ref), rel(g, ref_g)]
    check(
        "decoder chunked loss vs megatron output layer",
        max(errs) <= tol,
        f"max rel error losses/embedding grad {max(errs):.1e} ({dtype}, tolerance {tol:g})",
    )
    if device.type == "cuda":
        check(
            "decoder chunked loss memory",
            mem < ref_mem,
            f"peak {mem / 2**30:.2f} GiB vs {ref_mem / 2**30:.2f} GiB with full logits ({total} tokens, vocab {vocab})",
        )


def check_cp_layout() -> None:
    from mmtrain.models.context_parallel import cp_layout, padding_multiple

    from mmtrain.models.te_support import te_status

    if not te_status().available:
        say(f"  (cp layout vs TE: Transformer Engine unusable, skipped: {te_status().reason})")
        return
    import transformer_engine_torch as tex

    lens = [45, 8, 130, 3, 60, 1000]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    worst = 0
    for cp in (2, 4):
        for rank in range(cp):
            lay = cp_layout(cu, cp, rank, padding_multiple(cp, 1))
            padded = lay.cu_seqlens.tolist()
            # the padded stream: each slot's original position (total = padding)
            stream = torch.full((padded[-1],), lay.total, dtype=torch.long)
            for (s, e), (ps, _) in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), zip(padded[:-1], padded[1:])):
                stream[ps : ps + e - s] = torch.arange(s, e)
            idx = tex.thd_get_partitioned_indices(lay.cu_seqlens.cuda(), padded[-1], cp, rank).cpu().long()
            worst += int((stream[idx] != lay.index).sum())
    check("cp layout = TE thd_get_partitioned_indices", worst == 0, f"{worst} positions differ (cp 2 and 4, all ranks)")


def check_te_context_parallel(device: torch.device) -> None:
    """torchrun with N GPUs: TE's CP attention on each rank's share = whole-sequence attention."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType

    from mmtrain.models.context_parallel import current_layout
    from mmtrain.models.te_support import te_dot_product_attention
    from mmtrain.models.lm_config import LLMConfig
    from mmtrain.models.megatron_config import ParallelOptions, language_transformer_config

    te = te_dot_product_attention()
    cp = parallel_state.get_context_parallel_world_size()
    if te is None or cp < 2:
        return
    llm = LLMConfig(num_layers=1, hidden_size=1536, num_attention_heads=12, num_query_groups=2)
    cfg = language_transformer_config(
        llm, "bfloat16", ParallelOptions(cp_comm_type=os.environ.get("CP_COMM", "p2p"), on_cuda=True)
    )
    lens = [4000, 777, 2300, 64]
    total = sum(lens)
    g = torch.Generator(device=device).manual_seed(4)
    base = [torch.randn(total, h, 128, device=device, generator=g) for h in (12, 2, 2)]
    grad = torch.randn(total, 1536, device=device, generator=g)
    ref_in = [x.double().requires_grad_() for x in base]
    ref = per_sample_attention(*ref_in, lens)
    ref.backward(grad.double())
    layout = current_layout(_cu(lens, torch.device("cpu")))
    attn = te(cfg, 1, AttnMaskType.causal, attention_type="self", cp_comm_type=cfg.cp_comm_type).to(device)
    local = [layout.split(x.to(torch.bfloat16)).detach().requires_grad_() for x in base]
    out = attn(*local, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=layout.packed_seq_params(device))
    out = out.reshape(out.size(0), -1)
    out.backward(layout.split(grad.to(torch.bfloat16)))
    full = [layout.scatter(t.float()) for t in (out.detach(), *(x.grad.reshape(x.size(0), -1) for x in local))]
    for t in full:
        dist.all_reduce(t, group=parallel_state.get_context_parallel_group())
    errs = [rel(full[0], ref.detach())] + [rel(a, b.grad.reshape(total, -1)) for a, b in zip(full[1:], ref_in)]
    check(
        f"TE context-parallel attention (cp={cp}, {cfg.cp_comm_type})",
        max(errs) <= 2e-2,
        f"max rel error out/dq/dk/dv {max(errs):.1e} vs whole-sequence attention",
    )


# ----------------------------------------------------------------------------- throughput


SAMPLE_LEN = 4096  # tokens per synthetic LLaVA-OV sample: one 384x768 anyres image (2,214 positions) + text
EMU3_SAMPLE_LEN = 4224  # tokens per synthetic Emu3 sample: a 64-token prompt + one 512x512 image (4,160 tokens)


@dataclasses.dataclass
class Workload:
    """What `throughput` trains: a family's recipe (sizes), its model and synthetic batches."""

    title: str
    recipe: Any
    shapes: Any  # models.shapes.ModelShapes (the dry-run estimate and the MFU come from it)
    parts: dict  # trainable parts for the optimizer
    build: Callable[[Any], torch.nn.Module]  # ParallelOptions -> model
    batch: Callable[[int, int, torch.device], Any]  # (rows, seq, device) -> batch
    media_fraction: float  # share of positions that are encoder features (dry-run encoder activations)
    media_tokens: Callable[[Any], int]  # encoder positions of a batch
    encoder_inputs: Callable[[Any], int] | None = None  # tiles of a batch (FamilySpec.encoder_inputs; MFU)


TINY_LLM = [
    "model.llm.num_layers=2",
    "model.llm.hidden_size=128",
    "model.llm.ffn_hidden_size=256",
    "model.llm.num_attention_heads=4",
    "model.llm.num_query_groups=2",
]


# The recipe leaves the media ids null for the run preflight to read off the tokenizer
# (llava_ov/spec.py); this script runs no preflight and loads no tokenizer, so it pins Qwen2.5's
# ids (the tokenizer's <image> / <video>, added after its vocabulary): null ids make
# LlavaOVModel refuse to build and would write None into the synthetic batch (review A3).
AQUILA_MEDIA_IDS = ("model.image_token_id=151665", "model.video_token_id=151666")


def aquila_workload(args: argparse.Namespace, with_vision: bool) -> Workload:
    """Aquila-VL-2B (recipes/aquila-vl-2b.yaml: Qwen2.5-1.5B + SigLIP) on packed anyres samples;
    without the vision tower its decoder alone, through the shared packed decoder forward."""
    from mmtrain.config import load_recipe
    from mmtrain.llava_ov.spec import LLAVA_OV, PARTS

    overrides = [
        "stage=2a",
        f"train.seq_length={args.seq_length}",
        f"train.micro_batch_size={args.micro_batch}",
        *AQUILA_MEDIA_IDS,
    ]
    if args.tiny:
        overrides += TINY_LLM + [
            "model.vision.num_layers=2",
            "model.vision.hidden_size=64",
            "model.vision.ffn_hidden_size=128",
            "model.vision.num_attention_heads=2",
        ]
    recipe = load_recipe(REPO / "recipes" / "aquila-vl-2b.yaml", overrides)
    shapes = LLAVA_OV.model_shapes(recipe.model)
    if not with_vision:
        shapes = dataclasses.replace(shapes, encoder=None, connectors=())

    def build(opts: Any) -> torch.nn.Module:
        if with_vision:
            return LLAVA_OV.build_model(recipe.model, options=opts)
        from mmtrain.models.language_model import build_language_model
        from mmtrain.models.megatron_config import language_transformer_config

        m = recipe.model
        cfg = language_transformer_config(m.llm, opts.params_dtype or m.params_dtype, opts)
        return _DecoderOnly(build_language_model(m.llm, cfg, vocab_size=m.padded_vocab_size(1), loss_impl=opts.lm_loss))

    return Workload(
        title="Aquila-VL-2B" + ("" if with_vision else " decoder only (no vision tower)"),
        recipe=recipe,
        shapes=shapes,
        parts=PARTS if with_vision else {"llm": ("language_model",)},
        build=build,
        batch=lambda rows, seq, device: synthetic_batch(recipe.model, rows, seq, device),
        media_fraction=_media_fraction(recipe.model, args) if with_vision else 0.0,
        media_tokens=lambda b: int(b.pixel_values.shape[0]) * recipe.model.vision.num_patches if with_vision else 0,
        encoder_inputs=LLAVA_OV.encoder_inputs if with_vision else None,
    )


def emu3_workload(args: argparse.Namespace) -> Workload:
    """Emu3-8B's shapes (recipes/emu3-8b.yaml: hidden 4096, GQA 32/8, FFN 14336, the real
    184,622-word vocabulary, untied) with `--emu3-layers` of its 32 layers (one GPU does not hold
    all 32 with their optimizer states), on packed text-to-image samples: the same `Emu3Model`
    and shared packed decoder forward that `mmtrain emu3` trains."""
    from mmtrain.config import load_recipe
    from mmtrain.emu3.spec import EMU3, PARTS

    overrides = [
        f"train.seq_length={args.seq_length}",
        f"train.micro_batch_size={args.micro_batch}",
        f"model.llm.num_layers={args.emu3_layers}",
    ]
    if args.tiny:
        overrides += TINY_LLM
    recipe = load_recipe(REPO / "recipes" / "emu3-8b.yaml", overrides)
    layers = recipe.model.llm.num_layers
    return Workload(
        title=f"Emu3-8B shapes, {layers} of 32 layers, vocab {recipe.model.llm.vocab_size:,}",
        recipe=recipe,
        shapes=EMU3.model_shapes(recipe.model),
        parts=PARTS,
        build=lambda opts: EMU3.build_model(recipe.model, options=opts),
        batch=lambda rows, seq, device: emu3_batch(recipe.model.llm.vocab_size, rows, seq, device),
        media_fraction=0.0,
        media_tokens=lambda b: 0,
    )


def packed_fields(ids: torch.Tensor, labels: torch.Tensor, bounds: list[int], max_seqlen: int, sample_ids) -> dict:
    """The fields every family's packed batch has, for full rows `ids` with `labels` and the
    sample boundaries `bounds` (flat positions, from 0)."""
    from mmdata.energon_loaders.batch import IGNORE_INDEX

    return dict(
        input_ids=ids,
        labels=labels,
        position_ids=torch.zeros_like(ids),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=max_seqlen,
        sample_ids=sample_ids,
        num_loss_tokens=int((labels != IGNORE_INDEX).sum()),
        num_real_tokens=ids.numel(),
    )


def synthetic_batch(model_cfg: Any, rows: int, seq: int, device: torch.device) -> Any:
    """Packed rows of (anyres image of 384x768 + text) samples, labels on the text."""
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmdata.energon_loaders.llava_ov import anyres
    from mmdata.energon_loaders.llava_ov.batch import MEDIA_ANYRES, LlavaOVBatch

    v = model_cfg.vision
    h, w = 384, 768
    grid = anyres.anyres_grid_shape(h, w, v.image_size, model_cfg.grid_max)
    n_img = anyres.num_image_tokens(
        h,
        w,
        image_size=v.image_size,
        patch_size=v.patch_size,
        max_tiles=model_cfg.max_tiles,
        grid_max=model_cfg.grid_max,
    )
    sample_len = min(SAMPLE_LEN, seq)
    if n_img + 32 > sample_len:
        raise ValueError(f"--seq-length {seq} is too short for a {n_img}-token image sample")
    per_row = seq // sample_len
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 150000, (rows, seq), generator=gen)
    labels = torch.full((rows, seq), IGNORE_INDEX)
    bounds = [0]
    for r in range(rows):
        for s in range(per_row):
            start = s * sample_len
            ids[r, start + 16 : start + 16 + n_img] = model_cfg.image_token_id
            text = torch.arange(start + 16 + n_img, start + sample_len - 1)
            labels[r, text] = ids[r, text + 1]
            bounds.append(r * seq + start + sample_len)
        if per_row * sample_len < seq:
            bounds.append((r + 1) * seq)
    n_media = rows * per_row
    tiles = 1 + grid[0] * grid[1]
    return LlavaOVBatch(
        **packed_fields(ids, labels, bounds, sample_len, [[f"s{r}_{i}" for i in range(per_row)] for r in range(rows)]),
        pixel_values=torch.randn(n_media * tiles, 3, v.image_size, v.image_size, generator=gen),
        tiles_per_media=torch.full((n_media,), tiles),
        media_kind=torch.full((n_media,), MEDIA_ANYRES),
        image_sizes=torch.tensor([[h, w]] * n_media),
        grid_shapes=torch.tensor([list(grid)] * n_media),
        num_media_tokens=torch.full((n_media,), n_img),
    ).to(device)


def emu3_batch(vocab: int, rows: int, seq: int, device: torch.device) -> Any:
    """Packed rows of Emu3 generation samples: a text prompt, then an image as visual tokens
    (the top 32,768 ids of the vocabulary), the loss on the image tokens, as the task encoder
    lays them out; a short sample fills the rest of each row."""
    from mmdata.energon_loaders.batch import IGNORE_INDEX
    from mmdata.energon_loaders.emu3.batch import Emu3Batch

    prompt, visual_start = 64, max(0, vocab - 32768)
    sample_len = min(EMU3_SAMPLE_LEN, seq)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, min(visual_start, 150000) or vocab, (rows, seq), generator=gen)
    labels = torch.full((rows, seq), IGNORE_INDEX)
    bounds, sample_ids = [0], []
    for r in range(rows):
        starts = list(range(0, seq, sample_len))
        for start in starts:
            end = min(start + sample_len, seq)
            image = torch.arange(start + min(prompt, (end - start) // 2), end)
            ids[r, image] = torch.randint(visual_start, vocab, (image.numel(),), generator=gen)
            labels[r, image[:-1]] = ids[r, image[1:]]
            bounds.append(r * seq + end)
        sample_ids.append([f"s{r}_{i}" for i in range(len(starts))])
    return Emu3Batch(
        **packed_fields(ids, labels, bounds, sample_len, sample_ids),
        tasks=[["generation"] * len(s) for s in sample_ids],
    ).to(device)


def throughput(args: argparse.Namespace, ctx: Any, work: Workload) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_model_config

    from mmtrain.models.lm_loss import resolve_loss_impl
    from mmtrain.models.megatron_config import ParallelOptions
    from mmtrain.models.flops import training_flops_per_token
    from mmtrain.planning.cost_model import GB, Layout, estimate_memory
    from mmtrain.runtime.optimizer import ModelParts, build_optimizer, ddp_config_kwargs
    from mmtrain.runtime.throughput import device_peak_flops

    recipe, shapes = work.recipe, work.shapes
    lm_loss = resolve_loss_impl("auto", tp=1, dtype=ctx.params_dtype, on_cuda=ctx.on_cuda)
    peak_flops = device_peak_flops(ctx.device, ctx.precision)
    for recompute in args.recompute.split(","):
        layout = Layout.from_recipe(recipe).with_(
            cp=ctx.cp,
            dp=1,
            tp=1,
            pp=1,
            recompute=recompute,
            sequence_parallel=False,
            distributed_optimizer=ctx.distributed_optimizer,
            global_batch_size=args.micro_batch,
            lm_loss=lm_loss,
        )
        est = estimate_memory(shapes, [], layout, media_token_fraction=work.media_fraction)
        capacity = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.on_cuda else float("inf")
        say(
            f"\nthroughput: {work.title}, seq {args.seq_length} x micro-batch {args.micro_batch}, cp {ctx.cp}, "
            f"recompute {recompute}, {ctx.precision}, LM loss {lm_loss}; dry-run estimate {est.total / GB:.1f} GiB/rank"
        )
        if est.total > 0.92 * capacity:
            say(f"  skipped: estimate above 92% of the {capacity / GB:.0f} GiB device")
            continue
        opts = ParallelOptions(
            recompute_granularity=None if recompute == "none" else recompute,
            params_dtype=ctx.params_dtype_name,
            lm_loss=lm_loss,
            on_cuda=ctx.on_cuda,
        )
        module = work.build(opts).to(ctx.device)
        config = get_model_config(module)
        config.calculate_per_token_loss = True
        # the trainer's DDP settings: overlapped grad reduce; with the distributed optimizer the
        # overlapped, aligned param all-gather too (runtime/optimizer.ddp_config_kwargs)
        ddp = DistributedDataParallel(
            config=config, ddp_config=DistributedDataParallelConfig(**ddp_config_kwargs(ctx)), module=module
        )
        optimizer = build_optimizer([ddp], ModelParts([module], work.parts), recipe.optimizer, ctx)
        batch = work.batch(args.micro_batch, args.seq_length, ctx.device)
        step = _step_fn(ddp, optimizer, batch, finalize_model_grads)
        for _ in range(args.warmup):
            step()
        _sync(ctx.device)
        _reset_peak(ctx.device)
        start = time.perf_counter()
        losses = [step() for _ in range(args.steps)]
        _sync(ctx.device)
        seconds = (time.perf_counter() - start) / args.steps
        tokens = args.micro_batch * args.seq_length  # all positions of the micro-batch (one CP group)
        tps = tokens / seconds / ctx.cp  # per GPU
        # the old per-token figure (one sample per row, every part at 3x: overstated on packed
        # rows, review B1), printed next to the corrected one for comparison only
        old_flops = training_flops_per_token(shapes, args.seq_length)
        mfu_old = (old_flops * tps / peak_flops) if peak_flops else None
        flops = corrected_step_flops(work, batch)  # Σ len² per packed sample, frozen 2x, vision tower
        mfu = (flops / seconds / ctx.cp / peak_flops) if peak_flops else None
        peak = _peak(ctx.device)
        say(
            f"  {seconds:.3f} s/step, {tps:,.0f} tokens/s/GPU, MFU "
            + (
                "n/a"
                if mfu is None
                else f"{mfu:.1%} (step_flops: Σ len², frozen parts 2x, vision tower) "
                f"[old per-token formula {mfu_old:.1%}]"
            )
            + f"; loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        )
        if ctx.on_cuda:
            say(
                f"  peak memory {peak / GB:.1f} GiB (torch max allocated) vs dry-run estimate {est.total / GB:.1f} GiB "
                f"({(peak - est.total) / est.total:+.0%})"
            )
        FIGURES.append(
            Figure(work.title, args.seq_length, args.micro_batch, recompute, seconds, tps, mfu, peak, est.total)
        )
        check(
            f"{work.title.split(',')[0]} throughput step (recompute {recompute})",
            all(x == x for x in losses),
            f"{len(losses)} finite steps",
        )
        del ddp, optimizer, module, batch, step
        gc.collect()
        if ctx.on_cuda:
            torch.cuda.empty_cache()


@dataclasses.dataclass(frozen=True)
class Figure:
    """One timed (family, layout): what gpu_smoke's final table prints."""

    title: str
    seq_length: int
    micro_batch: int
    recompute: str
    seconds_per_step: float
    tokens_per_s_per_gpu: float
    mfu: float | None  # corrected formula (models/flops.py step_flops); None without a known peak
    peak_bytes: int  # torch max allocated (0 on a CPU)
    estimate_bytes: float  # the dry run's per-rank estimate of the same layout


FIGURES: list[Figure] = []


def corrected_step_flops(work: Workload, batch: Any) -> float:
    """Model FLOPs of one step on `batch` by the train loop's formula (models/flops.py step_flops, review
    B1): causal attention from Σ len² of the packed samples, each part's backward from the freeze
    set (every part of `work.parts` trains here), the vision tower from the batch's tiles."""
    from mmtrain.models.flops import step_flops

    tiles = work.encoder_inputs(batch) if work.encoder_inputs is not None else 0
    return step_flops(work.shapes, [batch.host_cu_seqlens()], tiles, list(work.parts)).total


def _media_fraction(model_cfg: Any, args: argparse.Namespace) -> float:
    from mmdata.energon_loaders.llava_ov import anyres

    v = model_cfg.vision
    n_img = anyres.num_image_tokens(
        384,
        768,
        image_size=v.image_size,
        patch_size=v.patch_size,
        max_tiles=model_cfg.max_tiles,
        grid_max=model_cfg.grid_max,
    )
    return n_img / min(SAMPLE_LEN, args.seq_length)


class _DecoderOnly(torch.nn.Module):
    """The Qwen2 decoder of the recipe, fed the batch's token ids (no media)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.language_model = lm
        self.config = lm.config

    def forward(self, batch: Any) -> torch.Tensor:
        from mmtrain.models.context_parallel import current_layout
        from mmtrain.models.language_model import packed_decoder_forward

        return packed_decoder_forward(self.language_model, batch, current_layout(batch.cu_seqlens))


def _step_fn(ddp: Any, optimizer: Any, batch: Any, finalize: Callable) -> Callable[[], float]:
    from mmtrain.runtime.loss import loss_mask, masked_loss_sum

    def step() -> float:
        if getattr(ddp, "use_forward_hook", False):  # overlap_param_gather: as Trainer._dispatch_param_gather
            ddp.start_param_sync()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = ddp(batch)
        loss_sum, count, _ = masked_loss_sum(out, loss_mask(batch))
        loss_sum.backward()
        finalize([ddp], num_tokens=count.clone().to(out.device))
        optimizer.step()
        return float(loss_sum.detach() / count.clamp(min=1))

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="timed training steps per recompute mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-length", type=int, default=12288)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--recompute", default="full,none", help="comma-separated modes to time (none|selective|full)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--decoder-only", action="store_true", help="time the decoder without the vision tower")
    ap.add_argument("--families", default="aquila-vl-2b,emu3-8b", help="throughput workloads, comma-separated")
    ap.add_argument("--emu3-layers", type=int, default=4, help="Emu3-8B layers to build (of 32; one GPU)")
    ap.add_argument(
        "--emu3-seq-length", type=int, default=32768, help="Emu3's sequence length (micro-batch 1; 0: --seq-length)"
    )
    ap.add_argument("--allow-cpu", action="store_true", help="run on a CPU (to exercise the script)")
    ap.add_argument("--tiny", action="store_true", help="small shapes (with --allow-cpu)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: no CUDA device (use --allow-cpu --tiny to exercise the script on a CPU)", file=sys.stderr)
        return 2
    if args.tiny:
        args.seq_length, args.steps, args.warmup = min(args.seq_length, 8192), min(args.steps, 2), 1
        args.emu3_seq_length = min(args.emu3_seq_length or args.seq_length, 8448)

    from mmtrain.config.schema import ParallelConfig
    from mmtrain.runtime.distributed import destroy_distributed, init_distributed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = init_distributed(
        ParallelConfig(cp=world, nproc_per_node=world, precision="bf16", distributed_optimizer=True), seed=1234
    )
    device = ctx.device
    environment(device)
    say("\ncorrectness:")
    try:
        if world == 1:  # single-device checks (under torchrun the decoder is built context-parallel)
            check_varlen(device, args.tiny)
            check_loss(device, args.tiny)
            check_decoder(device, args.tiny)
            if ctx.on_cuda:
                check_cp_layout()
        check_te_context_parallel(device)
        for family in [] if args.skip_throughput else args.families.split(","):
            if family == "aquila-vl-2b":
                throughput(args, ctx, aquila_workload(args, with_vision=installed("PIL") and not args.decoder_only))
            elif family == "emu3-8b":
                emu3_args = argparse.Namespace(
                    **{**vars(args), "seq_length": args.emu3_seq_length or args.seq_length, "micro_batch": 1}
                )
                throughput(emu3_args, ctx, emu3_workload(emu3_args))
            else:
                raise SystemExit(f"gpu_check: --families: unknown {family!r} (aquila-vl-2b, emu3-8b)")
    finally:
        destroy_distributed()
    failed = [name for name, ok, _ in RESULTS if not ok]
    say("\nGPU_CHECK " + ("ok" if not failed else "FAILED: " + ", ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
