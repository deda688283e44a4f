"""The option every family's `mmtrain generate FAMILY` takes: one `--prompt`, or a `--prompts FILE`
(mmtrain/generation/prompts.py reads it). Light at import, argparse only: the CLI builds its
parser from the families' generate_cli modules before anything heavy loads."""

from __future__ import annotations

import argparse
from typing import Any


def add_prompt_group(p: argparse.ArgumentParser, title: str, prompt_help: str, prompts_help: str) -> Any:
    """The family's argument group (returned, for its own options) holding `--prompt` and
    `--prompts FILE`, one of them required."""
    g = p.add_argument_group(title)
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help=prompt_help)
    what.add_argument("--prompts", metavar="FILE", help=prompts_help)
    return g
