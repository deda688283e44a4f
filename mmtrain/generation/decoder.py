"""A megatron-core decoder (`GPTModel`) run for generation: a prefill of the prompts, then one token per row
per step, with a KV cache.
Design notes: docs/generation.md, "The decoder run for generation"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP


@dataclass
class KVCache:
    """Keys (rotated) and values of every layer, plus what the current forward writes where."""

    keys: list[torch.Tensor]  # per layer [rows, groups, capacity, head_dim]
    values: list[torch.Tensor]
    #: [rows] each row's next position (its prompt length + tokens fed since)
    positions: torch.Tensor
    #: [rows, capacity] slots a row may attend to (after the empty ones before its prompt);
    #: None when no row has empty slots
    valid: Optional[torch.Tensor]
    #: slots filled so far, the same for every row (during a prefill: where it writes)
    filled: int = 0
    # ---- set per forward by CachedDecoder
    cos: Optional[torch.Tensor] = None  # [s, rows, 1, rot_dim]
    sin: Optional[torch.Tensor] = None
    #: prefill: the rows being filled (None: all), which attend causally among their new tokens
    prefill_rows: Optional[torch.Tensor] = None
    prefill: bool = False
    #: decode: [rows, 1, 1, kv_len] True = may attend, or None: every slot so far
    mask: Optional[torch.Tensor] = None

    @property
    def capacity(self) -> int:
        return self.keys[0].size(2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE: `x * cos + rotate_half(x) * sin`, megatron's `_apply_rotary_pos_emb_bshd` to the bit,
    with rotate_half's sign folded into `sin` (see `CachedDecoder._rope`): -a * b == a * -b."""
    rot = cos.size(-1)
    x_rot = x[..., :rot] if rot < x.size(-1) else x
    if interleaved:
        swapped = x_rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:
        swapped = x_rot.roll(rot // 2, dims=-1)
    out = x_rot * cos + swapped * sin
    return torch.cat((out, x[..., rot:]), dim=-1) if rot < x.size(-1) else out


class CachedSDPA(torch.nn.Module):
    """Core attention of one layer for generation (megatron's core-attention call signature):
    q/k/v [s, rows, heads|groups, head_dim] of the incoming tokens, before RoPE -> [s, rows,
    heads*head_dim]. Rotates q and k at the rows' positions, stores k and v in the cache, and
    attends over each row's cached prefix."""

    def __init__(self, layer_index: int, softmax_scale: float, rotary_interleaved: bool, state: "CachedDecoder"):
        super().__init__()
        self.layer_index = layer_index
        self.softmax_scale = softmax_scale
        self.rotary_interleaved = rotary_interleaved
        self.state = state

    def forward(
        self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("generation attention takes no attention_bias / packed sequences")
        c = self.state.cache
        assert c is not None, "CachedDecoder.prefill first"
        s = query.size(0)
        q = _rotate(query, c.cos, c.sin, self.rotary_interleaved).permute(1, 2, 0, 3)  # [rows, heads, s, d]
        k = _rotate(key, c.cos, c.sin, self.rotary_interleaved).permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        kc, vc = c.keys[self.layer_index], c.values[self.layer_index]
        end = c.filled + s
        if c.prefill:  # the new tokens are the whole prompt: store them, attend causally among them
            rows = slice(None) if c.prefill_rows is None else c.prefill_rows
            kc[rows, :, c.filled : end] = k
            vc[rows, :, c.filled : end] = v
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=s > 1, scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1)
            )
        else:
            kc[:, :, c.filled : end] = k
            vc[:, :, c.filled : end] = v
            k, v = kc[:, :, :end], vc[:, :, :end]
            if q.is_cuda:
                out = grouped_decode_attention(q, k, v, c.mask, self.softmax_scale)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=c.mask, scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1)
                )
        return out.permute(2, 0, 1, 3).reshape(s, query.size(1), -1)


