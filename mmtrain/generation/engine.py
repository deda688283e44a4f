"""The generation engine every family uses: batches of requests through a `CachedDecoder`,
classifier-free guidance with conditional and unconditional rows in one forward per step,
per-request logits processors (e.g. a structure constraint), seeded sampling, stop conditions.

A family hands over a `GenerationModel` (its decoder and how one of its prompts becomes decoder
input, e.g. token embeddings with image features placed in them) and `GenerationRequest`s whose
prompts that model understands; the engine knows nothing else about the family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from mmtrain.generation.decoder import CachedDecoder
from mmtrain.generation.sampling import SamplingParams, guided_logprobs, sample_next

#: (log-probs [V] of one request's next token, number of tokens it generated so far) -> log-probs;
#: e.g. an image grammar that allows only the tokens that keep the output decodable
LogitsProcessor = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class GenerationModel:
    """What the engine runs: the family's decoder (a megatron `GPTModel`) and its prompt input."""

    #: the loaded model's megatron GPTModel (whole: TP=1, PP=1)
    decoder: torch.nn.Module
    #: the true vocabulary (logits of padded rows are never sampled)
    vocab_size: int
    #: (a request's prompt) -> its decoder input [T, hidden] on the decoder's device; None: the
    #: prompt is a 1-D tensor / list of token ids, embedded by the decoder's embedding
    embed_prompt: Optional[Callable[[Any], torch.Tensor]] = None


@dataclass
class GenerationRequest:
    """One prompt to continue."""

    prompt: Any
    max_new_tokens: int
    #: guidance: the unconditional row's prompt (None: no guidance)
    negative_prompt: Any = None
    #: `uncond + scale * (cond - uncond)` on log-probs; 1 = plain sampling (no unconditional row)
    guidance_scale: float = 1.0
    #: the request's own generator seed: its tokens do not depend on the other requests
    seed: int = 0
    #: generation ends after any of these (it is kept in the output)
    stop_token_ids: tuple[int, ...] = ()
    logits_processor: Optional[LogitsProcessor] = None

    @property
    def guided(self) -> bool:
        return self.negative_prompt is not None and self.guidance_scale != 1.0


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)
    #: "stop_token" or "max_new_tokens"
    finish_reason: str = ""


#: progress callback: (tokens generated in this call, upper bound of the total)
Progress = Callable[[int, int], None]


def generate(
    model: GenerationModel,
    requests: Sequence[GenerationRequest],
    sampling: SamplingParams,
    *,
    batch_size: int = 8,
    progress: Optional[Progress] = None,
) -> list[GenerationResult]:
    """Generate every request, `batch_size` requests (each one or two rows) per static batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for r in requests:
        if r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
    decoder = CachedDecoder(model.decoder, model.vocab_size)
    total = sum(r.max_new_tokens for r in requests)
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    results: list[GenerationResult] = []
    for start in range(0, len(requests), batch_size):
        results += _generate_batch(decoder, model, list(requests[start : start + batch_size]), sampling, tick)
    return results


def _prompt_input(model: GenerationModel, decoder: CachedDecoder, prompt: Any) -> torch.Tensor:
    if model.embed_prompt is not None:
        return model.embed_prompt(prompt)
    return decoder.embed(torch.as_tensor(prompt, dtype=torch.long))


@torch.no_grad()
def _generate_batch(
    decoder: CachedDecoder,
    model: GenerationModel,
    requests: list[GenerationRequest],
    sampling: SamplingParams,
    tick: Callable[[int], None],
) -> list[GenerationResult]:
    """Rows: the active requests' conditional rows in request order, then the unconditional rows
    of the guided ones among them, in the same order (kept so when finished requests leave)."""
    guided = {i for i, r in enumerate(requests) if r.guided}
    prompts = [_prompt_input(model, decoder, r.prompt) for r in requests]
    prompts += [_prompt_input(model, decoder, r.negative_prompt) for i, r in enumerate(requests) if i in guided]
    generators = [torch.Generator(device=decoder.device).manual_seed(int(r.seed)) for r in requests]
    results = [GenerationResult() for _ in requests]
    active = list(range(len(requests)))
    logits = decoder.prefill(prompts, max(r.max_new_tokens for r in requests))
    step = 0
    while True:
        logprobs = torch.log_softmax(logits, dim=-1)
        scores = logprobs[: len(active)].clone()
        g_pos = [k for k, i in enumerate(active) if i in guided]
        if g_pos:
            scale = torch.tensor([requests[active[k]].guidance_scale for k in g_pos], device=scores.device)
            scores[g_pos] = guided_logprobs(scores[g_pos], logprobs[len(active) :], scale)
        for k, i in enumerate(active):
            if requests[i].logits_processor is not None:
                scores[k] = requests[i].logits_processor(scores[k], step)
        tokens = sample_next(scores, sampling, [generators[i] for i in active]).tolist()
        step += 1
        tick(len(active))
        for i, tok in zip(active, tokens):
            results[i].tokens.append(int(tok))
            if tok in requests[i].stop_token_ids:
                results[i].finish_reason = "stop_token"
            elif len(results[i].tokens) >= requests[i].max_new_tokens:
                results[i].finish_reason = "max_new_tokens"
        still = [i for i in active if not results[i].finish_reason]
        if not still:
            return results
        if len(still) < len(active):  # drop the finished requests' rows from the cache
            cond = [k for k, i in enumerate(active) if not results[i].finish_reason]
            uncond = [len(active) + j for j, k in enumerate(g_pos) if not results[active[k]].finish_reason]
            decoder.keep_rows(torch.tensor(cond + uncond, dtype=torch.long))
            active = still
        last = [results[i].tokens[-1] for i in active]
        logits = decoder.step(torch.tensor(last + [t for i, t in zip(active, last) if i in guided], dtype=torch.long))


@dataclass
class GenerationJob:
    """What a family's `GenerationSpec.prepare` returns to the shared command."""

    model: GenerationModel
    requests: list[GenerationRequest]
    #: (results in request order) -> None: decodes and writes the outputs (files, stdout)
    finish: Callable[[list[GenerationResult]], None]
    #: what one request produces, for the progress line ("image", "answer")
    unit: str = "output"
