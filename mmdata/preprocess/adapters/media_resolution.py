"""How a record's `image` / `video` entries find their bytes.

In the published Infinity-MM tars a sample is `{stem}.json` plus its media members
`{stem}.jpg|png|webp…` (webdataset: one key, several members), and the record's `image` field
is provenance - an absolute path on the producer's storage whose basename and even extension
need not match the member. So each entry is resolved, in this order:

1. `by_name`: a member (or, for llava-json, a file under the image root) named exactly as the
   entry - an explicit locator;
2. `by_basename`: one of the sample's own members with the entry's basename; when the sample
   has no media member of that kind at all, any member of the input file with that basename
   (a basename coincidence must never displace the sample's own image);
3. `by_stem`: the sample's own members not claimed by rules 1-2, in member order, taken by the
   remaining entries in their order (a multi-image list maps in order onto `{stem}.*`).

Member order is the numbering of the webdataset convention - `{stem}.jpg` first, then
`{stem}.1.png`, `{stem}.2.png`, … - and tar order among members without a number, so a tar
written in name order (where `{stem}.1.png` sorts before `{stem}.jpg`) keeps its images in the
right order. A record without the field uses all its own members (`by_stem`); an explicitly
empty field (`null`, `""`, `[]`) means text-only, and own members nobody refers to are counted
as `unreferenced_members`. An entry that none of the rules resolves leaves the record
unresolved (quarantined as image_missing / video_missing by the validator).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from mmdata.preprocess.adapters.base import MediaRef
from mmdata.shard_job.manifest import MEDIA_RULES as RULES  # the manifest counts each; strongest first


class Locator(Protocol):
    def by_name(self, ref: str) -> MediaRef | None: ...

    def by_basename(self, ref: str) -> MediaRef | None: ...


@dataclass(slots=True)
class Resolution:
    media: list[MediaRef | None]  # parallel to the entries; None: not found
    rules: list[str | None]
    unreferenced: int  # own members no entry took

    @property
    def complete(self) -> bool:
        return None not in self.media

    @property
    def rule(self) -> str | None:
        return weakest(self.rules)


_RANK = {rule: i for i, rule in enumerate(RULES)}


def weakest(rules: Iterable[str | None]) -> str | None:
    """A record's rule: the weakest one any of its media needed (None: no media)."""
    worst = None
    for rule in rules:
        if rule is not None and (worst is None or _RANK[rule] > _RANK[worst]):
            worst = rule
    return worst


def basename(ref: str) -> str:
    return ref.replace("\\", "/").rsplit("/", 1)[-1]


def resolve(entries: list[str] | None, own: list[str], locator: Locator) -> Resolution:
    """Resolve a record's entries (None: the field is absent) against the sample's own member
    names (`own`, in member order) and the input's `locator`."""
    if entries is None:  # no field: the sample's own members are its media
        return Resolution([locator.by_name(n) for n in own], ["by_stem"] * len(own), 0)
    media: list[MediaRef | None] = [None] * len(entries)
    rules: list[str | None] = [None] * len(entries)
    claimed: set[str] = set()
    own_by_base: dict[str, str] = {}
    for name in own:
        own_by_base.setdefault(basename(name), name)
    for i, ref in enumerate(entries):
        m = locator.by_name(ref)
        if m is not None:
            media[i], rules[i] = m, "by_name"
            claimed.add(m.name)
            continue
        name = own_by_base.get(basename(ref))
        if name is not None and name not in claimed:
            media[i], rules[i] = locator.by_name(name), "by_basename"
            claimed.add(name)
    free = [n for n in own if n not in claimed]
    for i, ref in enumerate(entries):
        if media[i] is not None:
            continue
        if free:
            media[i], rules[i] = locator.by_name(free.pop(0)), "by_stem"
        elif not own and (m := locator.by_basename(ref)) is not None:
            media[i], rules[i] = m, "by_basename"
    return Resolution(media, rules, len(free))


def member_order(names: list[str]) -> list[str]:
    """Own media member names in webdataset numbering order (see the module docstring)."""
    if len(names) < 2:
        return names

    def rank(item: tuple[int, str]) -> tuple[int, int, int]:
        pos, name = item
        parts = basename(name).split(".")
        if len(parts) == 2:  # {stem}.{ext}
            return (0, 0, pos)
        if len(parts) == 3 and parts[1].isdigit():  # {stem}.{N}.{ext}
            return (0, int(parts[1]), pos)
        return (1, 0, pos)

    return [name for _, name in sorted(enumerate(names), key=rank)]
