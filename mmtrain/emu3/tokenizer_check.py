"""Emu3's tokenizer check before training (`FamilySpec.check_tokenizer`, run by preflight): the
tokenizer must be an Emu3 one (its special and visual tokens, what the loader's task encoder
reads), with a visual token for every code of the VQ the token shards were made with, and fit the
model's vocabulary rows. Without it a Qwen2 tokenizer passed preflight and failed inside the
loader after `run_dir` was written. Reads the shards' manifests, so it lives outside the spec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mmdata import shard_format as sf
from mmdata.energon_loaders.emu3.serialize import Emu3Vocab
from mmtrain.config.schema import Recipe
from mmtrain.runtime.preflight import leaf_datasets

#: files of an HF tokenizer dir: a VQ dir that has them (an HF Emu3 dir) holds the matching tokenizer
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json")


def check_tokenizer(recipe: Recipe, tokenizer: Any) -> list[str]:
    """Problems of `tokenizer.path` for Emu3 training, each naming the key and what the token
    shards in `data.paths` were made with."""
    path = recipe.tokenizer.path
    made = _made_with(recipe.data.paths)
    try:
        vocab = Emu3Vocab.from_tokenizer(tokenizer)
    except ValueError as err:
        return [f"tokenizer.path: the tokenizer at {path} is not an Emu3 tokenizer ({_reason(err)}); {_fix(made)}"]
    problems = []
    codes = made.get("codebook_size")
    if isinstance(codes, int) and vocab.codebook_size < codes:
        problems.append(
            f"tokenizer.path: the tokenizer at {path} has {vocab.codebook_size} visual tokens, but "
            f"{_shards(made)} hold codes of a {codes}-code VQ; {_fix(made)}"
        )
    if len(tokenizer) > recipe.model.llm.vocab_size:
        problems.append(
            f"tokenizer.path: the tokenizer at {path} has {len(tokenizer)} tokens but "
            f"model.llm.vocab_size is {recipe.model.llm.vocab_size}; use the model's own tokenizer "
            "(or a larger vocab_size)"
        )
    return problems


def _reason(err: ValueError) -> str:
    """Emu3Vocab's message as a clause: "tokenizer has no Emu3 bos token ..." -> "it has no ..."."""
    text = str(err).split(": not an Emu3 tokenizer")[0]
    if text.startswith("tokenizer's "):
        return "its " + text.removeprefix("tokenizer's ")
    return "it " + text.removeprefix("tokenizer ")


def _made_with(paths: list[str]) -> dict[str, Any]:
    """What the first token shard folder's manifest records: its folder, the VQ model's path and
    codebook size, and the fingerprint of the tokenizer its length index was counted with."""
    for data in paths:
        for leaf in leaf_datasets(Path(data)):
            try:
                manifest = json.loads((leaf / sf.MANIFEST_NAME).read_text())
                vq = manifest["vision_tokenizer"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            index = manifest.get("length_index") or {}
            return {
                "shards": str(leaf),
                "vq": vq.get("path"),
                "codebook_size": (vq.get("config") or {}).get("codebook_size"),
                "tokenizer_sha256": index.get("tokenizer_sha256"),
            }
    return {}


def _shards(made: dict[str, Any]) -> str:
    return f"the token shards at {made['shards']}" if made else "the token shards"


def _fix(made: dict[str, Any]) -> str:
    """Which tokenizer goes with the shards: the one of the HF Emu3 model their VQ came from."""
    if not made.get("vq"):
        return "give the Emu3 tokenizer the token shards were made for (tokenizer.path=DIR of an HF Emu3 model)"
    vq = Path(made["vq"])
    counted = (
        f", and their length index was counted with the tokenizer of sha256 {made['tokenizer_sha256'][:12]}"
        if made.get("tokenizer_sha256")
        else ""
    )
    if any((vq / f).is_file() for f in _TOKENIZER_FILES):
        use = f"use the Emu3 tokenizer that came with it: tokenizer.path={vq}"
    else:
        use = "use the Emu3 tokenizer of the HF Emu3 model that VQ came from (tokenizer.path=DIR)"
    return f"{_shards(made)} were made with the VQ model at {vq}{counted}: {use}"
