"""The Emu3 reference's constrained image decoding, for transformers' `generate`.

transformers' Emu3 docs (and the Emu3 reference code) decode an image with a
`prefix_allowed_tokens_fn` that forces the image grammar: after the `img` token, `cols` visual
tokens then an end-of-line per row, then end-of-frame, end-of-image, end-of-sequence, then
padding. mmtrain's own engine enforces the same grammar itself; this function is the oracle that
tests/test_generate.py, tests/gpu and benchmarks/bench_generate.py compare it with, kept in the
package so that none of them imports another's file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def emu3_prefix_constraint(
    rows: int, cols: int, img: int, eol: int, eof: int, eoi: int, eos: int, pad: int, visual: Sequence[int]
) -> Callable[[int, Any], Sequence[int]]:
    """transformers' `prefix_allowed_tokens_fn` for a rows x cols Emu3 image (token ids as named
    in the module docstring; `visual`: the ids of the visual tokens)."""

    def allowed(batch_id: int, input_ids: Any) -> Sequence[int]:
        offset = input_ids.shape[0] - torch.nonzero(input_ids == img, as_tuple=True)[0][0]
        if offset % (cols + 1) == 0:
            return (eol,)
        if offset == (cols + 1) * rows + 1:
            return (eof,)
        if offset == (cols + 1) * rows + 2:
            return (eoi,)
        if offset == (cols + 1) * rows + 3:
            return (eos,)
        if offset > (cols + 1) * rows + 3:
            return (pad,)
        return visual

    return allowed
