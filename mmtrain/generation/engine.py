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


def generate(model: GenerationModel, requests: Sequence[GenerationRequest], sampling: SamplingParams, *,
             batch_size: int = 8, progress: Optional[Progress] = None) -> list[GenerationResult]:
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
        results += _generate_batch(decoder, model, list(requests[start:start + batch_size]), sampling, tick)
    return results


def _prompt_input(model: GenerationModel, decoder: CachedDecoder, prompt: Any) -> torch.Tensor:
    if model.embed_prompt is not None:
        return model.embed_prompt(prompt)
    return decoder.embed(torch.as_tensor(prompt, dtype=torch.long))


@torch.no_grad()
def _generate_batch(decoder: CachedDecoder, model: GenerationModel, requests: list[GenerationRequest],
                    sampling: SamplingParams, tick: Callable[[int], None]) -> list[GenerationResult]:
    # rows: every request's conditional row, then the unconditional rows of the guided ones
    guided = [i for i, r in enumerate(requests) if r.guided]
    prompts = [_prompt_input(model, decoder, r.prompt) for r in requests]
    prompts += [_prompt_input(model, decoder, requests[i].negative_prompt) for i in guided]
    cond_row = {i: i for i in range(len(requests))}
    uncond_row = {i: len(requests) + j for j, i in enumerate(guided)}
    dev = decoder.device
    generators = [torch.Generator(device=dev).manual_seed(int(r.seed)) for r in requests]
    results = [GenerationResult() for _ in requests]
    active = list(range(len(requests)))  # requests still generating, in row order

    logits = decoder.prefill(prompts, max(r.max_new_tokens for r in requests))
    step = 0
    while active:
        logprobs = torch.log_softmax(logits, dim=-1)
        scores = logprobs[[cond_row[i] for i in active]]
        g_pos = [k for k, i in enumerate(active) if i in uncond_row]
        if g_pos:
            g_req = [active[k] for k in g_pos]
            scale = torch.tensor([requests[i].guidance_scale for i in g_req], device=scores.device)
            scores[g_pos] = guided_logprobs(scores[g_pos], logprobs[[uncond_row[i] for i in g_req]], scale)
        for k, i in enumerate(active):
            if requests[i].logits_processor is not None:
                scores[k] = requests[i].logits_processor(scores[k], step)
        tokens = sample_next(scores, sampling, [generators[i] for i in active]).tolist()
        step += 1
        tick(len(active))
        still = []
        for i, tok in zip(active, tokens):
            r, res = requests[i], results[i]
            res.tokens.append(int(tok))
            if tok in r.stop_token_ids:
                res.finish_reason = "stop_token"
            elif len(res.tokens) >= r.max_new_tokens:
                res.finish_reason = "max_new_tokens"
            else:
                still.append(i)
        if not still:
            break
        if len(still) < len(active):  # drop finished requests' rows from the cache
            next_tok = {i: results[i].tokens[-1] for i in still}
            old_rows = [cond_row[i] for i in still] + [uncond_row[i] for i in still if i in uncond_row]
            decoder.keep_rows(torch.tensor(old_rows, dtype=torch.long))
            cond_row = {i: k for k, i in enumerate(still)}
            kept_guided = [i for i in still if i in uncond_row]
            uncond_row = {i: len(still) + j for j, i in enumerate(kept_guided)}
            active = still
        else:
            next_tok = {i: results[i].tokens[-1] for i in active}
            cond_row = {i: cond_row[i] for i in active}
        feed = torch.empty(len(cond_row) + len(uncond_row), dtype=torch.long)
        for i in active:
            feed[cond_row[i]] = next_tok[i]
            if i in uncond_row:
                feed[uncond_row[i]] = next_tok[i]
        logits = decoder.step(feed)
    return results


@dataclass
class GenerationJob:
    """What a family's `GenerationSpec.prepare` returns to the shared command."""

    model: GenerationModel
    requests: list[GenerationRequest]
    #: (results in request order) -> None: decodes and writes the outputs (files, stdout)
    finish: Callable[[list[GenerationResult]], None]
    #: what one request produces, for the progress line ("image", "answer")
    unit: str = "output"
