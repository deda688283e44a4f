"""The model families mmtrain can build: the one place the CLI (`mmtrain train`'s `family:`, the
`mmtrain <family>` aliases, `mmtrain convert --model`, `mmtrain generate <family>`), recipe
validation, checkpoint loading and planning learn which families exist. A new family adds its
`FamilySpec` here (see mmtrain/spec.py and docs/architecture.md).

One of the named lazy-import boundaries: a spec names its heavy callables (model, loader,
conversion, generation) as `Ref("module:function")`, imported on first call and cached
(`mmtrain.spec.resolve`), so importing the registry imports no torch."""

from __future__ import annotations

from mmtrain.config.errors import suggest
from mmtrain.emu3.spec import EMU3
from mmtrain.llava_ov.spec import LLAVA_OV
from mmtrain.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (LLAVA_OV, EMU3)}


def family_names() -> list[str]:
    return list(FAMILIES)


def get_family(name: str) -> FamilySpec:
    """The family's spec; KeyError naming the known families (and the closest) otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(
            f"unknown model family {name!r}{suggest(name, family_names())} (known: {', '.join(family_names())})"
        ) from None


def convertible_families() -> list[str]:
    """Families with an HF counterpart (`mmtrain convert --model`)."""
    return [name for name, spec in FAMILIES.items() if spec.hf is not None]


def hf_flags(kind: str) -> dict[str, str]:
    """`--flag` -> help, over every family's `assemble_from` or `export_from` (`mmtrain convert`'s
    parser and what it runs)."""
    flags: dict[str, str] = {}
    for name in convertible_families():
        for flag, help_text in getattr(get_family(name).hf, kind).items():
            flags[flag] = f"{flags[flag]}; {help_text} [{name}]" if flag in flags else f"{help_text} [{name}]"
    return flags
