"""Review N6: THD RoPE without host syncs (`mmtrain/models/packed_rope.py`) gives megatron's own
THD RoPE result, context parallelism included, reads nothing back from the device, and a model
built on it gives the logits megatron's path gives."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.transformer_config import TransformerConfig

from mmtrain.models.packed_rope import apply_thd_rope, thd_rope_positions

# `unit` test by test: the context-parallel check runs on two torchrun ranks

HEADS, DIM = 3, 16


@dataclass(frozen=True)
class _Group:
    """The two questions megatron's THD RoPE asks its `cp_group` (size, rank), for CP layouts a
    single process cannot form as a real group."""

    n: int
    r: int

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def _config(interleaved: bool = False) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        rotary_interleaved=interleaved,
        apply_rope_fusion=False,
    )


def _freqs(n: int) -> torch.Tensor:
    """[n, 1, 1, DIM] angles as megatron's RotaryEmbedding lays them out (position x inverse frequency)."""
    inv = 1.0 / 10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    f = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]


# segment lengths of one packed stream (global, padded under CP: multiples of 2*cp); the zeros
# and the trailing long run are an empty segment and a row's padding run
LAYOUTS = [[7], [3, 5, 1, 9], [4, 0, 6, 2, 20], [1, 1, 1, 1], [12, 8, 0]]


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


@pytest.mark.unit
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("lens", LAYOUTS)
def test_equals_megatrons_thd_rope(lens, interleaved):
    cu, cfg = _cu(lens), _config(interleaved)
    t = torch.randn(sum(lens), HEADS, DIM, generator=torch.Generator().manual_seed(len(lens)))
    for freqs_len in (max(lens), max(lens) + 5, sum(lens)):  # the last: megatron's "exact mapping" case
        if freqs_len < max(lens):
            continue
        freqs = _freqs(freqs_len)
        ref = apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, cp_group=_Group(1, 0))
        got = apply_thd_rope(t, freqs, thd_rope_positions(cu, t.size(0), freqs_len), cfg, _Group(1, 0))
        assert torch.equal(got, ref), (lens, freqs_len)


@pytest.mark.unit
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lens", [[8], [8, 16, 24], [16, 0, 8, 40]])
def test_equals_megatrons_thd_rope_on_every_cp_rank(lens, cp):
    """Each CP rank holds chunks r and 2*cp-1-r of every (padded) sequence: megatron's
    `_get_thd_freqs_on_this_cp_rank`, also the project's layout (`context_parallel.cp_layout`)."""
    lens = [n * cp // 2 for n in lens]  # multiples of 2*cp
    cu, cfg = _cu(lens), _config()
    local = sum(lens) // cp
    for rank in range(cp):
        t = torch.randn(local, HEADS, DIM, generator=torch.Generator().manual_seed(rank))
        for freqs_len in (max(lens), sum(lens)):
            freqs = _freqs(freqs_len)
            ref = apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, cp_group=_Group(cp, rank))
            pos = thd_rope_positions(cu, local, freqs_len, cp, rank)
            assert torch.equal(apply_thd_rope(t, freqs, pos, cfg, _Group(cp, rank)), ref), (lens, cp, rank)


@pytest.mark.unit
def test_positions_follow_the_projects_cp_layout():
    """Under CP a real token's position is its offset inside its sequence in the project's own
    layout (`cp_layout`: what the model's token split and the attention use)."""
    from mmtrain.models.context_parallel import cp_layout

    cu = _cu([5, 11, 3])
    for rank in range(2):
        layout = cp_layout(cu, 2, rank, 4)
        pos = thd_rope_positions(layout.cu_seqlens, layout.local_tokens, layout.max_seqlen, 2, rank)
        seq_start = torch.repeat_interleave(cu[:-1].long(), (layout.cu_seqlens.diff() // 2).long())
        real = layout.index < layout.total
        assert torch.equal(pos[real], (layout.index - seq_start)[real])


class _NoHostRead(torch.overrides.TorchFunctionMode):
    """Records every read of a tensor's value on the host (`tolist`, `item`, `bool`/`int`)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
            self.bad.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.unit
def test_probe_sees_megatrons_host_reads():
    cu = _cu([3, 5])
    with _NoHostRead() as probe:
        apply_rotary_pos_emb(torch.randn(8, HEADS, DIM), _freqs(5), _config(), cu_seqlens=cu, cp_group=_Group(1, 0))
    assert "tolist" in probe.bad


@pytest.mark.unit
def test_no_host_read_in_positions_and_rope():
    cu = _cu([4, 0, 6, 2, 20])
    t, freqs = torch.randn(32, HEADS, DIM), _freqs(20)
    with _NoHostRead() as probe:
        for cp, rank in ((1, 0), (2, 1)):
            pos = thd_rope_positions(cu, 32 // cp, 20, cp, rank)
            apply_thd_rope(t[: 32 // cp], freqs, pos, _config(), _Group(cp, rank))
    assert probe.bad == []


# ---------------------------------------------------------------------------------------------
# a tiny decoder end to end (tests/tiny_decoder.py)


@pytest.mark.unit
@pytest.mark.usefixtures("megatron_cpu")
def test_tiny_decoder_logits_equal_megatrons_path():
    from mmtrain.models.context_parallel import current_layout
    from mmtrain.models.language_model import packed_decoder_forward
    from tests.tiny_decoder import packed_batch, tiny_lm

    batch = packed_batch([5, 9, 1, 17])  # three samples and a padding run
    layout = current_layout(batch.host_cu_seqlens())
    with torch.no_grad():
        with _NoHostRead() as ours:
            got = packed_decoder_forward(tiny_lm(False), batch, layout, return_logits=True)
        with _NoHostRead() as megatrons:
            ref = packed_decoder_forward(tiny_lm(True), batch, layout, return_logits=True)
    assert torch.equal(got, ref)
    # megatron's path: cu_seqlens.tolist() and `freqs.size(0) == cu_seqlens[-1]` for q and k in
    # each of the 2 layers; ours reads none (what is left is the SDPA plan's read of the host copy)
    assert megatrons.bad.count("tolist") - ours.bad.count("tolist") == 2 * 2
    assert megatrons.bad.count("__bool__") - ours.bad.count("__bool__") == 2 * 2


def test_tiny_decoder_under_context_parallelism_equals_megatrons_path(tmp_path):
    """CP=2 (2 processes, gloo, K/V all-gather attention): on each rank's share of a packed row,
    the decoder's losses and every weight's gradient are megatron's THD RoPE path's, bit for bit,
    and its RoPE made no host read (megatron's: 2 per layer for q and k)."""
    import json

    from tests.fixtures_convert import torchrun

    out = tmp_path / "result"
    torchrun(Path(__file__).parent / "workers" / "packed_rope_cp_worker.py", str(out))
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        for lens, r in res.items():
            assert r["loss_equal"] and r["grads_equal"], (rank, lens, r)
            assert r["nonzero"] > 0, (rank, lens)  # this rank held labelled tokens
            assert r["reads_megatron"] - r["reads_ours"] == 2 * 2 * 2, (
                rank,
                lens,
                r,
            )  # tolist + bool, q and k, 2 layers
