"""The Emu3 TaskEncoder: VQ token samples (`mmdata tokenize-images` shards) -> packed `Emu3Batch`es.

`encode_sample` (energon hook, `@stateless(restore_seeds=True)`): picks the sample's task,
renders its tokens (tasks.py), shifts the labels and applies the over-length policy. Token
grids are already in the shard, so there is nothing to decode later; packing, counted skips and
the batch hook are the common `task_encoding.PackingTaskEncoder`.

Randomness (which task, whether a caption is dropped for classifier-free guidance) is drawn from
Python's `random`, which energon seeds per sample from the worker seed (the recipe's seed, the
rank and worker) and the sample's index before calling the hook, and re-seeds identically when
it replays a sample on restore: the choices are reproducible across runs and exact across resume.

Tasks: a record whose metadataset entry has the subflavor `task: understanding|generation`
takes that task; otherwise it is drawn with `tasks` weights (generation only for records with
one image and one question/answer exchange, the answer being the caption; see tasks.py). With
`packing: plan` the plan drew each sample's task and CFG drop when it was made, and the loader
hands them over (subflavor PLAN_VARIANT, plan_lengths.py): the plan's lengths are exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from megatron.energon import Sample, edataclass, stateless

from mmdata.energon_loaders.emu3.batch import Emu3Batch
from mmdata.energon_loaders.emu3.tasks import (
    DEFAULT_SYSTEM_PROMPT,
    GENERATION,
    TASKS,
    UNDERSTANDING,
    Emu3Tasks,
    generation_caption,
    pick_task,
)
from mmdata.energon_loaders.plan_packing import PLAN_VARIANT
from mmdata.energon_loaders.sequence import ConversationError
from mmdata.energon_loaders.task_encoding import PackingTaskEncoder, packed_batch_fields
from mmdata.energon_loaders.emu3.vq_token_sample import VQTokenSample
from mmdata.packing.emu3_geometry import variant_task


@dataclass
class Emu3EncoderConfig:
    seq_length: int
    #: task -> weight of the per-sample draw (see the module docstring)
    tasks: dict[str, float] = field(default_factory=lambda: {UNDERSTANDING: 1.0, GENERATION: 1.0})
    #: probability that a generation sample's caption is replaced by `uncond_prompt` (CFG)
    p_uncond: float = 0.05
    uncond_prompt: str = ""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"unknown Emu3 task(s) {unknown}; known: {list(TASKS)}")
        if any(w < 0 for w in self.tasks.values()) or not sum(self.tasks.values()) > 0:
            raise ValueError(f"task weights must be >= 0 with a positive sum, got {self.tasks}")
        if not 0.0 <= self.p_uncond <= 1.0:
            raise ValueError(f"p_uncond must be in [0, 1], got {self.p_uncond}")


@edataclass
class Emu3Sample(Sample):
    id: str
    input_ids: np.ndarray
    labels: np.ndarray  # shifted
    task: str
    uncond: bool = False  # a generation sample whose caption was dropped
    truncated: bool = False


class Emu3TaskEncoder(PackingTaskEncoder):
    """VQTokenSample -> Emu3Sample (one task each) -> packed Emu3Batch."""

    sample_type = VQTokenSample

    config: Emu3EncoderConfig

    def build_text(self, tokenizer) -> Emu3Tasks:
        return Emu3Tasks(tokenizer, self.config.system_prompt)

    @property
    def tasks(self) -> Emu3Tasks:
        return self.text

    def _task_of(self, sample: VQTokenSample, caption: str | None) -> str:
        forced = (sample.__subflavors__ or {}).get("task")
        u = random.random()  # seeded by energon per sample (restore_seeds)
        if forced is not None:
            if forced not in TASKS:
                raise self._skip("bad_task_subflavor", sample.id, f"subflavor task={forced!r}; known: {list(TASKS)}")
            if forced == GENERATION and caption is None:
                raise self._skip("not_a_generation_sample", sample.id, "needs one image and one question/answer")
            return forced
        task = pick_task(u, self.config.tasks, caption is not None)
        if task is None:
            raise self._skip("not_a_generation_sample", sample.id, "needs one image and one question/answer")
        return task

    @stateless(restore_seeds=True)
    def encode_sample(self, sample: VQTokenSample) -> Emu3Sample:
        self._require_sample_type(sample)
        c, sid = self.config, str(sample.id)
        grids = list(sample.image_tokens or [])
        conversations = list(sample.conversations)
        caption = generation_caption(conversations, len(grids))
        planned = (sample.__subflavors__ or {}).get(PLAN_VARIANT)
        if planned is None:
            task = self._task_of(sample, caption)
            uncond = task == GENERATION and random.random() < c.p_uncond
        else:  # `packing: plan`: the plan drew the task and the CFG drop (plan_lengths.py)
            task, uncond = variant_task(planned)
            if task == GENERATION and caption is None:
                raise self._skip("not_a_generation_sample", sid, "the plan's generation sample has no caption")
        try:
            if task == GENERATION:
                tokens = self.tasks.generation(c.uncond_prompt if uncond else caption, grids[0])
            else:
                tokens = self.tasks.understanding(conversations, grids)
        except ConversationError as exc:
            raise self._skip(exc.reason, sid, str(exc)) from exc
        result = self._fit_length(tokens, sid)
        self._count(f"task/{task}")
        if uncond:
            self._count("task/generation_uncond")
        return self._encoded(Emu3Sample, sample, sid, result, task=task, uncond=uncond)

    def collate(self, rows: list[list[Emu3Sample]], stats: dict[str, int]) -> Emu3Batch:
        return Emu3Batch(
            **packed_batch_fields(rows, self.config.seq_length, self.tasks.vocab.pad, stats),
            tasks=[[s.task for s in row] for row in rows],
        )
