"""HF tokenizers from local folders only. A tokenizer path is a folder on this machine: it is
checked before transformers sees it and loaded with `local_files_only`, so a typo is one clear
line at once instead of minutes of hub retries (the project makes no network calls at run time;
both console scripts also set HF_HUB_OFFLINE=1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmdata.errors import UserError


def load_local_tokenizer(path: str | Path, what: str = "tokenizer") -> Any:
    """`AutoTokenizer` of the folder `path`; UserError naming `what` (the flag or recipe key)
    when it is missing or holds no tokenizer."""
    p = Path(path).expanduser()
    if not p.is_dir():
        state = "is a file, not a folder" if p.exists() else "does not exist"
        raise UserError(f"{what} {path} {state}: give a local HF tokenizer folder (nothing is downloaded)")
    from transformers import AutoTokenizer  # lazy: imports torch; Ray length workers stay light

    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{what} {path} holds no loadable HF tokenizer ({first})") from None