def grouped_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    """Attention of one query per row over the cache, grouped-query heads without copying the
    cache: q [rows, heads, 1, d], k/v [rows, groups, L, d] (query head i reads group
    i // (heads/groups), as SDPA's `enable_gqa`), mask [rows, 1, 1, L] True = attend, or None.
    Used for CUDA decode steps, where SDPA with a mask and grouped heads falls back to a kernel
    that expands the cache per step; softmax in float32."""
    rows, heads, _, dim = q.shape
    groups = k.size(1)
    scores = torch.matmul(q.view(rows, groups, heads // groups, dim), k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)  # [rows, groups, heads/groups, d]
    return out.view(rows, heads, 1, dim)


class CachedDecoder:
    """Batches of rows through a megatron `GPTModel` with a KV cache: `prefill(prompts)` then
    `step(tokens)`, each returning the next-token logits [rows, vocab_size] (true vocabulary,
    float32)."""

    def __init__(self, gpt: torch.nn.Module, vocab_size: int, direct: Optional[bool] = None) -> None:
        if not (gpt.pre_process and gpt.post_process):
            raise ValueError("generation runs the whole decoder in one process (load at PP=1)")
        if gpt.position_embedding_type != "rope":
            raise NotImplementedError(f"generation supports RoPE decoders, not {gpt.position_embedding_type!r}")
        self.gpt = gpt.eval()
        self.vocab_size = vocab_size
        self.cache: Optional[KVCache] = None
        config = gpt.config
        scale = config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        rope = gpt.rotary_pos_emb
        self.inv_freq = rope.inv_freq.float()
        self.rotary_interleaved = bool(getattr(rope, "rotary_interleaved", False))
        for i, layer in enumerate(gpt.decoder.layers):
            attn = layer.self_attention
            if any(True for _ in attn.core_attention.parameters()):
                raise NotImplementedError(f"{type(attn.core_attention).__name__} has parameters; cannot swap it")
            attn.core_attention = CachedSDPA(i, scale, self.rotary_interleaved, self)
        self.groups = config.num_query_groups or config.num_attention_heads
        self.head_dim = config.kv_channels
        #: decode steps on the layers' weights directly (see the module docstring); None: when supported
        supported = direct_decode_supported(gpt)
        if direct and not supported:
            raise ValueError("this decoder's layers are not the plain pre-norm kind the direct decode step computes")
        self.direct = supported if direct is None else direct

    @property
    def device(self) -> torch.device:
        return self.gpt.embedding.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.gpt.embedding.word_embeddings.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, h] of a 1-D id tensor (the decoder input of a text-only prompt)."""
        return self.gpt.embedding(input_ids=token_ids.reshape(1, -1).to(self.device), position_ids=None)[:, 0]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [s, rows, 1, rot_dim] of positions [rows, s], from megatron's
        frequencies; sin is negated where rotate_half negates (the first half, or the even
        elements when interleaved)."""
        freqs = positions.t().float()[..., None] * self.inv_freq.to(positions.device)  # [s, rows, dim/2]
        cos, sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)
        if self.rotary_interleaved:
            cos = torch.stack((cos, cos), dim=-1).flatten(-2)
            sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
        else:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos[:, :, None, :], sin[:, :, None, :]

    @torch.no_grad()
    def prefill(self, prompts: Sequence[torch.Tensor], max_new_tokens: int) -> torch.Tensor:
        """Start a batch: `prompts` are the rows' decoder inputs [T_i, h] (embeddings); the cache
        holds max(T_i) + max_new_tokens slots per row. Rows of equal length are prefilled
        together (causal attention, no mask); row r's prompt fills slots [L - T_r, L)."""
        lengths = [int(p.size(0)) for p in prompts]
        if min(lengths) == 0:
            raise ValueError("empty prompt")
        rows, longest, dev = len(prompts), max(lengths), self.device
        capacity = longest + max_new_tokens
        shape = (rows, self.groups, capacity, self.head_dim)
        layers = len(self.gpt.decoder.layers)
        start = longest - torch.tensor(lengths, device=dev)  # first slot of each row's prompt
        valid = torch.arange(capacity, device=dev)[None] >= start[:, None] if min(lengths) < longest else None
        self.cache = c = KVCache(
            keys=[torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(layers)],
            values=[torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(layers)],
            positions=torch.tensor(lengths, device=dev),
            valid=valid,
            prefill=True,
        )
        logits = torch.empty((rows, self.vocab_size), dtype=torch.float32, device=dev)
        try:
            for n in sorted(set(lengths)):
                group = [r for r in range(rows) if lengths[r] == n]
                x = torch.stack([prompts[r].to(device=dev, dtype=self.dtype) for r in group], dim=1)  # [n, g, h]
                c.prefill_rows = None if len(group) == rows else torch.tensor(group, device=dev)
                c.filled = longest - n
                c.cos, c.sin = self._rope(torch.arange(n, device=dev).expand(len(group), n))
                logits[group] = self._logits(self._decode(x, prefill=True)[-1:])
        finally:
            c.prefill, c.prefill_rows, c.filled = False, None, longest
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [rows] and return the logits that follow it."""
        c = self.cache
        assert c is not None, "prefill first"
        if c.filled >= c.capacity:
            raise ValueError(f"the KV cache holds {c.capacity} slots per row; generation went past it")
        x = self.gpt.embedding(input_ids=tokens.reshape(-1, 1).to(self.device), position_ids=None)  # [1, rows, h]
        c.cos, c.sin = self._rope(c.positions[:, None])
        c.mask = None if c.valid is None else c.valid[:, None, None, : c.filled + 1]
        logits = self._logits(self._decode(x, prefill=False))
        c.filled += 1
        c.positions += 1
        return logits

    def _decode(self, x: torch.Tensor, prefill: bool) -> torch.Tensor:
        """The transformer block (final norm included) with our cached attention."""
        if self.direct and not prefill:
            for layer in self.gpt.decoder.layers:
                x = _direct_layer(layer, x, self.gpt.config)
            return self.gpt.decoder.final_layernorm(x)
        return self.gpt.decoder(hidden_states=x, attention_mask=None)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, rows, h] -> [rows, vocab_size] float32 (the padded vocabulary rows cut off)."""
        gpt = self.gpt
        if self.direct:  # TP=1: the output layer is one matmul with the (possibly tied) table
            weight = (
                gpt.shared_embedding_or_output_weight()
                if gpt.share_embeddings_and_output_weights
                else gpt.output_layer.weight
            )
            logits = F.linear(hidden[0], weight[: self.vocab_size])
        else:
            weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
            logits = gpt.output_layer(hidden, weight=weight, runtime_gather_output=True)[0][0, :, : self.vocab_size]
        return logits.float()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every other row from the cache (`rows`: indices of the rows to keep, in order)."""
        c = self.cache
        assert c is not None
        rows = rows.to(self.device)
        c.keys = [k.index_select(0, rows) for k in c.keys]
        c.values = [v.index_select(0, rows) for v in c.values]
        c.positions = c.positions.index_select(0, rows)
        if c.valid is not None:
            c.valid = c.valid.index_select(0, rows)
            if bool(c.valid.all()):
                c.valid = None


def direct_decode_supported(gpt: torch.nn.Module) -> bool:
    """True when every layer is the pre-norm self-attention + MLP layer of
    `mmtrain.models.layer_specs` at TP=1, in eval mode, so `_direct_layer` computes exactly what
    megatron's modules compute."""
    c = gpt.config
    if (
        c.tensor_model_parallel_size != 1
        or c.apply_residual_connection_post_layernorm
        or c.fp32_residual_connection
        or c.hidden_dropout
        or gpt.decoder.final_layernorm is None
        or c.attention_output_gate
    ):
        return False
    norms = (torch.nn.RMSNorm, torch.nn.LayerNorm)
    for layer in gpt.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        plain = (
            isinstance(attn, SelfAttention)
            and type(mlp) is MLP
            and isinstance(layer.input_layernorm, norms)
            and isinstance(layer.pre_mlp_layernorm, norms)
            and all(
                isinstance(getattr(attn, n, None), (type(None), IdentityOp)) for n in ("q_layernorm", "k_layernorm")
            )
            and isinstance(layer.cross_attention, IdentityOp)
        )
        if not plain:
            return False
    return True


def _linear(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    return F.linear(x, module.weight, getattr(module, "bias", None))


def _direct_layer(layer: torch.nn.Module, x: torch.Tensor, config) -> torch.Tensor:
    """One decode step [1, rows, h] through a pre-norm layer, on its weights: what
    `TransformerLayer.forward` computes for this layer kind (megatron's fused QKV layout: per
    query group, its heads' queries then one key and one value)."""
    attn = layer.self_attention
    heads, groups, dim = (
        config.num_attention_heads,
        config.num_query_groups or config.num_attention_heads,
        config.kv_channels,
    )
    s, rows = x.shape[:2]
    qkv = _linear(layer.input_layernorm(x), attn.linear_qkv).view(s, rows, groups, (heads // groups + 2) * dim)
    q, k, v = torch.split(qkv, [heads // groups * dim, dim, dim], dim=3)
    out = attn.core_attention(q.reshape(s, rows, heads, dim), k, v, None)
    x = x + _linear(out, attn.linear_proj)
    mlp = layer.mlp
    y = _linear(layer.pre_mlp_layernorm(x), mlp.linear_fc1)
    if config.gated_linear_unit:
        gate, up = torch.chunk(y, 2, dim=-1)
        y = config.activation_func(gate) * up
    else:
        y = config.activation_func(y)
    return x + _linear(y, mlp.linear_fc2)
